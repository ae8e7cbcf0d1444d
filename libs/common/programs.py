"""Programs (issue 53): an agent's session, a run of turns that each resend
the program's whole history, named by the client (``prompt_cache_key`` or the
``x-session-id`` header: services/frontend/completions.program_of) and carried
on DispatchRequest.program_id and GenerateOrder.program_id.

``ProgramLedger`` counts per program what its turns were given: turns,
prompt tokens, and of them the tokens dispatch expected to be served from a
prefix cache (the chosen instance's longest held prefix of the prompt, as
the prefix index had it; 0 where the policy is prefix-blind and nothing was
looked up) and those to compute: the program's attained service. Bounded:
the least recently seen program is forgotten beyond ``max_programs``. Pure
(no I/O), kept by the scheduler (services/scheduler/service.py), whose
metrics aggregate over programs (never labelled by program id)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class ProgramStats:
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # expected served from cache at dispatch
    first_seen: float = 0.0
    last_seen: float = 0.0

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


class ProgramLedger:
    def __init__(self, max_programs: int = 100_000):
        self.max_programs = max_programs
        self._programs: OrderedDict[str, ProgramStats] = OrderedDict()

    def __len__(self) -> int:
        return len(self._programs)

    def get(self, program_id: str) -> ProgramStats | None:
        return self._programs.get(program_id)

    def turns_before(self, program_id: str) -> int:
        """DispatchRequest.program_turn of a turn of ``program_id`` about to be
        dispatched: its turns recorded so far (0: its first; -1: no program)."""
        if not program_id:
            return -1
        s = self._programs.get(program_id)
        return s.turns if s is not None else 0

    @staticmethod
    def cached_tokens(prompt_tokens: int, hit_blocks: int, block_size: int) -> int:
        """A dispatched turn's cached tokens where ``hit_blocks`` of its prompt
        are cached: at most all but the last prompt token (an engine always
        computes one, to sample from)."""
        return min(hit_blocks * block_size, max(0, prompt_tokens - 1))

    def record(self, program_id: str, prompt_tokens: int, cached_tokens: int, now: float) -> ProgramStats:
        """One turn of ``program_id`` dispatched (a resume of the same request
        counts again: its prompt is given again). Returns its stats after it;
        ``turns == 1``: the program's first turn seen here."""
        s = self._programs.get(program_id)
        if s is None:
            s = self._programs[program_id] = ProgramStats(first_seen=now)
            if len(self._programs) > self.max_programs:
                self._programs.popitem(last=False)
        else:
            self._programs.move_to_end(program_id)
        s.turns += 1
        s.prompt_tokens += prompt_tokens
        s.cached_tokens += min(max(0, cached_tokens), prompt_tokens)
        s.last_seen = now
        return s
