"""The instance agent's configuration: every option of ``ferry serve
instance`` (flags and ``FERRY_*`` variables), and what it derives (the
engine's config, migration's, the queue bound)."""

from __future__ import annotations

import dataclasses

from libs.common.config import CommonConfig, ConfigError, opt
from libs.common.cpus import parse_cpus
from libs.common.types import Role
from services.instance.engine import ENGINES, spec
from services.instance.engine.base import EngineConfig


@dataclasses.dataclass(frozen=True)
class InstanceConfig(CommonConfig):
    port: int = opt(0, "port to listen on (0 = any free port)", min=0, max=65535)
    instance_id: str = opt("", "instance id (default: random)")
    advertise_host: str = opt("", "host other services use to reach this one (default: --host)")
    meta_store: str = opt("127.0.0.1:7000", "meta store address host:port")
    engine: str = opt("fake", "engine", choices=tuple(ENGINES))
    role: str = opt("mixed", "Splitwise role: mixed runs requests from prompt to end; prefill runs prompts and hands "
                    "each request's KV to the decode instance the scheduler chose; decode takes handed-off requests "
                    "(and any the scheduler sends when no prefill instance can)",
                    choices=tuple(r.value for r in Role))
    model: str = opt("smollm2", "model name or Hugging Face directory (native, vllm; vllm also takes hub names)")
    num_blocks: int | None = opt(None, "KV cache blocks (default: from --kv-cache-gb or the engine)", min=1)
    kv_cache_gb: float | None = opt(None, "KV cache memory budget in GiB", min=0.001)
    block_size: int | None = opt(None, "tokens per KV block (default: 16; 32 on CPU for vllm, and for native "
                                 "in bf16 with the vllm extra: vLLM's CPU attention needs a multiple of 32)",
                                 min=1)
    max_num_seqs: int = opt(256, "most requests in a running batch", min=1)
    max_num_batched_tokens: int = opt(2048, "token budget per step (chunked prefill)", min=1)
    prefill_first: bool = opt(False, "vLLM 0.4's scheduling instead of chunked prefill: a step admits waiting "
                                     "requests with their whole prompts and decodes nothing; only a step that admits "
                                     "none decodes (native, fake and sim engines; set --max-num-batched-tokens to "
                                     "the context length, as vLLM 0.4 did)")
    max_model_len: int | None = opt(None, "context length (default: the model's)", min=16)
    device: str = opt("cpu", "torch device (native engine)")
    dtype: str = opt("auto", "weights/KV dtype (native; auto = bf16 where the CPU or GPU has it, else fp32)",
                     choices=("auto", "float32", "bfloat16", "float16"))
    deterministic: bool = opt(False, "a request's tokens and logprobs bit for bit independent of its batch, prefix-cache "
                              "hits, chunking, preemption and recompute (native on CPU: fixed-shape matmuls, checked "
                              "at start, docs/determinism.md; vllm: its batch-invariant mode, GPUs only)")
    torch_threads: int = opt(0, "native: torch intra-op threads (0 = torch's default, one per core); set 1 "
                             "when several instances share a machine's cores", min=0)
    cpus: str = opt("", "pin this instance to these CPU cores, e.g. '0' or '0-3,8' (default: any core); "
                    "`ferry up --pin-cores` gives each instance its own share")
    token_delay_ms: float = opt(10.0, "fake engine: time per step (ms)", min=0.0)
    profile: str = opt("llama-7b-a10", "sim engine: latency profile name or JSON path")
    seed: int = opt(0, "engine seed", min=0)
    headroom_high: int | None = opt(None, "virtual-usage headroom (blocks) for high-priority requests (default: "
                                    "derived from the sim profile: the memory that keeps one decoding at its ideal "
                                    "speed; 0 for engines without a profile)", min=0)
    report_interval_s: float = opt(0.05, "least time between two status reports", min=0.0)
    heartbeat_s: float = opt(0.5, "status report at least this often", min=0.01)
    metrics_port: int = opt(-1, "Prometheus /metrics port (-1 = off, 0 = any)", min=-1)
    migration_max_stages: int = opt(4, "migration: most pre-copy stages before the last one", min=0)
    migration_last_stage_max_blocks: int = opt(2, "migration: go to the last stage at this many uncopied blocks",
                                               min=0)
    migration_chunk_mb: float = opt(4.0, "migration: KV transfer chunk size (MiB)", min=0.01)
    migration_precopy_chunk_mb: float = opt(1.0, "migration: chunk size of the pre-copy stages (MiB)", min=0.01)
    migration_copy_duty: float = opt(0.25, "migration: most fraction of wall time a pre-copy stage spends "
                                     "copying (1 = unpaced)", min=0.01, max=1.0)
    migration_join_hold_ms: float = opt(20.0, "migration: after an incoming migration's last pre-allocation, start "
                                        "no step for up to this long unless its commit comes first, so that the "
                                        "request joins the next step (0 = off)", min=0.0)
    migration_join_notice: bool = opt(True, "migration: before suspending a request, tell the destination when "
                                      "its commit should come, so that it starts no step the request would wait "
                                      "for (it holds its boundary instead, at most half a step)")
    migration_shared_kv: bool = opt(True, "migration: keep the KV cache (fake, native on CPU) in shared memory; "
                                    "a destination on this host that can map it copies the blocks straight from "
                                    "it, so the source sends block ids instead of bytes (else bytes over gRPC)")
    migration_fuse_last_stage: bool = opt(True, "migration: when the destination maps this instance's shared KV "
                                          "cache, send the last stage's block ids with the commit (one round trip "
                                          "after the suspend instead of three)")
    migration_link_cached: bool = opt(True, "migration: the destination links the request's first blocks that "
                                      "its prefix cache holds already (the longest held prefix of their hashes) "
                                      "instead of receiving them; only the rest is sent")
    migration_kv_staging: bool = opt(True, "migration (native on CUDA): copy KV blocks on a side stream through "
                                     "pinned host buffers, beside the engine's steps (else on the engine's stream "
                                     "through pageable memory, queued behind the step in flight)")
    max_migrate_out: int = opt(2, "migration: concurrent migrations out of this instance", min=1)
    max_migrate_out_per_dest: int = opt(2, "migration: concurrent migrations out of this instance to one "
                                        "destination", min=1)
    max_migrate_in: int = opt(2, "migration: concurrent migrations into this instance", min=1)
    max_handoff_in: int = opt(16, "Splitwise: concurrent prefill->decode handoffs into this instance", min=1)
    handoff_per_layer_threshold: int = opt(0, "Splitwise: prompts at least this long are planned as per-layer "
                                           "handoffs: their KV streams layer by layer while the prompt computes "
                                           "(0 = always serialized)", min=0)
    kunserve_exchange_mb: float = opt(16.0, "KunServe (native): KV a live exchange hands the pipeline peers "
                                      "between two steps, MiB (at least one request a step; the others "
                                      "attend here meanwhile)", min=0.0)
    migration_deadline_ms: int = opt(3000, "migration: a reservation not renewed for this long is freed", min=50)
    max_queued_tokens: int | None = opt(None, "refuse new requests (RESOURCE_EXHAUSTED: the frontend tries another "
                                        "instance, else 429) while this many prompt tokens wait for their first "
                                        "step (default: 4 x --max-num-batched-tokens, at least 8192; 0 = no bound)", min=0)
    drain_timeout_s: float = opt(60.0, "on SIGTERM: migrate the requests here to other instances for up to this "
                                 "long before stopping (what is left resumes elsewhere by recompute)", min=0.0)
    hang_factor: float = opt(2.0, "an engine step running past this many times the expected step time (the longest "
                             "recent one) marks the instance unschedulable and NOT_SERVING", min=1.0)
    hang_floor_s: float = opt(0.5, "... and past this long in any case", min=0.001)
    hang_stop_s: float = opt(60.0, "a step hung this long stops the instance (exit 4; its requests resume "
                             "elsewhere; 0 = never)", min=0.0)
    prefix_caching: bool = opt(True, "automatic prefix caching: a request starts at its longest cached prefix "
                               "(whole blocks); free blocks stay cached, evicted least-recently-used (vllm: "
                               "vLLM's own)")
    program_ttl_s: float = opt(0.0, "Continuum's TTL pinning: after a turn of a named program (prompt_cache_key) "
                               "ends, its cached blocks stay pinned (not evictable, not free) this many seconds, "
                               "or until its next turn here takes them (0 = off; the continuum policy's "
                               "default in the simulator)", min=0.0)
    program_keep: float = opt(0.0, "keep by expected return (issue 53): after a turn of a named program ends, its "
                              "cached blocks stay evictable but are evicted after plain cached blocks, the program "
                              "whose return is furthest and whose blocks are cheapest to recompute first, for 3 "
                              "of its expected gaps (learned from its gaps here); at most this fraction of the KV "
                              "pool is kept (0 = off; the llumnix-keep policy's default in the simulator)",
                              min=0.0, max=1.0)
    program_gap_s: float = opt(15.0, "keep: a program's expected gap between turns until one is seen here",
                               min=0.001)
    failpoints: str = opt("", "fault injection for tests, e.g. dest.drop_commit_reply (testing only)")
    vllm_args: str = opt("", "vllm engine: vLLM engine arguments as on vLLM's command line, e.g. "
                         "'--enforce-eager --gpu-memory-utilization 0.85' (also: after `--` on the command line)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cpus:
            try:
                parse_cpus(self.cpus)
            except ValueError as e:
                raise ConfigError(str(e)) from None

    def migration_config(self):
        from services.instance.migration import MigrationConfig

        return MigrationConfig(
            max_stages=self.migration_max_stages, last_stage_max_blocks=self.migration_last_stage_max_blocks,
            chunk_bytes=int(self.migration_chunk_mb * (1 << 20)), max_migrate_out=self.max_migrate_out,
            max_migrate_in=self.max_migrate_in, deadline_ms=self.migration_deadline_ms,
            max_migrate_out_per_dest=self.max_migrate_out_per_dest, copy_duty=self.migration_copy_duty,
            precopy_chunk_bytes=int(self.migration_precopy_chunk_mb * (1 << 20)), max_handoff_in=self.max_handoff_in,
            handoff_per_layer_threshold=self.handoff_per_layer_threshold, join_hold_ms=self.migration_join_hold_ms,
            join_notice=self.migration_join_notice, shared_kv=self.migration_shared_kv,
            fuse_last_stage=self.migration_fuse_last_stage, link_cached=self.migration_link_cached)

    def queued_tokens_bound(self) -> int:
        if self.max_queued_tokens is not None:
            return self.max_queued_tokens
        return max(4 * self.max_num_batched_tokens, 8192)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            engine=self.engine, model=self.model, num_blocks=self.num_blocks, kv_cache_gb=self.kv_cache_gb,
            block_size=self.block_size or default_block_size(self.engine, self.device, self.dtype),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            device=self.device, dtype=self.dtype, token_delay_ms=self.token_delay_ms, profile=self.profile,
            seed=self.seed, share_kv=self.migration_shared_kv, prefix_caching=self.prefix_caching,
            program_ttl_s=self.program_ttl_s, program_keep=self.program_keep,
            program_gap_s=self.program_gap_s, deterministic=self.deterministic, prefill_first=self.prefill_first,
            extra=self._engine_extra(),
        )

    def _engine_extra(self) -> dict:
        extra: dict = {"num_threads": self.torch_threads} if self.torch_threads else {}
        if spec(self.engine).torch_threads:  # KunServe's exchange and KV staging: the torch engine's
            extra["kunserve_exchange_mb"] = self.kunserve_exchange_mb
            extra["kv_staging"] = self.migration_kv_staging
        if self.vllm_args:
            extra["vllm_args"] = self.vllm_args
        return extra


def default_block_size(engine: str, device: str = "cpu", dtype: str = "auto") -> int:
    return spec(engine).default_block_size(device, dtype)
