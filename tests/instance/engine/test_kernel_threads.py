"""Native engines of one process stepping at once (an in-process cluster: the
KunServe and migration tests, ``ferry/inprocess.py``): vLLM's CPU ops crashed
the process then (a segfault in onednn_mm within seconds, 4 SmolLM2 engines in
fp32), until every call into them took one lock (vllm_kernels.LOCK). The
engines run in a child process, so that a crash fails this test instead of
ending the suite; each engine's tokens must equal those of a run alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.instance.engine import vllm_kernels

pytestmark = pytest.mark.model

CHILD = r"""
import json, threading
from services.instance.engine import create_engine
from services.instance.engine.base import EngineConfig
from tests.instance.engine.helpers import req, run

def engine():
    return create_engine(EngineConfig(engine="native", model="smollm2", num_blocks=64, dtype="float32",
                                      extra={"warmup": False, "num_threads": 1}))

def requests(k):
    return [req(f"r{k}-{j}", list(range(2000 + 50 * k + j, 2036 + 50 * k + j)), max_tokens=20, min_tokens=20,
                temperature=0.8, seed=k * 10 + j) for j in range(2)]

out, engines = {}, [engine() for _ in range(4)]
def go(e, k):
    for r in requests(k):
        e.add_request(r)
        out.update(run(e))
threads = [threading.Thread(target=go, args=(e, k)) for k, e in enumerate(engines)]
for t in threads:
    t.start()
for t in threads:
    t.join()
alone = engines[0]
want = {}
for k in range(4):
    for r in requests(k):
        alone.add_request(r)
        want.update(run(alone))
print(json.dumps({"out": out, "want": want, "path": alone.compute_path()}))
"""


def test_four_native_engines_stepping_at_once_in_one_process_give_the_tokens_of_each_alone():
    if vllm_kernels.ops() is None:
        pytest.skip("vLLM's CPU kernels do not run here: the native engine runs its torch path")
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", CHILD], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert "vLLM kernels" in got["path"]
    assert len(got["want"]) == 8 and all(len(t) == 20 for t in got["want"].values())
    assert got["out"] == got["want"]
