"""deploy/compose, started for real (marker ``docker``: only where a Docker
engine and the Compose v2 CLI are there; skipped elsewhere with the reason).

One compose project, named apart from a user's ``ferry``, on the CPU profile
plus a second CPU instance (an override file that ``extends`` instance-cpu,
the way deploy/compose/README.md adds instances):

1. the CPU image is built from deploy/docker/Dockerfile.cpu on a base made
   from Debian packages (deploy/docker/base.sh, when the base is missing), with
   the host's extra CAs and its local torch CPU wheel in the build context;
2. ``init.sh`` makes the cluster token and the API key; ``docker compose
   --profile cpu up -d`` starts the stack, and every service turns healthy;
3. the ``openai`` client gets an answer through the published port, with the
   generated key (and none without it);
4. ``docker compose kill`` of the instance that runs most of a batch of
   streaming requests: every stream still ends normally (the frontend resumes
   the killed instance's requests on the other one) and the frontend counted
   the resumes;
5. ``docker compose down -v`` leaves no container, network or volume behind.

Image, project and port are the test's own; traffic stays on this machine
(the published port is bound to 127.0.0.1). Settings: FERRY_TEST_BASE_IMAGE
(default ferry-base:bookworm, built by deploy/docker/base.sh when missing;
python:3.11-slim-bookworm where a registry is reachable)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import secrets
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from ferry.cluster import free_port
from tests.deploy.test_compose import COMPOSE_DIR, COMPOSE_FILE, ROOT, load_env_file
from tests.docker_env import compose_cmd

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(3600)]

BASE_IMAGE = os.environ.get("FERRY_TEST_BASE_IMAGE", "ferry-base:bookworm")
IMAGE = "ferry:cpu-live-test"
TORCH_WHEEL = re.compile(r"torch-2\.13\.0\+cpu-cp311-cp311-manylinux[^/]*_x86_64\.whl$")
# Generous bounds on waiting for things to happen, not timing checks.
READY_WITHIN_S = 900
STREAMS = 6
STREAM_TOKENS = 128


def log(msg: str) -> None:
    print(f"[compose-live] {msg}", flush=True)


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["docker", *args], check=False, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def resources() -> dict[str, set[str]]:
    """Every container, network and volume the engine has (ids)."""
    return {
        "containers": set(docker("ps", "-aq", "--no-trunc").stdout.split()),
        "networks": set(docker("network", "ls", "-q", "--no-trunc").stdout.split()),
        "volumes": set(docker("volume", "ls", "-q").stdout.split()),
    }


# --------------------------------------------------------------- the build context extras
def pip_find_links() -> list[pathlib.Path]:
    """The local wheel folders pip is configured with (PIP_FIND_LINKS, pip config)."""
    values = os.environ.get("PIP_FIND_LINKS", "").split()
    r = subprocess.run(["python3", "-m", "pip", "config", "list"], check=False, capture_output=True,
                       text=True, timeout=60)
    for line in r.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            values += value.strip("'\"").split()
    return [pathlib.Path(v.removeprefix("file://")) for v in values if not re.match(r"https?://", v)]


def build_extras() -> list[pathlib.Path]:
    """Puts what a build behind this host's proxy and without the PyTorch index
    needs into the build context (deploy/docker/ca, deploy/docker/wheels: both
    git-ignored): Debian's local CAs (/usr/local/share/ca-certificates/*.crt)
    and a torch 2.13.0 CPU wheel from pip's find-links. Returns what it added."""
    added: list[pathlib.Path] = []
    ca_dir = ROOT / "deploy" / "docker" / "ca"
    for crt in sorted(pathlib.Path("/usr/local/share/ca-certificates").rglob("*.crt")):
        dest = ca_dir / f"host-{crt.name}"
        if not dest.exists():
            shutil.copyfile(crt, dest)
            added.append(dest)
    wheel_dir = ROOT / "deploy" / "docker" / "wheels"
    if not any(TORCH_WHEEL.search(p.name) for p in wheel_dir.glob("*.whl")):
        for folder in pip_find_links():
            found = sorted(p for p in folder.glob("*.whl") if TORCH_WHEEL.search(p.name))
            if found:
                dest = wheel_dir / found[-1].name
                shutil.copyfile(found[-1], dest)
                added.append(dest)
                break
    return added


# ------------------------------------------------------------------------- the stack
class Stack:
    def __init__(self, tmp: pathlib.Path):
        self.tmp = tmp
        self.project = f"ferry-live-{secrets.token_hex(3)}"
        self.port = free_port()
        self.override = tmp / "override.yml"
        self.timings: dict[str, float] = {}

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FERRY_", "COMPOSE_", "MODEL_DIR"))}
        env.update(
            COMPOSE_BAKE="false",  # compose's in-process build: no buildx plugin needed
            FERRY_CPU_IMAGE=IMAGE,
            FERRY_PYTHON_IMAGE=BASE_IMAGE,
            FERRY_HTTP_BIND="127.0.0.1",
            FERRY_HTTP_PORT=str(self.port),
            FERRY_CLUSTER_TOKEN_FILE=str(self.tmp / "cluster-token"),
        )
        return env

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [*compose_cmd(), "-p", self.project, "-f", str(COMPOSE_FILE), "-f", str(self.override),
               "--project-directory", str(COMPOSE_DIR), "--env-file", str(self.tmp / ".env"),
               "--profile", "cpu", *args]
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=self.env())
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(cmd[len(compose_cmd()):])} failed ({r.returncode}):\n"
                                 f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
        return r

    @property
    def api_key(self) -> str:
        return load_env_file(self.tmp / ".env")["FERRY_API_KEY"]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def http(self, path: str, key: str | None = None) -> tuple[int, str]:
        req = urllib.request.Request(self.base_url + path)
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> dict[str, float]:
        status, text = self.http("/metrics", self.api_key)
        assert status == 200, (status, text[:300])
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def services(self) -> dict[str, dict]:
        """`docker compose ps -a` by service: State, Health, ExitCode."""
        out = self.compose("ps", "-a", "--format", "json").stdout.strip()
        rows = json.loads(out) if out.startswith("[") else [json.loads(ln) for ln in out.splitlines() if ln]
        return {row["Service"]: row for row in rows}

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "60", timeout=120, check=False).stdout[-12000:]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compose-live")
    s = Stack(tmp)

    # The base image, from Debian packages when it is not there.
    if docker("image", "inspect", BASE_IMAGE, check=False).returncode != 0:
        assert BASE_IMAGE == "ferry-base:bookworm", f"base image {BASE_IMAGE} is not there"
        t0 = time.monotonic()
        r = subprocess.run([str(ROOT / "deploy" / "docker" / "base.sh"), BASE_IMAGE], check=False,
                           capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        s.timings["base image (debootstrap + import)"] = time.monotonic() - t0

    # init.sh, as a user runs it, in a folder of the test's own (not the checkout's).
    shutil.copy(COMPOSE_DIR / "init.sh", tmp / "init.sh")
    shutil.copy(COMPOSE_DIR / ".env.example", tmp / ".env.example")
    subprocess.run(["sh", str(tmp / "init.sh")], check=True, capture_output=True, timeout=60)
    assert s.api_key.startswith("sk-ferry-")

    # A second CPU instance, added the way the README adds instances.
    s.override.write_text(f"""
services:
  instance-cpu-2:
    extends:
      file: {COMPOSE_FILE}
      service: instance-cpu
    command: ["serve", "instance", "--instance-id", "instance-cpu-2", "--advertise-host", "instance-cpu-2"]
    depends_on:
      model-init:
        condition: service_completed_successfully
      meta-store:
        condition: service_healthy
""")

    before = resources()
    added = build_extras()
    try:
        t0 = time.monotonic()
        # model-init's image is the one image of the CPU profile: building it
        # alone avoids a build per service (compose builds each one).
        s.compose("build", "model-init", timeout=3600)
        s.timings["image build"] = time.monotonic() - t0
    finally:
        for path in added:
            path.unlink(missing_ok=True)
    try:
        t0 = time.monotonic()
        up = s.compose("up", "-d", timeout=600, check=False)
        assert up.returncode == 0, f"up failed:\n{up.stderr[-3000:]}\n{s.logs()}"
        wait_healthy(s)
        s.timings["up until every service is healthy"] = time.monotonic() - t0
        s.before = before
        yield s
    finally:
        s.compose("down", "-v", "--remove-orphans", "--timeout", "5", timeout=600, check=False)
        # The test's own image goes (a rebuild reuses the build cache's layers);
        # the base image stays: it takes debootstrap to make again.
        docker("image", "rm", IMAGE, check=False)
        for what, seconds in s.timings.items():
            log(f"{what}: {seconds:.1f} s")


LONG_RUNNING = ("meta-store", "scheduler", "frontend", "instance-cpu", "instance-cpu-2")


def wait_healthy(s: Stack) -> None:
    deadline = time.monotonic() + READY_WITHIN_S
    while True:
        services = s.services()
        init = services.get("model-init", {})
        assert not (init.get("State") == "exited" and init.get("ExitCode") != 0), (
            f"model-init failed:\n{s.logs()}")
        health = {name: services.get(name, {}).get("Health") for name in LONG_RUNNING}
        if all(h == "healthy" for h in health.values()):
            break
        assert time.monotonic() < deadline, f"not healthy after {READY_WITHIN_S} s: {health}\n{s.logs()}"
        time.sleep(3)
    # The frontend knows both instances (their reports reach it through the meta store).
    while True:
        m = s.metrics()
        known = {n for n in ("instance-cpu", "instance-cpu-2")
                 if f'ferry_instance_freeness{{instance="{n}"}}' in m}
        if len(known) == 2:
            return
        assert time.monotonic() < deadline, f"the frontend knows only {known}"
        time.sleep(1)


# ------------------------------------------------------------------------------ tests
def test_every_service_is_healthy_and_only_the_frontend_is_published(stack):
    services = stack.services()
    assert services["model-init"]["State"] == "exited" and services["model-init"]["ExitCode"] == 0
    for name in LONG_RUNNING:
        assert services[name]["State"] == "running" and services[name]["Health"] == "healthy", name
        published = [p for p in services[name].get("Publishers") or [] if p.get("PublishedPort")]
        if name == "frontend":
            assert [(p["URL"], p["PublishedPort"]) for p in published] == [("127.0.0.1", stack.port)]
        else:
            assert not published, f"{name} publishes {published}"
    # The gRPC health checks themselves (libs/common/probe.py) pass inside the containers,
    # and fail against a port nothing listens on.
    for name, port in (("meta-store", 7000), ("scheduler", 7001), ("instance-cpu", 7100)):
        ok = stack.compose("exec", "-T", name, "python", "-c",
                           f"from libs.common.probe import main; main('127.0.0.1:{port}')", check=False)
        assert ok.returncode == 0, (name, ok.stderr)
    bad = stack.compose("exec", "-T", "scheduler", "python", "-c",
                        "from libs.common.probe import main; main('127.0.0.1:7999')", check=False)
    assert bad.returncode == 1, bad.stderr


def test_openai_client_gets_an_answer_with_the_generated_key(stack):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0, timeout=300)
    r = client.chat.completions.create(model="smollm2", max_tokens=16, temperature=0,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert r.choices[0].message.content.strip(), r
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0
    models = [m.id for m in client.models.list()]
    assert "smollm2" in models, models
    # init.sh's key is the only way in: none, or a wrong one, is refused.
    for key in ("sk-wrong",):
        bad = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="smollm2", max_tokens=4,
                                        messages=[{"role": "user", "content": "hi"}])
    assert stack.http("/v1/models")[0] == 401


def test_killing_an_instance_loses_no_streaming_request(stack):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0, timeout=600)
    instances = ("instance-cpu", "instance-cpu-2")

    def dispatched() -> dict[str, float]:  # the frontend's count of requests sent to each instance
        m = stack.metrics()
        return {n: m.get(f'ferry_instance_requests_total{{instance="{n}"}}', 0.0) for n in instances}

    resumes_before = stack.metrics().get("ferry_resumes_total", 0.0)
    dispatched_before = dispatched()
    started = threading.Barrier(STREAMS + 1, timeout=READY_WITHIN_S)
    results: list[dict] = [{} for _ in range(STREAMS)]

    def stream(i: int) -> None:
        out = results[i]
        out["text"], out["finish"], out["chunks"], out["tokens"] = "", None, 0, None
        try:
            s = client.chat.completions.create(
                model="smollm2", max_tokens=STREAM_TOKENS, temperature=0.7, stream=True,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": f"Tell story number {i} about a ship."}],
                extra_body={"ignore_eos": True})
            for chunk in s:
                if chunk.usage:
                    out["tokens"] = chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                c = chunk.choices[0]
                out["text"] += c.delta.content or ""
                out["chunks"] += 1
                if out["chunks"] == 1:
                    started.wait()
                if c.finish_reason:
                    out["finish"] = c.finish_reason
        except BaseException as e:  # noqa: BLE001 - recorded, asserted below
            out["error"] = repr(e)
            started.abort()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(STREAMS)]
    for t in threads:
        t.start()
    try:
        started.wait()  # every stream has delivered its first token
    except threading.BrokenBarrierError:
        pass  # a stream failed before its first token: reported below

    # Kill the instance the most of them went to (SIGKILL: no drain, no migration out).
    now = dispatched()
    sent = {n: now[n] - dispatched_before[n] for n in instances}
    victim = max(sent, key=sent.get)
    log(f"streams dispatched per instance {sent}; killing {victim}")
    stack.compose("kill", victim)
    for t in threads:
        t.join(timeout=READY_WITHIN_S)
    assert not any(t.is_alive() for t in threads), "a stream never ended"

    errors = [r for r in results if "error" in r or r["finish"] is None]
    assert not errors, errors
    # Each ran to its max_tokens (ignore_eos), the killed instance's ones too.
    assert all(r["finish"] == "length" and r["tokens"] == STREAM_TOKENS for r in results), results
    assert stack.services()[victim]["State"] == "exited", "the killed instance came back: not a real kill"
    resumed = stack.metrics().get("ferry_resumes_total", 0.0) - resumes_before
    log(f"resumed {resumed:.0f} of {STREAMS} streams")
    assert resumed >= 1, "no request was on the killed instance: the kill tested nothing"


def test_down_removes_everything(stack):
    stack.compose("down", "-v", "--remove-orphans", "--timeout", "5", timeout=600)
    after = resources()
    for kind in ("containers", "networks", "volumes"):
        left = after[kind] - stack.before[kind]
        assert not left, f"{kind} left behind by down -v: {left}"
    labelled = docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={stack.project}").stdout
    assert not labelled.strip()
    with pytest.raises(OSError):
        urllib.request.urlopen(stack.base_url + "/live", timeout=5)
