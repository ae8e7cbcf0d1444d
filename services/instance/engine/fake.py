"""Interim fake engine for the walking skeleton: deterministic tokens, a fixed
per-step delay, simple block accounting. To be rebuilt on the shared engine
core (block pool + scheduler) so migration hooks work on it too."""

from __future__ import annotations

import time
from collections import OrderedDict

from libs.common.types import FinishReason, RequestLoad, RequestState, TokenOutput
from services.instance.engine.base import (
    Engine,
    EngineConfig,
    EngineError,
    EngineLoad,
    EngineRequest,
    IntegrityError,
    KvLayout,
)

# Printable ASCII: the fake model's tokenizer is bytes (see libs/common/tokenizer.py).
VOCAB_LO, VOCAB_HI = 97, 123  # a..z
EOS_TOKEN_ID = 0


def fake_next_token(context: list[int]) -> int:
    """The fake model: the next token is a function of the whole context."""
    h = 1469598103934665603
    for t in context[-8:]:
        h = ((h ^ t) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    h ^= len(context)
    return VOCAB_LO + h % (VOCAB_HI - VOCAB_LO)


class _Req:
    def __init__(self, r: EngineRequest):
        self.r = r
        self.output: list[int] = list(r.resume_token_ids)


class FakeEngine(Engine):
    name = "fake"

    def __init__(self, config: EngineConfig):
        self.config = config
        self._block_size = config.block_size
        self._total = config.num_blocks or 1024
        self._max_len = config.max_model_len or 2048
        self.delay_s = config.token_delay_ms / 1000.0
        self.reqs: OrderedDict[str, _Req] = OrderedDict()

    block_size = property(lambda self: self._block_size)
    num_total_blocks = property(lambda self: self._total)
    max_model_len = property(lambda self: self._max_len)
    kv_layout = property(lambda self: KvLayout("float32", self._block_size, 1, 1, 1))

    def _blocks(self, q: _Req) -> int:
        n = len(q.r.prompt_token_ids) + len(q.output)
        return -(-n // self._block_size)

    @property
    def num_free_blocks(self) -> int:
        return self._total - sum(self._blocks(q) for q in self.reqs.values())

    def add_request(self, request: EngineRequest) -> None:
        if len(request.prompt_token_ids) + request.sampling.max_tokens > self._max_len:
            raise EngineError("prompt + max_tokens exceeds max_model_len")
        self.reqs[request.request_id] = _Req(request)

    def abort_request(self, request_id: str) -> bool:
        return self.reqs.pop(request_id, None) is not None

    def has_work(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[TokenOutput]:
        if not self.reqs:
            return []
        time.sleep(self.delay_s)
        out = []
        for rid, q in list(self.reqs.items()):
            tok = fake_next_token(list(q.r.prompt_token_ids) + q.output)
            q.output.append(tok)
            done = len(q.output) >= q.r.sampling.max_tokens
            out.append(TokenOutput(rid, len(q.output) - 1, tok, FinishReason.LENGTH if done else None))
            if done:
                del self.reqs[rid]
        return out

    def load(self) -> EngineLoad:
        reqs = tuple(
            RequestLoad(rid, q.r.priority, "running", self._blocks(q),
                        len(q.r.prompt_token_ids) + len(q.output))
            for rid, q in self.reqs.items()
        )
        return EngineLoad(self._total, self.num_free_blocks, self._block_size, reqs)

    def check_integrity(self) -> None:
        if self.num_free_blocks < 0:
            raise IntegrityError("more blocks used than exist")

    # Migration hooks: not supported by the interim fake engine.
    def _unsupported(self, *a, **k):
        raise NotImplementedError("interim fake engine has no migration hooks")

    request_phase = lambda self, rid: ("running", 0) if rid in self.reqs else None  # noqa: E731
    full_blocks = all_blocks = gather_kv = reserve_blocks = scatter_kv = _unsupported
    release_blocks = suspend_request = resume_request = export_state = _unsupported
    install_request = drop_request = _unsupported

    def export_state(self, request_id: str) -> RequestState:  # noqa: F811
        raise NotImplementedError
