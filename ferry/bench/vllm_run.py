"""Run vLLM beside Ferry in the same benchmark: find an interpreter that
imports vllm and keep ``vllm_offline.py`` running there as a subprocess that
generates on request (see that file for the protocol)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).with_name("vllm_offline.py")


class VllmUnavailable(RuntimeError):
    pass


def vllm_version(python: str) -> str | None:
    """vllm's version as ``python`` imports it, or None where it does not."""
    try:
        out = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], check=False,
                             capture_output=True, text=True, timeout=300, cwd="/")  # cwd: not this repo
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[-1] if out.returncode == 0 and lines else None


def find_vllm_python(explicit: str | None) -> tuple[str, str] | None:
    """(interpreter, vllm version): the given one (an error if it has no
    vllm), else this interpreter where vllm imports, else None."""
    if explicit:
        version = vllm_version(explicit)
        if version is None:
            raise VllmUnavailable(f"{explicit}: cannot import vllm")
        return explicit, version
    version = vllm_version(sys.executable)
    return (sys.executable, version) if version else None


class VllmOffline:
    """vllm_offline.py under ``python``; ``generate`` is one timed batch."""

    def __init__(self, python: str, model_dir: str, dtype: str, max_model_len: int, log_path: str | None = None,
                 kv_cache_gb: float = 1.0, max_num_batched_tokens: int | None = None):
        self.log_path = log_path
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 (closed in close())
        env = dict(os.environ)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self.proc = subprocess.Popen([python, str(SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, cwd="/", env=env)
        ready = self._call({"model_dir": model_dir, "dtype": dtype, "max_model_len": max_model_len,
                            "kv_cache_gb": kv_cache_gb, "max_num_batched_tokens": max_num_batched_tokens})
        self.version = ready.get("vllm_version", "?")

    def _call(self, msg: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the read below reports the exit
        while True:
            line = self.proc.stdout.readline()
            if not line:
                tail = pathlib.Path(self.log_path).read_text()[-2000:] if self.log_path else "(no --vllm-log)"
                self.close()
                raise VllmUnavailable(f"vllm_offline.py exited ({self.proc.returncode}):\n{tail}")
            if line.startswith("{"):
                return json.loads(line)

    def generate(self, prompts: list[list[int]], output_len: int) -> dict:
        """{"tok_s", "tokens", "seconds", "cpu_s"} of one timed batch."""
        return self._call({"prompts": prompts, "output_len": output_len})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self.log_path:
            self._log.close()
            self.log_path = None
