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

from libs.common import cpu_features
from libs.common.logging import get_logger
from services.instance.engine.base import EngineConfig, EngineError
from services.instance.engine.core.engine import CoreEngine
from services.instance.engine.native import cpu_kernels
from services.instance.engine import vllm_kernels
from services.instance.engine.native.config import SHAPES, ModelConfig
from services.instance.engine.native.loader import DTYPES, load_model, random_model
from services.instance.engine.native.runner import ModelRunner

log = get_logger(__name__)

DEFAULT_CPU_KV_GB = 1.0
# Most time an engine holds its steps between dropping layers and joining the
# pipeline that runs them (after that it steps, and fails, breaking the engine).
HOLD_S = 30.0


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on CUDA and on CPUs with bf16 arithmetic (AVX-512 BF16 or
    AMX) where torch dispatches AVX-512 kernels; else fp32 (on AVX2, oneDNN
    has no bf16 matmul and torch's bf16 projections were 2.5x slower than
    fp32's: linear.py)."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        caps = torch.backends.cpu.get_cpu_capability()
        return torch.bfloat16 if caps in ("AVX512", "AMX") and cpu_features.has_bf16() else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise EngineError(f"unknown dtype {name!r}; supported: auto, {', '.join(DTYPES)}") from None


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


def default_block_size(device: str, dtype: str) -> int:
    """32 where vLLM's CPU attention kernel will run (bf16 or fp32 on CPU,
    the ``vllm`` extra installed and runnable here): it attends over the
    paged cache in place only with blocks of a multiple of 32 positions
    (cpu_kernels.py); else 16."""
    dev = torch.device(device)
    try:
        kernel = dev.type == "cpu" and resolve_dtype(dtype, dev) in cpu_kernels.DTYPES
    except EngineError:
        return 16  # the engine says why when it starts
    return 32 if kernel and vllm_kernels.ops() is not None else 16


def _build_model(mcfg: ModelConfig, path, device, dtype, seed: int, share: bool, vllm_kernels: bool = True,
                 deterministic_len: int = 0):
    """Weights are read-only after loading, so engines in one process (tests,
    the bench) may share them: extra={"share_weights": True}. ``vllm_kernels``:
    projections packed for vLLM's matmul handler where installed (linear.py).
    ``deterministic_len``: the deterministic mode's model for up to that many
    positions (batch_invariant.py)."""
    key = (str(path) if path else repr(mcfg), str(device), dtype, seed, vllm_kernels, deterministic_len)
    if share and key in _SHARED:
        return _SHARED[key]
    model = random_model(mcfg, device, dtype, seed=seed) if path is None else load_model(path, mcfg, device, dtype)
    if deterministic_len:
        model.make_deterministic(deterministic_len, vllm=vllm_kernels)
    else:
        model.pack_weights(vllm=vllm_kernels)
    if share:
        _SHARED[key] = model
    return model


def check_deterministic_config(config: EngineConfig, device: torch.device) -> None:
    """What the deterministic mode needs before a model is built for it (batch_invariant.py)."""
    if device.type != "cpu":
        raise EngineError("the native engine's deterministic mode runs on CPU only; on CUDA it is not built yet "
                          "(use --engine vllm, whose batch-invariant mode runs on CUDA)")
    if config.block_size % cpu_kernels.BLOCK_ALIGN:
        raise EngineError(f"the deterministic mode needs blocks of a multiple of {cpu_kernels.BLOCK_ALIGN} positions "
                          f"(vLLM's CPU attention over the paged cache), not {config.block_size}")
    if config.extra.get("vllm_kernels", True) is False:
        raise EngineError("the deterministic mode needs vLLM's CPU kernels (attention); not with vllm_kernels off")


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
        vllm_kernels = bool(config.extra.get("vllm_kernels", True))
        max_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        if config.deterministic:
            check_deterministic_config(config, device)
        try:
            model = _build_model(mcfg, path, device, dtype, config.seed, bool(config.extra.get("share_weights")),
                                 vllm_kernels, deterministic_len=max_len if config.deterministic else 0)
        except RuntimeError as e:
            if not config.deterministic:
                raise
            # e.g. bf16 on a CPU whose oneDNN has no bf16 matmul (AVX2): nothing runs the slabs
            raise EngineError(f"the deterministic mode cannot run {dtype} matmuls through oneDNN here "
                              f"({cpu_features.level()}): {e}") from None
        layout_bytes = (mcfg.num_hidden_layers * 2 * config.block_size * mcfg.num_key_value_heads
                        * mcfg.head_dim * torch.tensor([], dtype=dtype).element_size())
        num_blocks = config.num_blocks or max(1, int(self._kv_bytes(config, device) // layout_bytes))
        eos = frozenset(mcfg.eos_token_ids)
        dc_gb = config.extra.get("decode_cache_gb")
        runner = ModelRunner(model, num_blocks, config.block_size, device, dtype, eos, seed=config.seed,
                             decode_cache_bytes=None if dc_gb is None else int(float(dc_gb) * 2**30),
                             vllm_kernels=vllm_kernels, share_kv=config.share_kv,
                             kv_staging=bool(config.extra.get("kv_staging", True)),
                             deterministic=config.deterministic, tokenizer_dir=path)
        name = path.name if path is not None else config.model
        super().__init__(config, runner, num_blocks, max_len, model_name=name)
        if config.deterministic:  # chunks of a prompt no longer than the check verified (batch_invariant.py)
            from services.instance.engine.native.batch_invariant import ATTENTION_CHUNK

            self.scheduler.max_chunk_tokens = ATTENTION_CHUNK
        self.dtype = dtype
        self._lent_blocks = 0  # blocks of dropped layers' memory in the pool (drop_layers)
        self._dropped_bytes: dict[int, int] = {}  # layer -> the parameter bytes it held
        self._held_until = 0.0  # no step before this (monotonic), between a drop and its pipeline
        self._deferred: set[str] = set()  # requests whose live KV exchange a peer refused (logged once)
        if config.extra.get("warmup", True):
            self.warmup()
        self.ready_s = time.perf_counter() - t0
        log.info("native engine ready", path=self.compute_path(), block_size=config.block_size,
                 blocks=num_blocks, seconds=round(self.ready_s, 1))

    def compute_path(self) -> str:
        """What runs a step here, in words: the dtype, vLLM's kernel build or the torch path, the projections."""
        r = self.executor
        if r.kernels is None:
            return f"{str(self.dtype).removeprefix('torch.')} on {r.device.type}, torch path"
        head = r.model.lm_head_packed
        proj = type(head).__name__ if head is not None else "F.linear"
        if r.invariance:
            proj = f"{head.kernel} (deterministic: {r.invariance})"
        return (f"{str(self.dtype).removeprefix('torch.')} on cpu, vLLM kernels {vllm_kernels.loaded_build()} "
                f"(attention{' in place' if r.paged_kernels else ''}, RMSNorm), projections {proj}")

    # --- KunServe: layers dropped into KV memory, pipelined with peers (kunserve.py) -----
    def _blocks_lent_after(self, dropped: dict[int, int]) -> int:
        return sum(dropped.values()) // self.kv_layout.bytes_per_block - self._lent_blocks

    def regroups(self, layers: range) -> bool:
        """Whether dropping these layers re-forms this engine's pipeline (a
        merge, services/scheduler/kunserve.py): it is in one and runs some of
        them for it. Its steps must be held first (``hold_steps``), and the
        pipeline it enters next moves the KV of those layers (``enter_pipeline``)."""
        on_peers = {i for r, _ in self.executor.peer_segments() for i in r}
        return bool(on_peers) and any(i not in on_peers for i in layers)

    def hold_steps(self) -> None:
        """Between steps: take no step until the pipeline is set again (at
        most ``HOLD_S``). A merge's members all hold before any of them drops
        a layer: a member's step must not reach a peer that has dropped the
        layers it runs for that step."""
        self._held_until = time.monotonic() + HOLD_S

    def _held(self) -> bool:
        return bool(self._held_until) and time.monotonic() < self._held_until

    def prepare_drop(self, layers: range):
        """Any thread, before ``drop_layers``: the grown KV storage that
        dropping these layers makes room for (``ModelRunner.new_kv``), made
        here so that the drop itself (between two steps) only copies the
        blocks over. None when it adds no block."""
        model = self.executor.model
        after = dict(self._dropped_bytes)
        after.update({i: model.layer_bytes(range(i, i + 1)) for i in layers if i not in after})
        n = self._blocks_lent_after(after)
        need = self.pool.ids_after_grow(n) if n > 0 else 0
        return self.executor.new_kv(need) if need > self.executor.kv_cache.shape[0] else None

    def drop_layers(self, layers: range, hold: bool = False, fresh=None) -> int:
        """Drop these layers' parameters and lend their memory to the KV cache:
        the pool grows by the whole blocks it holds. Returns the blocks added.
        Run them on a peer (``set_pipeline``) before the next step needs them.
        ``hold``: take no step until the pipeline is set (at most ``HOLD_S``):
        a group's members all drop first, so that each has the room for the
        KV its peers then hand over (``enter_pipeline``). ``fresh``: the
        storage ``prepare_drop`` made (used when the size still fits)."""
        if self.config.extra.get("share_weights"):
            raise EngineError("this engine shares its weights with others in the process: it cannot drop layers")
        if self.executor.returning:
            raise EngineError("this engine is still taking its requests' KV back from its pipeline peers")
        regroup = self.regroups(layers)
        if regroup and not self._held():
            raise EngineError("this engine runs some of these layers for its pipeline: hold its steps first "
                              "(a merge's first round), then drop them and set the new stages")
        if self.guests and not regroup:
            raise EngineError(f"this engine runs layers for {len(self.guests)} requests of its pipeline peers")
        self._dropped_bytes.update(self.executor.model.drop_layers(layers))
        if hold:
            self.hold_steps()
        n = self._blocks_lent_after(self._dropped_bytes)
        if n > 0:
            self.grow_blocks(n, fresh)
            self._lent_blocks += n
        return max(0, n)

    def build_layers(self, states: dict) -> dict:
        """Any thread, before ``restore_layers``: the layers built from their
        parameters (loaded, prepacked) off the engine thread."""
        bad = [i for i in states if not 0 <= i < self.kv_layout.num_layers]
        if bad:
            raise EngineError(f"layers {bad} of a {self.kv_layout.num_layers}-layer model")
        return self.executor.model.build_layers(states)

    def restore_layers(self, states: dict, built: dict | None = None) -> int:
        """Take layers back from their parameters (``{layer: state_dict}``,
        ``LlamaModel.layer_states`` of a host copy or a peer; ``built``: those
        ``build_layers`` made of them) and start giving back the blocks their
        memory lent: free ones at once, used ones as they are freed
        (BlockPool.shrink). Returns the blocks asked back."""
        if built is None or set(built) != set(states):
            built = self.build_layers(states)
        self.executor.model.install_layers(built)
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

    def enter_pipeline(self, own: range, peers: list, live: bool = True, hold: bool = False) -> int:
        """Between steps: run layers ``own`` here and each peer's there from
        the next step. Every request that has KV must find its KV of a peer's
        layers there (the KV exchange). ``live`` (paper §4.3): they go on at
        once, attending here for those layers (remote attention) until their
        KV has moved, a few between two steps (``step``); returns how many
        will move. Else (a pause): the KV of all of them moves now, before the
        next step; returns how many moved.

        If a paused hand-over fails, what was handed over is released on the
        peers, no request counts as remote, and the engine holds its steps (a
        request must not run layers whose KV is not there): the caller takes
        the layers back (``restore_layers``, ``leave_pipeline``) or tries again.

        Already in a pipeline, it re-forms (``_regroup``, with ``hold``):
        always a pause."""
        ex = self.executor
        if ex.pipelined:
            return self._regroup(own, peers, hold)
        self.set_pipeline(own, peers)
        if live:
            moving = [rid for rid, r in sorted(self.requests.items()) if r.num_computed_tokens]
            for rid in moving:
                ex.mark_remote(rid, kv_here=True)
            self._held_until = 0.0
            return len(moving)
        moved: list[str] = []
        try:
            for rid, r in sorted(self.requests.items()):
                if not r.num_computed_tokens:
                    continue
                moved.append(rid)
                self._push_kv(r)
        except Exception:
            for _, peer in ex.peer_segments():
                with contextlib.suppress(Exception):  # the peer may be the failure: its guests die with it
                    peer.release(moved)
            self.hold_steps()
            raise
        for rid in moved:
            ex.mark_remote(rid)
        self._held_until = 0.0
        return len(moved)

    def _regroup(self, own: range, peers: list, hold: bool = False) -> int:
        """Between steps, in a pipeline: run ``own`` here and each peer's
        range there from the next step (a merge re-forms two groups). For
        each running request, the KV of each layer whose holder changes goes
        from the old holder (its own blocks here, or its guest on a peer) to
        the new one, before the next step (a pause: a live re-forming is not
        built). Returns the requests whose KV moved. The same stages again
        move nothing and end a hold (a merge called off, or done: ``hold``
        keeps the steps held after the move, so that the other members'
        moves find this engine between steps, not inside a long one).

        If a move fails, nothing changes here: the guests it made on new
        holders are released, the old holders still have every layer (a
        move copies), and the engine holds its steps (the caller sets the
        old stages again, or tries again)."""
        ex = self.executor
        try:
            old, new = ex.holders(), ex.holders(own, peers)
        except ValueError as e:
            raise EngineError(str(e)) from None
        if all(a is b for a, b in zip(old, new)):
            self._held_until = 0.0
            return 0
        if ex.pending_exchange:
            raise EngineError(f"{len(ex.pending_exchange)} requests' KV exchange is still going: "
                              "the pipeline cannot re-form yet")
        moves = []  # (layers, old holder, new holder), runs of layers that change holder
        for i, (a, b) in enumerate(zip(old, new)):
            if a is b:
                continue
            if moves and moves[-1][0].stop == i and moves[-1][1] is a and moves[-1][2] is b:
                moves[-1] = (range(moves[-1][0].start, i + 1), a, b)
            else:
                moves.append((range(i, i + 1), a, b))
        moved, made = [], []  # made: (peer, request) guests new on a peer, released if it fails
        old_peers = {id(p) for p in old if p is not None}
        try:
            for rid, r in sorted(self.requests.items()):
                if not r.num_computed_tokens:
                    continue
                blocks, n = self._computed_blocks(r), r.num_computed_tokens
                layer_bytes = len(blocks) * self.kv_layout.bytes_per_block // self.kv_layout.num_layers
                holding = set(old_peers)
                for layers, a, b in moves:
                    data = (ex.gather_kv_layers(blocks, layers) if a is None
                            else a.fetch_kv(layers, rid, n, layer_bytes))
                    if b is None:
                        ex.scatter_kv_layers(blocks, layers, data)
                        continue
                    b.push_kv(layers, rid, n, data)
                    if id(b) not in holding:
                        holding.add(id(b))
                        made.append((b, rid))
                moved.append(rid)
            ex.regroup(own, peers, moved)
        except Exception:
            for peer, rid in made:
                with contextlib.suppress(Exception):  # the peer may be the failure: its guests die with it
                    peer.release([rid])
            self.hold_steps()
            raise
        if hold:
            self.hold_steps()
        else:
            self._held_until = 0.0
        return len(moved)

    def leave_pipeline(self, live: bool = True) -> int:
        """Run every layer here again; the layers must be back first
        (``restore_layers``). The KV the peers hold for this engine's requests
        comes back into the requests' own blocks (which have room for every
        layer) and their guests there are released. ``live``: the requests
        go on meanwhile; those whose KV is back run every layer here, the
        others still run the peers' layers there until theirs is back, a few
        between two steps (``step``); returns how many will come back. Else
        (a pause): all of it comes back now, before the next step; returns
        how many came back."""
        ex = self.executor
        if ex.model.dropped():
            raise EngineError(f"layers {ex.model.dropped()} are still dropped: restore them first")
        if live:
            ex.release_requests(ex.pending_exchange)  # their KV never left
            gone = [rid for rid in ex.remote_requests
                    if rid not in self.requests or not self.requests[rid].num_computed_tokens]
            ex.release_requests(gone)
            coming = len(ex.remote_requests)
            ex.start_return()
            self._held_until = 0.0
            if not coming:
                self._end_return()
            return coming
        moved = 0
        here = set(ex.pending_exchange)  # their KV of every layer is here already
        for rid in sorted(ex.remote_requests):
            r = self.requests.get(rid)
            if r is None or not r.num_computed_tokens or rid in here:
                continue
            self._fetch_kv_back(r)
            moved += 1
        if moved or here:  # the dense copies of the layers that ran elsewhere are stale
            ex.forget_dense_slots()
        ex.release_requests(sorted(ex.remote_requests))
        ex.set_pipeline(range(self.kv_layout.num_layers), [])
        self._held_until = 0.0
        return moved

    def step(self):
        if self.executor.pending_exchange:
            self.exchange_kv()
        if self.executor.returning:
            self.return_kv()
        return super().step()

    def return_kv(self, budget_bytes: int | None = None) -> int:
        """Leaving live (``leave_pipeline``): take back from the peers the KV
        of their layers for requests still there, oldest first, about
        ``budget_bytes`` a step (at least one request; default
        ``kunserve_exchange_mb``), releasing their guests; once none is left,
        run every layer here. Returns the requests whose KV came back."""
        ex = self.executor
        if budget_bytes is None:
            budget_bytes = self._exchange_budget()
        got, moved = 0, 0
        for rid in sorted(ex.remote_requests):
            if moved and got >= budget_bytes:
                break
            r = self.requests.get(rid)
            if r is None or not r.num_computed_tokens:
                ex.release_requests([rid])
                continue
            got += self._fetch_kv_back(r)
            ex.release_requests([rid])
            moved += 1
        if not ex.remote_requests:
            self._end_return()
        return moved

    def _push_kv(self, r) -> int:
        """Hand each peer the KV of its layers for this request's computed
        tokens (the exchange, live or paused); returns the bytes sent."""
        ex, sent = self.executor, 0
        blocks = self._computed_blocks(r)
        for layers, peer in ex.peer_segments():
            data = ex.gather_kv_layers(blocks, layers)
            peer.push_kv(layers, r.request_id, r.num_computed_tokens, data)
            sent += len(data)
        return sent

    def _fetch_kv_back(self, r) -> int:
        """Take back from each peer the KV of its layers for this request's
        computed tokens, into its own blocks (leaving, live or paused);
        returns the bytes taken back."""
        ex = self.executor
        blocks = self._computed_blocks(r)
        layer_bytes = len(blocks) * self.kv_layout.bytes_per_block // self.kv_layout.num_layers
        for layers, peer in ex.peer_segments():
            ex.scatter_kv_layers(blocks, layers, peer.fetch_kv(layers, r.request_id, r.num_computed_tokens,
                                                               layer_bytes))
        return layer_bytes * sum(len(layers) for layers, _ in ex.peer_segments())

    def _exchange_budget(self) -> int:
        """KV bytes a live exchange or return moves between two steps (the ``kunserve_exchange_mb`` extra)."""
        return int(float(self.config.extra.get("kunserve_exchange_mb", 16)) * 2**20)

    def _end_return(self) -> None:
        ex = self.executor
        ex.set_pipeline(range(self.kv_layout.num_layers), [])
        ex.forget_dense_slots()  # the copies of the layers that ran on the peers are stale

    def exchange_kv(self, budget_bytes: int | None = None) -> int:
        """The live KV exchange (``enter_pipeline``): hand the peers the KV of
        their layers for pending requests, oldest first, until about
        ``budget_bytes`` moved (at least one request; default the engine's
        ``kunserve_exchange_mb`` extra, 16 MiB): the rest waits for the next
        step, so that a step is never held for all of it. A peer that has no
        room yet refuses: the request keeps attending here and is tried again
        next step. Returns the requests whose KV moved."""
        ex = self.executor
        if budget_bytes is None:
            budget_bytes = self._exchange_budget()
        sent, moved = 0, 0
        for rid in ex.pending_exchange:
            if moved and sent >= budget_bytes:
                break
            r = self.requests.get(rid)
            if r is None or not r.num_computed_tokens:
                ex.exchanged(rid)
                self._deferred.discard(rid)
                continue
            try:
                sent += self._push_kv(r)
            except EngineError as e:
                if rid not in self._deferred:  # once a request: a full peer may refuse it for many steps
                    self._deferred.add(rid)
                    log.info("KV exchange deferred", request_id=rid, reason=str(e))
                break
            self._deferred.discard(rid)
            ex.exchanged(rid)
            moved += 1
        return moved

    def has_work(self) -> bool:
        if self._held():
            return False  # held between a drop and the pipeline (drop_layers)
        return super().has_work()

    def set_pipeline(self, own: range, peers: list) -> None:
        """Layers ``own`` run here, each (range, LayerPeer) there; see kunserve.py."""
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
