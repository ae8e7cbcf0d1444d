"""Dispatch with prefixes in the scheduler (services/scheduler/service.py):
the prompt's block hashes in DispatchRequest become, per instance, its
longest held prefix from the prefix index, passed to a prefix-aware policy;
pending dispatches count the demand net of the hit; instances of another
block size, and prefix-blind policies, get no hits."""

from libs.pb import scheduler_pb2 as spb
from libs.common.kv_events import KvSnapshot
from libs.common.kv_index import KvIndexWatcher
from libs.common.prefix_hash import block_hashes
from libs.common.prefix_index import PrefixIndex
from libs.common.types import InstanceInfo, InstanceRecord, InstanceStatus
from services.scheduler.service import SchedulerConfig, SchedulerService, SchedulerServicer

TOKENS = list(range(100, 164))  # 4 blocks of 16


def record(iid: str, block_size: int = 16) -> InstanceRecord:
    info = InstanceInfo(iid, f"{iid}.test:1", "fake", "m", block_size, 1000, 4096)
    st = InstanceStatus(iid, total_blocks=1000, free_blocks=1000, block_size=block_size, freeness=1000.0)
    return InstanceRecord(info, st)


def scheduler(policy: str, holders: dict[str, int], sizes: dict[str, int] | None = None) -> SchedulerService:
    """Instances a, b, c (equally idle: a wins a tie); ``holders``: how many
    of TOKENS's first blocks each holds (in the index)."""
    svc = SchedulerService(SchedulerConfig(dispatch=policy))
    sizes = sizes or {}
    for iid in ("inst-a", "inst-b", "inst-c"):
        svc.view.records[iid] = record(iid, sizes.get(iid, 16))
        svc.view.touch(iid)  # (the dispatch index of llumnix follows the view by its listeners)
    svc.view.synced.set()
    index = PrefixIndex()
    hashes = block_hashes(TOKENS, 16)
    for iid, n in holders.items():
        index.reset(KvSnapshot(iid, 0, {h: (hashes[i - 1] if i else None) for i, h in enumerate(hashes[:n])}))
    svc.kv_index = KvIndexWatcher(svc.view, index)  # not started: the index as given
    return svc


def dispatch(svc: SchedulerService, tokens=TOKENS, block_size: int = 16) -> spb.DispatchReply:
    req = spb.DispatchRequest(request_id="r1", num_prompt_tokens=len(tokens),
                              block_hashes=block_hashes(tokens, block_size), block_size=block_size)
    return SchedulerServicer(svc)._dispatch(req)


def test_hits_from_the_index_reach_the_policy():
    svc = scheduler("llumnix-prefix", {"inst-b": 2, "inst-c": 3})
    assert svc.prefix_hits(block_hashes(TOKENS, 16), 16) == {"inst-b": 2, "inst-c": 3}
    reply = dispatch(svc)
    assert reply.instance_id == "inst-c" and reply.policy == "llumnix-prefix"
    # pending there: 4 blocks less the 3 held
    assert svc.view.view_of("inst-c").pending_blocks == 1


def test_every_prefix_policy_follows_the_longest_prefix_on_an_idle_cluster():
    for policy in ("llmd-prefix", "dynamo-kv", "sglang-cache-aware"):
        assert dispatch(scheduler(policy, {"inst-b": 3})).instance_id == "inst-b", policy


def test_no_hits_for_another_block_size_nor_for_prefix_blind_policies():
    svc = scheduler("llumnix-prefix", {"inst-b": 3}, sizes={"inst-b": 32})
    assert svc.prefix_hits(block_hashes(TOKENS, 16), 16) == {}
    # (inst-b's larger blocks make the prompt 2 blocks there: the freest after it, with or without prefixes)
    assert dispatch(svc).instance_id == dispatch(scheduler("llumnix", {}, sizes={"inst-b": 32})).instance_id
    assert dispatch(scheduler("llumnix", {"inst-b": 3})).instance_id == "inst-a"
    # no hashes sent: nothing is looked up
    svc = scheduler("llumnix-prefix", {"inst-b": 3})
    assert SchedulerServicer(svc)._dispatch(spb.DispatchRequest(request_id="r", num_prompt_tokens=64)) \
        .instance_id == "inst-a"


def test_without_a_prefix_index_there_are_no_hits():
    svc = SchedulerService(SchedulerConfig(dispatch="llumnix-prefix", prefix_index=False))
    assert svc.kv_index is None and svc.prefix_hits([1, 2], 16) == {}
