"""Ferry's engine config and requests in vLLM's terms: the EngineArgs an
instance starts vLLM with, and the SamplingParams of one incarnation of a
request (a request re-added after a suspend or a migration is a new vLLM
request whose prompt is everything it has so far)."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import uuid

from libs.common import tracing
from libs.common.types import Priority, SamplingParams
from services.instance.engine.base import EngineConfig, EngineError

CONNECTOR_CLASS = "FerryMigrationConnector"
CONNECTOR_MODULE = "services.instance.engine.vllm.connector"
DEFAULT_CPU_KV_GB = 1.0  # as the native engine on CPU


def resolve_model(name: str) -> str:
    """A Ferry model name (e.g. smollm2) becomes its converted HF directory;
    anything else (a local directory, a hub name) goes to vLLM as given."""
    from libs.common.models import KNOWN_MODELS, ensure_model

    if name in KNOWN_MODELS:
        return str(ensure_model(name))
    return name


def engine_argv(config: EngineConfig, model: str) -> list[str]:
    """Ferry's engine flags as vLLM command-line flags (what an instance
    starts vLLM with, before the user's own; the benchmark gives the same to
    vLLM's OpenAI server)."""
    if config.prefill_first:
        raise EngineError("--prefill-first is the scheduling of Ferry's own engines (native, fake, sim); vLLM's "
                          "scheduler is vLLM's: give it its own flags (--vllm-args)")
    argv = ["--model", model, "--max-num-seqs", str(config.max_num_seqs),
            "--max-num-batched-tokens", str(config.max_num_batched_tokens), "--seed", str(config.seed)]
    if config.block_size:
        argv += ["--block-size", str(config.block_size)]
    if config.dtype != "auto":
        argv += ["--dtype", config.dtype]
    if config.max_model_len:
        argv += ["--max-model-len", str(config.max_model_len)]
    if config.num_blocks:
        # +1: vLLM keeps block 0 as its null block, never handed out.
        argv += ["--num-gpu-blocks-override", str(config.num_blocks + 1)]
    on_cpu = config.device == "cpu" or _cpu_platform()
    kv_gb = config.kv_cache_gb or (DEFAULT_CPU_KV_GB if on_cpu else None)
    if kv_gb:
        argv += ["--kv-cache-memory-bytes", str(int(kv_gb * (1 << 30)))]
    return argv


def engine_args(config: EngineConfig, model: str, extra_args: str = "") -> tuple[object, bool]:
    """(vllm EngineArgs, migration wired). Ferry's flags become vLLM's
    defaults; ``extra_args`` (vLLM's own CLI flags) override them. Ferry's
    KV connector is added unless the user brought a kv-transfer-config of
    their own, which leaves the instance without live migration."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = engine_argv(config, model)
    user = shlex.split(extra_args)
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="ferry serve instance --engine vllm"))
    try:
        ns = parser.parse_args(argv + user)
    except SystemExit as e:
        raise EngineError(f"bad vLLM engine arguments {extra_args!r}") from e
    args = EngineArgs.from_cli_args(ns)
    # Ferry's priorities go to vLLM's priority scheduler; steps must be
    # synchronous so that a request's counters are final between two steps.
    if "--scheduling-policy" not in user:
        args.scheduling_policy = "priority"
    # Prefix caching is vLLM's own (--no-prefix-caching turns it off, as a
    # user's --no-enable-prefix-caching does); its KV events feed Ferry's
    # prefix index (kv_events.py takes them in process).
    if not config.prefix_caching:
        args.enable_prefix_caching = False
    elif args.enable_prefix_caching is not False and args.kv_events_config is None:
        from vllm.config import KVEventsConfig

        args.enable_prefix_caching = True
        args.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    args.async_scheduling = False
    # Tracing (libs/common/tracing.py): vLLM's own spans (``llm_request``, under the trace headers
    # each request brings) go to this process's OTLP endpoint, unless the user chose one. They are
    # built from vLLM's request stats, which are otherwise off (stat_loggers below).
    if args.otlp_traces_endpoint is None and tracing.endpoint():
        args.otlp_traces_endpoint = tracing.endpoint()
    args.disable_log_stats = not args.otlp_traces_endpoint
    migratable = args.kv_transfer_config is None
    if migratable:
        args.kv_transfer_config = KVTransferConfig(
            kv_connector=CONNECTOR_CLASS, kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_both",
            engine_id=f"ferry-{uuid.uuid4().hex[:12]}")
        args.disable_hybrid_kv_cache_manager = True  # the connector moves one KV cache group
    return args, migratable


def stat_loggers(args) -> list | None:
    """What LLMEngine.from_engine_args takes as ``stat_loggers``: with vLLM's
    request stats on (its tracing needs them), its Prometheus logger is
    replaced by one that records nothing, since this instance exports the
    ``vllm:`` names itself (serving_metrics.py) and two collectors of one
    name cannot share the registry; vLLM's log lines of throughput stay."""
    if args.disable_log_stats:
        return None
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class Unexported(PrometheusStatLogger):
        def __init__(self, vllm_config, engine_indexes=None):  # registers no metric
            pass

        def record(self, *args, **kwargs) -> None:
            pass

        def record_sleep_state(self, *args, **kwargs) -> None:
            pass

        def record_admission_rejection(self, *args, **kwargs) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

    return [Unexported]


def unsampled_trace_headers() -> dict[str, str]:
    """A parent that is not sampled: vLLM records no span under it (its
    sampler follows the parent), instead of a root span of a trace of its
    own for a request Ferry does not trace."""
    return {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00"}


def default_block_size(device: str = "cpu", dtype: str = "auto") -> int:
    """16 (vLLM's own default) except on CPU, whose attention kernel takes
    multiples of 32 only (CPU_ATTN get_supported_kernel_block_sizes). vLLM's
    platform decides, whatever ``device`` and ``dtype`` (the registry's
    signature)."""
    return 32 if _cpu_platform() else 16


def batch_invariant() -> None:
    """The deterministic mode on vLLM: its own batch-invariant mode
    (``VLLM_BATCH_INVARIANT=1``, read when its engine starts), which vLLM has
    on NVIDIA and AMD GPUs only; its CPU build has none, so there the mode is
    refused rather than claimed."""
    if _cpu_platform():
        raise EngineError("--deterministic: vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT) runs on NVIDIA and "
                          "AMD GPUs only, not in its CPU build; on CPU use the native engine's deterministic mode")
    os.environ["VLLM_BATCH_INVARIANT"] = "1"


def _cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def sampling_params(sp: SamplingParams, num_output: int, load_key: str | None = None):
    """vLLM SamplingParams for the rest of a request that already has
    ``num_output`` tokens: budgets shrink by what was produced. A seeded
    request gets a seed derived from (seed, num_output) on re-adding: vLLM
    keeps its generator inside the model runner, out of any API's reach, so
    the stream cannot go on where it was; a derived seed keeps the rest
    reproducible instead of replaying the first tokens' randomness. The
    prompt's logprobs are asked of the first incarnation only; a prompt-only
    request (max_tokens 0) runs one token, which the engine drops."""
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
    from vllm.sampling_params import SamplingParams as VSamplingParams

    seed = sp.seed
    if seed is not None and num_output:
        seed = (seed * 1_000_003 + num_output) % (2**63)
    extra = {"kv_transfer_params": {"ferry_load": load_key}} if load_key else None
    structured = None
    if sp.grammar is not None:
        g = sp.grammar
        kind = {"json": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
                "grammar": "grammar"}[g.kind.value]
        value = {"json": g.spec, "json_object": True, "regex": g.spec, "choice": json.loads(g.spec) if g.spec else [],
                 "grammar": g.spec}[kind]
        structured = StructuredOutputsParams(**{kind: value}, disable_any_whitespace=g.compact,
                                             disable_additional_properties=g.strict and kind == "json")
    v = VSamplingParams(
        n=1, temperature=sp.temperature, top_p=sp.top_p, top_k=max(0, sp.top_k), seed=seed,
        max_tokens=max(1, sp.max_tokens - num_output), min_tokens=max(0, sp.min_tokens - num_output),
        stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos, detokenize=False,
        output_kind=RequestOutputKind.DELTA, extra_args=extra, logprobs=sp.logprobs,
        prompt_logprobs=sp.prompt_logprobs if not num_output else None,
        presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty, min_p=sp.min_p,
        logit_bias=dict(sp.logit_bias) or None, allowed_token_ids=list(sp.allowed_token_ids) or None,
        structured_outputs=structured)
    if sp.bad_words:  # as token sequences (vLLM's own field takes words it tokenizes)
        v._bad_words_token_ids = [list(w) for w in sp.bad_words]
    return v


def keeps_state_across_incarnations(sp: SamplingParams) -> bool:
    """Whether a request re-added to vLLM with its output as prompt goes on
    exactly (vLLM counts presence and frequency penalties, bad words and a
    grammar over its own output only, which a new incarnation does not have):
    such requests are not migrated on this engine."""
    return not (sp.presence_penalty or sp.frequency_penalty or sp.bad_words or sp.grammar is not None)


def logprobs_of(token: int, entry: dict, k: int):
    """vLLM's {token: Logprob} of one position as Ferry's Logprobs (top ``k`` by rank)."""
    from libs.common.types import Logprobs

    top = sorted(((t, x) for t, x in entry.items() if x.rank is not None and x.rank <= k), key=lambda p: p[1].rank)
    return Logprobs(float(entry[token].logprob), tuple((int(t), float(x.logprob)) for t, x in top))


def vllm_priority(p: Priority) -> int:
    """vLLM serves lower values first; Ferry's higher priorities first."""
    return -int(p)


def offline_if_local(model: str) -> None:
    """A model on local disk needs no model hub: say so before vLLM's first
    lookup, so that a host without hub access does not wait on one."""
    if os.path.isdir(model):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")


def in_process() -> None:
    """vLLM's engine core in this process and thread (the agent's engine
    thread): the connector objects are then reachable, and a step is a call."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
