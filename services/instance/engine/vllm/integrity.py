"""Block bookkeeping check of a vLLM engine (Engine.check_integrity): every
block of vLLM's pool is free, owned by a request vLLM still keeps (live, or
aborted with its blocks held for a migration), or reserved for an incoming
migration; nothing is both, and nothing is lost."""

from __future__ import annotations

from services.instance.engine.base import IntegrityError


def check(engine) -> None:
    pool = engine.pool
    kvm = engine.scheduler.kv_cache_manager
    owned: set[int] = set()
    for rid in engine.scheduler.requests:
        for b in kvm.get_block_ids(rid)[0]:
            owned.add(b)
    reserved: set[int] = set()
    conn = engine.sconn
    if conn is not None:
        reserved = set(conn.reserved)
        for load in conn.pending.values():
            reserved |= {b.block_id for b in load.reserved}
        reserved |= {b.block_id for b in conn._retiring + conn._copied}
        both = owned & reserved
        if both:
            raise IntegrityError(f"blocks {sorted(both)[:8]} are both reserved and owned by a request")
        for rid in conn.held:
            if rid not in engine.scheduler.requests:
                raise IntegrityError(f"held request {rid} is gone from vLLM's scheduler")
    free_ids = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    bad = (owned | reserved) & {b for b in free_ids if pool.blocks[b].ref_cnt == 0}
    if bad:
        raise IntegrityError(f"blocks {sorted(bad)[:8]} are in use and in the free queue")
    used = owned | reserved
    total = engine.num_total_blocks
    if len(used) + len(free_ids) != total:
        raise IntegrityError(f"{len(used)} used + {len(free_ids)} free blocks != {total} "
                             f"(leaked {total - len(used) - len(free_ids)})")
    for rid, r in engine.reqs.items():
        if r.suspended:
            if conn is None or r.iid not in conn.held:
                raise IntegrityError(f"suspended request {rid} holds no blocks")
        elif r.iid not in engine.scheduler.requests:
            raise IntegrityError(f"request {rid} is unknown to vLLM")
