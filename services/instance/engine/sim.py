"""The sim engine: the same scheduler and block pool as native, with a latency
model instead of the forward pass. A step sleeps (time.sleep, so many sim
instances share one machine) for

    decode_base_ms + decode_ms_per_seq * batch + decode_ms_per_kv_token * kv_tokens
    + prefill_ms_per_token * prefill_tokens

where ``batch`` counts the requests in the step, ``kv_tokens`` the context
tokens the decodes attend to and ``prefill_tokens`` the tokens of prefill
chunks. Tokens come from the fake model (fake_next_token over the context
stored in a token-id KV), so migrations on sim are checked like on fake.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, fields

from services.instance.engine.base import EngineConfig, EngineError
from services.instance.engine.core.engine import CoreEngine
from services.instance.engine.core.scheduler import ScheduledChunk
from services.instance.engine.fake import TokenKvExecutor

PROFILE_DIR = pathlib.Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class SimProfile:
    name: str
    block_size: int
    kv_capacity_tokens: int
    prefill_ms_per_token: float
    decode_base_ms: float
    decode_ms_per_seq: float
    decode_ms_per_kv_token: float = 0.0
    max_model_len: int = 2048
    # Migration cost model (the discrete-event simulator, ferry/sim): the KV
    # one token weighs and the link it crosses. The defaults are the live sim
    # engine's own: token ids as float32 K and V, over loopback gRPC.
    kv_bytes_per_token: int = 8
    migration_bandwidth_gbps: float = 8.0
    # Splitwise (ferry sim splitwise): what one instance's machine costs and
    # draws, and the model's layer count (per-layer KV handoff exposes one
    # layer's share of the transfer). Defaults: unknown (0), which the
    # provisioning study refuses; every other use ignores them.
    num_layers: int = 0
    machine_gpus: int = 0  # GPUs serving one instance (tensor parallel)
    machine_power_w: float = 0.0  # provisioned power of the machine (GPU TDP or power cap times GPUs)
    machine_cost: float = 0.0  # relative cost per machine-hour, a DGX-A100 = 1.0
    # KunServe (ferry sim kunserve): one replica's parameter memory, which
    # dropping layers lends to the KV cache. 0: unknown (refused there).
    param_bytes: int = 0
    hardware: str = ""
    model: str = ""
    source: str = ""

    @property
    def num_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size

    def step_ms(self, batch: int, prefill_tokens: int, kv_tokens: int) -> float:
        if batch == 0:
            return 0.0
        return (self.decode_base_ms + self.decode_ms_per_seq * batch
                + self.decode_ms_per_kv_token * kv_tokens + self.prefill_ms_per_token * prefill_tokens)

    @classmethod
    def load(cls, name_or_path: str) -> SimProfile:
        path = pathlib.Path(name_or_path)
        if not path.is_file() and (PROFILE_DIR / f"{name_or_path}.json").is_file():  # a name (may hold dots)
            path = PROFILE_DIR / f"{name_or_path}.json"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.json")))
            raise EngineError(f"unknown sim profile {name_or_path!r}; known: {known} (or a path to a JSON file)")
        raw = json.loads(path.read_text())
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


def chunk_cost(chunks: list[ScheduledChunk]) -> tuple[int, int, int]:
    """(batch, prefill_tokens, kv_tokens) of a step."""
    prefill = sum(c.num_new for c in chunks if c.num_new > 1)
    kv = sum(c.end for c in chunks if c.num_new == 1)
    return len(chunks), prefill, kv


class SimExecutor(TokenKvExecutor):
    def __init__(self, profile: SimProfile, num_blocks: int):
        super().__init__(num_blocks, profile.block_size)
        self.profile = profile
        self.last_step_ms = 0.0

    def execute(self, chunks: list[ScheduledChunk]) -> list[int | None]:
        self.last_step_ms = self.profile.step_ms(*chunk_cost(chunks))
        return self.paced(chunks, self.last_step_ms / 1000.0)


class SimEngine(CoreEngine):
    name = "sim"

    def __init__(self, config: EngineConfig):
        self.profile = SimProfile.load(config.profile)
        num_blocks = config.num_blocks or self.profile.num_blocks
        executor = SimExecutor(self.profile, num_blocks)
        super().__init__(config, executor, num_blocks, config.max_model_len or self.profile.max_model_len,
                         model_name=self.profile.name)
