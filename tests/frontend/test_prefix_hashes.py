"""The frontend sends the prompt's block hashes with Dispatch
(services/frontend/router.py): at the cluster's block size (the one most
instances report), equal to the engine's own hashes of the same tokens;
a resumed request's hashes cover its delivered tokens too; none once the
scheduler's replies name a prefix-blind policy."""

from __future__ import annotations

import grpc
import pytest

from libs.pb import scheduler_pb2 as spb
from libs.pb import scheduler_pb2_grpc as spb_grpc
from libs.common.types import InstanceInfo, InstanceRecord, Priority, SamplingParams
from services.frontend.router import Router
from services.instance.engine.core.request import Request


class Recording(spb_grpc.SchedulerServicer):
    def __init__(self):
        self.requests: list[spb.DispatchRequest] = []
        self.policy = "llumnix-prefix"

    async def Dispatch(self, request, context):
        self.requests.append(request)
        return spb.DispatchReply(instance_id="i0", address="127.0.0.1:1", policy=self.policy)


@pytest.fixture
async def recorded():
    sched = Recording()
    server = grpc.aio.server()
    spb_grpc.add_SchedulerServicer_to_server(sched, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    router = Router(f"127.0.0.1:{port}", "127.0.0.1:1", dispatch_stream=False)
    for i, bs in enumerate((16, 16, 32)):
        iid = f"i{i}"
        router.view.records[iid] = InstanceRecord(InstanceInfo(iid, f"127.0.0.1:{2 + i}", "fake", "m", bs, 100, 4096))
    yield router, sched
    await router.close()
    await server.stop(None)


async def test_the_hashes_are_the_engines_for_the_same_tokens(recorded):
    router, sched = recorded
    tokens = [(7 * i) % 5000 for i in range(100)]  # 6 full blocks of 16 and 4 tokens
    await router.dispatch("r1", len(tokens), Priority.NORMAL, token_ids=tokens)
    sent = sched.requests[-1]
    engine = Request("r1", tokens, SamplingParams(max_tokens=4))
    assert sent.block_size == 16  # two instances of 16, one of 32
    assert list(sent.block_hashes) == engine.full_block_hashes(16) and len(sent.block_hashes) == 6

    # resumed after 30 delivered tokens: the instance gets prompt + delivered
    await router.dispatch("r1", 130, Priority.NORMAL, frozenset({"i0"}), token_ids=tokens + [11] * 30)
    resumed = Request("r1", tokens, SamplingParams(max_tokens=40), output_token_ids=[11] * 30)
    assert list(sched.requests[-1].block_hashes) == resumed.full_block_hashes(16)


async def test_no_tokens_no_hashes(recorded):
    router, sched = recorded
    await router.dispatch("r2", 100, Priority.NORMAL)
    assert not sched.requests[-1].block_hashes and sched.requests[-1].block_size == 0


async def test_no_hashes_for_a_prefix_blind_scheduler(recorded):
    router, sched = recorded
    tokens = list(range(100, 164))
    sched.policy = "llumnix"
    await router.dispatch("a", 64, Priority.NORMAL, token_ids=tokens)  # sent before the policy was known
    await router.dispatch("b", 64, Priority.NORMAL, token_ids=tokens)
    assert len(sched.requests[0].block_hashes) == 4 and not sched.requests[1].block_hashes
    sched.policy = "some-newer-policy"  # unknown here: hashes again
    await router.dispatch("c", 64, Priority.NORMAL, token_ids=tokens)
    await router.dispatch("d", 64, Priority.NORMAL, token_ids=tokens)
    assert len(sched.requests[3].block_hashes) == 4
