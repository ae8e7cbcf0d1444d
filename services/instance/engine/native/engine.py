"""The native engine: the shared core with the PyTorch model runner.

dtype: on this project's 2-core AVX512-BF16 CPU, bf16 GEMMs measured ~2.7x
faster than fp32 (SmolLM2 shapes, batch 32) and `ferry bench engine` gave
267 tok/s (bf16) vs 122 tok/s (fp32) at batch 32, so ``dtype="auto"`` picks
bfloat16 on CPUs with AVX512-BF16/AMX and on CUDA, else float32.
EngineConfig's own default stays "float32" (exact match with transformers);
the bench and the instance agent ask for what they want.
"""

from __future__ import annotations

import contextlib
import pathlib
import time

import torch

from services.instance.engine.base import EngineConfig, EngineError
from services.instance.engine.core.engine import CoreEngine
from services.instance.engine.native.config import SHAPES, ModelConfig
from services.instance.engine.native.loader import DTYPES, load_model, random_model
from services.instance.engine.native.runner import ModelRunner

DEFAULT_CPU_KV_GB = 1.0
# Most time an engine holds its steps between dropping layers and joining the
# pipeline that runs them (after that it steps, and fails, breaking the engine).
HOLD_S = 30.0


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        caps = torch.backends.cpu.get_cpu_capability()
        return torch.bfloat16 if caps in ("AVX512", "AMX") and _cpu_has_bf16() else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise EngineError(f"unknown dtype {name!r}; supported: auto, {', '.join(DTYPES)}") from None


def _cpu_has_bf16() -> bool:
    try:
        flags = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_model(name: str) -> tuple[ModelConfig, pathlib.Path | None]:
    """(config, weights dir or None for random weights)."""
    if name in SHAPES:
        return ModelConfig.from_shape(name), None
    from libs.common.models import ModelNotFound, ensure_model

    try:
        path = ensure_model(name)
    except ModelNotFound as e:
        raise EngineError(f"{e}; random-weight shapes: {', '.join(sorted(SHAPES))}") from None
    return ModelConfig.from_dir(path), path


_SHARED: dict[tuple, object] = {}


def _build_model(mcfg: ModelConfig, path, device, dtype, seed: int, share: bool):
    """Weights are read-only after loading, so engines in one process (tests,
    the bench) may share them: extra={"share_weights": True}."""
    key = (str(path) if path else repr(mcfg), str(device), dtype, seed)
    if share and key in _SHARED:
        return _SHARED[key]
    model = random_model(mcfg, device, dtype, seed=seed) if path is None else load_model(path, mcfg, device, dtype)
    model.pack_weights()
    if share:
        _SHARED[key] = model
    return model


class NativeEngine(CoreEngine):
    name = "native"

    def __init__(self, config: EngineConfig):
        t0 = time.perf_counter()
        device = torch.device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        if config.extra.get("num_threads"):
            torch.set_num_threads(int(config.extra["num_threads"]))
        mcfg, path = resolve_model(config.model)
        self.model_config = mcfg
        self.model_dir = path
        model = _build_model(mcfg, path, device, dtype, config.seed, bool(config.extra.get("share_weights")))
        layout_bytes = (mcfg.num_hidden_layers * 2 * config.block_size * mcfg.num_key_value_heads
                        * mcfg.head_dim * torch.tensor([], dtype=dtype).element_size())
        num_blocks = config.num_blocks or max(1, int(self._kv_bytes(config, device) // layout_bytes))
        eos = frozenset(mcfg.eos_token_ids)
        dc_gb = config.extra.get("decode_cache_gb")
        runner = ModelRunner(model, num_blocks, config.block_size, device, dtype, eos, seed=config.seed,
                             decode_cache_bytes=None if dc_gb is None else int(float(dc_gb) * 2**30))
        max_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        name = path.name if path is not None else config.model
        super().__init__(config, runner, num_blocks, max_len, model_name=name)
        self.dtype = dtype
        self._lent_blocks = 0  # blocks of dropped layers' memory in the pool (drop_layers)
        self._dropped_bytes: dict[int, int] = {}  # layer -> the parameter bytes it held
        self._held_until = 0.0  # no step before this (monotonic), between a drop and its pipeline
        if config.extra.get("warmup", True):
            self.warmup()
        self.ready_s = time.perf_counter() - t0

    # --- KunServe: layers dropped into KV memory, pipelined with peers (pipeline.py) -----
    def drop_layers(self, layers: range, hold: bool = False) -> int:
        """Drop these layers' parameters and lend their memory to the KV cache:
        the pool grows by the whole blocks it holds. Returns the blocks added.
        Run them on a peer (``set_pipeline``) before the next step needs them.
        ``hold``: take no step until the pipeline is set (at most ``HOLD_S``):
        a group's members all drop first, so that each has the room for the
        KV its peers then hand over (``enter_pipeline``)."""
        if self.config.extra.get("share_weights"):
            raise EngineError("this engine shares its weights with others in the process: it cannot drop layers")
        self._dropped_bytes.update(self.executor.model.drop_layers(layers))
        if hold:
            self._held_until = time.monotonic() + HOLD_S
        n = sum(self._dropped_bytes.values()) // self.kv_layout.bytes_per_block - self._lent_blocks
        if n > 0:
            self.grow_blocks(n)
            self._lent_blocks += n
        return max(0, n)

    def restore_layers(self, states: dict) -> int:
        """Take layers back from their parameters (``{layer: state_dict}``,
        ``LlamaModel.layer_states`` of a host copy or a peer) and start giving
        back the blocks their memory lent: free ones at once, used ones as they
        are freed (BlockPool.shrink). Returns the blocks asked back."""
        bad = [i for i in states if not 0 <= i < self.kv_layout.num_layers]
        if bad:
            raise EngineError(f"layers {bad} of a {self.kv_layout.num_layers}-layer model")
        self.executor.model.restore_layers(states)
        for i in states:
            self._dropped_bytes.pop(i, None)
        back = self._lent_blocks - sum(self._dropped_bytes.values()) // self.kv_layout.bytes_per_block
        if back > 0:
            self.pool.shrink(back)
            self._lent_blocks -= back
        return max(0, back)

    def layer_states(self, layers: range) -> dict:
        try:
            return self.executor.model.layer_states(layers)
        except ValueError as e:
            raise EngineError(str(e)) from None

    def enter_pipeline(self, own: range, peers: list) -> int:
        """Between steps: run layers ``own`` here and each peer's there from
        the next step, first handing each peer the KV of its layers for every
        request that has some, so that requests running here go on (the KV
        exchange; here a pause between two steps, not the paper's remote
        attention). Returns the requests whose KV moved.

        If a hand-over fails, what was handed over is released on the peers,
        no request counts as remote, and the engine holds its steps (a request
        must not run layers whose KV is not there): the caller takes the layers
        back (``restore_layers``, ``leave_pipeline``) or tries again."""
        self.set_pipeline(own, peers)
        ex = self.executor
        moved: list[str] = []
        try:
            for rid, r in sorted(self.requests.items()):
                if not r.num_computed_tokens:
                    continue
                blocks = self._computed_blocks(r)
                moved.append(rid)
                for layers, peer in ex.peer_segments():
                    peer.push_kv(layers, rid, r.num_computed_tokens, ex.gather_kv_layers(blocks, layers))
        except Exception:
            for _, peer in ex.peer_segments():
                with contextlib.suppress(Exception):  # the peer may be the failure: its guests die with it
                    peer.release(moved)
            self._held_until = time.monotonic() + HOLD_S
            raise
        for rid in moved:
            ex.mark_remote(rid)
        self._held_until = 0.0
        return len(moved)

    def leave_pipeline(self) -> int:
        """Between steps: bring back from the peers the KV of every layer they
        ran for this engine's requests (into the requests' own blocks, which
        have room for every layer), release the guests there, and run every
        layer here from the next step. The layers must be back first
        (``restore_layers``). Returns the requests whose KV came back."""
        ex = self.executor
        if ex.model.dropped():
            raise EngineError(f"layers {ex.model.dropped()} are still dropped: restore them first")
        moved = 0
        for rid in sorted(ex.remote_requests):
            r = self.requests.get(rid)
            if r is None or not r.num_computed_tokens:
                continue
            blocks = self._computed_blocks(r)
            layer_bytes = len(blocks) * self.kv_layout.bytes_per_block // self.kv_layout.num_layers
            for layers, peer in ex.peer_segments():
                ex.scatter_kv_layers(blocks, layers, peer.fetch_kv(layers, rid, r.num_computed_tokens, layer_bytes))
            moved += 1
        if moved:
            ex.forget_dense_slots()
        ex.release_requests(sorted(ex.remote_requests))
        ex.set_pipeline(range(self.kv_layout.num_layers), [])
        self._held_until = 0.0
        return moved

    def has_work(self) -> bool:
        if self._held_until and time.monotonic() < self._held_until:
            return False  # held between a drop and the pipeline (drop_layers)
        return super().has_work()

    def set_pipeline(self, own: range, peers: list) -> None:
        """Layers ``own`` run here, each (range, LayerPeer) there; see pipeline.py."""
        try:
            self.executor.set_pipeline(own, peers)
        except ValueError as e:
            raise EngineError(str(e)) from None

    @staticmethod
    def _kv_bytes(config: EngineConfig, device: torch.device) -> float:
        if config.kv_cache_gb is not None:
            return config.kv_cache_gb * 2**30
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return 0.8 * free
        return DEFAULT_CPU_KV_GB * 2**30

    def warmup(self) -> None:
        """One prefill and a few decodes so first requests do not pay for
        lazy initialisation (oneDNN kernels, allocator)."""
        from libs.common.types import SamplingParams
        from services.instance.engine.base import EngineRequest

        n = min(64, self.max_model_len - 8)
        self.add_request(EngineRequest("__warmup__", tuple(range(1, n + 1)),
                                       SamplingParams(max_tokens=4, ignore_eos=True)))
        while self.has_work():
            self.step()
        self.scheduler.num_preemptions = 0
