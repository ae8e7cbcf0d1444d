"""The fake engine: the real core (block pool, scheduler, migration hooks) with
a toy model whose KV cache content matters.

Every KV position stores its token id (KvLayout float32, 1 layer, 1 head,
head_dim 1). The next token is computed from the context READ BACK from the KV
cache (the newest position included), so a request whose KV was corrupted, lost
or misordered in a migration emits different tokens — migration tests on the
fake engine catch broken transfers. Tokens are printable letters a..z (the
frontend detokenizes fake tokens as bytes); output is deterministic: a request
emits ``fake_next_token(prompt + output so far)`` at every step.
"""

from __future__ import annotations

import operator
import time

import numpy as np

from services.instance.engine import shared_kv
from services.instance.engine.base import EngineConfig, KvLayout
from services.instance.engine.core.engine import CoreEngine
from libs.common.types import Logprobs
from services.instance.engine.core.executor import Executor, Sampled, TappedChunk
from services.instance.engine.core.scheduler import ScheduledChunk, cdiv

# Printable ASCII: the fake model's tokenizer is bytes (see libs/common/tokenizer.py).
VOCAB_LO, VOCAB_HI = 97, 123  # a..z
EOS_TOKEN_ID = 0


def _mix(tail: list[int], length: int, weighted: int) -> int:
    h = 1469598103934665603
    for t in tail:
        h = ((h ^ t) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    h ^= length
    h = ((h ^ (weighted % 1000003)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return VOCAB_LO + (h >> 7) % (VOCAB_HI - VOCAB_LO)


def fake_next_token(context: list[int]) -> int:
    """The fake model: the next token is a function of the whole context (a
    hash of the last 8 tokens, the length, and a position-weighted sum of all
    tokens, so any changed position changes the result)."""
    weighted = sum(map(operator.mul, context, range(1, len(context) + 1)))
    return _mix(list(context[-8:]), len(context), weighted)


def fake_generate(prompt: list[int], n: int) -> list[int]:
    """What a fake engine emits for ``prompt`` (it never emits EOS): the fake
    model run here, for tests and benchmarks that check outputs exactly."""
    ctx, out = list(prompt), []
    for _ in range(n):
        out.append(fake_next_token(ctx))
        ctx.append(out[-1])
    return out


def fake_next_token_array(context: np.ndarray) -> int:
    """fake_next_token over an int64 array, vectorised (the sim engine's hot
    path). NOTE: exact: ids < 2**24 and length < 2**20 keep the sum in int64."""
    weighted = int(np.dot(context, np.arange(1, len(context) + 1, dtype=np.int64)))
    return _mix(context[-8:].tolist(), len(context), weighted)


class TokenKvExecutor(Executor):
    """KV storage of token ids: ``[num_blocks, 1, 2, block_size, 1, 1]``
    float32 (exact for ids < 2**24), which is already the fused transfer
    layout, so gather/scatter are one take/put."""

    eos_token_ids = frozenset({EOS_TOKEN_ID})
    vocab_size = 1 << 24  # ids a float32 KV stores exactly
    layer_taps = True  # its one layer is written by _write

    def __init__(self, num_blocks: int, block_size: int, share_kv: bool = True):
        self._layout = KvLayout("float32", block_size, 1, 1, 1)
        self._share = share_kv
        self._region: shared_kv.SharedRegion | None = None
        self.cache = self._zeros(num_blocks)

    def _zeros(self, num_blocks: int) -> np.ndarray:
        """A zeroed cache; in shared memory when asked and possible (the
        region replaces the current one)."""
        buf, region = shared_kv.zeroed(num_blocks * self._layout.bytes_per_block, "fake", self._share)
        if self._region is not None:
            self._region.close()
        self._region = region
        return np.frombuffer(buf, dtype=np.float32).reshape(num_blocks, 1, 2, self._layout.block_size, 1, 1)

    def kv_share(self) -> shared_kv.KvShare | None:
        return self._region.share if self._region is not None else None

    @property
    def kv_layout(self) -> KvLayout:
        return self._layout

    def _write(self, chunk: ScheduledChunk) -> None:
        bs = self._layout.block_size
        req = chunk.request
        toks = req.tokens(chunk.start, chunk.end)
        for pos, tok in zip(range(chunk.start, chunk.end), toks):
            b = req.block_ids[pos // bs]
            self.cache[b, 0, :, pos % bs, 0, 0] = tok

    def _read(self, chunk: ScheduledChunk) -> np.ndarray:
        bs = self._layout.block_size
        ids = chunk.request.block_ids[: cdiv(chunk.end, bs)]
        keys = self.cache[ids, 0, 0, :, 0, 0].reshape(-1)[: chunk.end]
        vals = self.cache[ids, 0, 1, :, 0, 0].reshape(-1)[: chunk.end]
        # K and V must agree: mixing them makes a swapped half show up too.
        return np.where(keys == vals, keys, keys + 1).astype(np.int64)

    def compute(self, chunks: list[ScheduledChunk]) -> list[int | Sampled | None]:
        out: list[int | Sampled | None] = []
        for c in chunks:
            self._write(c)
            if c.request.layer_tap is not None:  # its one layer is written
                t = TappedChunk(c, self._layout.block_size, 1)
                t.emit(0, memoryview(self.cache[list(t.block_ids), 0].tobytes()) if t.copy else None)
            r = c.request
            if r.sampling.prompt_logprobs is not None:  # the fake model is sure of every token: log 1
                for j in range(c.start, min(c.end, r.num_prompt_tokens - 1)):
                    r.prompt_logprobs[j + 1] = _certain(r.prompt_token_ids[j + 1], r.sampling.prompt_logprobs)
            if not c.samples:
                out.append(None)
                continue
            tok = fake_next_token_array(self._read(c))
            out.append(Sampled(tok, _certain(tok, r.sampling.logprobs)) if r.sampling.logprobs is not None else tok)
        return out

    def execute(self, chunks: list[ScheduledChunk]) -> list[int | None]:
        return self.compute(chunks)

    def paced(self, chunks: list[ScheduledChunk], step_s: float) -> list[int | None]:
        """compute(), then sleep out the rest of a step that takes ``step_s``."""
        t0 = time.perf_counter()
        out = self.compute(chunks)
        left = step_s - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        return out

    def gather_kv(self, block_ids: list[int]) -> memoryview:
        return memoryview(np.ascontiguousarray(self.cache[block_ids]).tobytes())

    def grow_kv(self, num_blocks: int, fresh=None, holding=None) -> None:
        have = self.cache.shape[0]
        if num_blocks > have:
            bigger = self._zeros(num_blocks)
            bigger[:have] = self.cache
            self.cache = bigger

    def scatter_kv(self, block_ids: list[int], data: bytes | memoryview) -> None:
        arr = np.frombuffer(data, dtype=np.float32).reshape((len(block_ids),) + self.cache.shape[1:])
        self.cache[block_ids] = arr

    def scatter_kv_layer(self, block_ids: list[int], layer: int, data: bytes | memoryview) -> None:
        arr = np.frombuffer(data, dtype=np.float32).reshape((len(block_ids),) + self.cache.shape[2:])
        self.cache[block_ids, layer] = arr


def _certain(token: int, k: int) -> Logprobs:
    """The fake model's logprobs: its token has probability 1 (and is its only top token)."""
    return Logprobs(0.0, ((token, 0.0),) if k else ())


class FakeExecutor(TokenKvExecutor):
    def __init__(self, num_blocks: int, block_size: int, delay_s: float, share_kv: bool = True):
        super().__init__(num_blocks, block_size, share_kv)
        self.delay_s = delay_s

    def execute(self, chunks: list[ScheduledChunk]) -> list[int | None]:
        return self.paced(chunks, self.delay_s)


class FakeEngine(CoreEngine):
    name = "fake"

    def __init__(self, config: EngineConfig):
        num_blocks = config.num_blocks or 1024
        executor = FakeExecutor(num_blocks, config.block_size, config.token_delay_ms / 1000.0, config.share_kv)
        super().__init__(config, executor, num_blocks, config.max_model_len or 2048, model_name="fake")
