"""Program metrics (issue 53) of a workload whose requests are turns of
programs (``--prefix agentic`` or ``sessions``: Request.session), from the
client's records, live (``ferry bench``) and simulated (``ferry sim``):

- program completion time: from its first turn's arrival (when the workload
  said to send it) to its last turn's last token, over programs all of whose
  turns completed; p50 / p99 / mean in ms;
- turn TTFT: every completed turn's time to first token; p50 / p99 / mean in ms;
- returning turns (turns 2+): their prompt tokens, of them those computed
  rather than served by a prefix cache (RequestRecord.cached_tokens: the
  engine's hit at the admission that gave the first token) and that as a
  fraction; and the part that matters for keeping KV between turns, the
  cached prefix: the history a turn resends (the previous turn's prompt and
  answer) in whole blocks, of it the tokens computed again
  (``prefix_recomputed_tokens``, ``prefix_recomputed_fraction``). A new
  input is always computed; a prefix recomputed is KV that was evicted or
  sits elsewhere.

Records without ``cached_tokens`` (a server that does not say) leave the
token counts None."""

from __future__ import annotations

from collections.abc import Sequence

from ferry.measure.metrics import RequestRecord, stats_ms
from ferry.measure.workload import Request


def summary(requests: Sequence[Request], records: Sequence[RequestRecord], block_size: int,
            scale: float = 1.0) -> dict | None:
    """None when no request is a program's turn. ``scale`` divides every
    duration (the sim's time scale, as metrics.summarize)."""
    by_program: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        if r.session >= 0:
            by_program.setdefault(r.session, []).append(i)
    if not by_program:
        return None
    bs = max(1, block_size)
    completion, ttft = [], []
    ret_prompt = ret_computed = prefix = prefix_recomputed = 0
    known = True
    returning = 0
    for turns in by_program.values():
        turns.sort(key=lambda i: requests[i].turn)
        recs = [records[i] for i in turns]
        if all(r.ok for r in recs):
            completion.append(recs[-1].finished_at - recs[0].scheduled_at)
        for k, i in enumerate(turns):
            rec = records[i]
            if rec.ok:
                ttft.append(rec.ttft_s)
            if k == 0 or not rec.ok:
                continue
            returning += 1
            if rec.cached_tokens is None:
                known = False
                continue
            prev = requests[turns[k - 1]]
            p = requests[i].prompt_len
            cached = min(rec.cached_tokens, p)
            ret_prompt += p
            ret_computed += p - cached
            # the history it resends, in whole blocks (at most prompt - 1 tokens are ever served)
            hist = min(prev.prompt_len + prev.output_len, p - 1) // bs * bs
            prefix += hist
            prefix_recomputed += max(0, hist - cached)
    out = {"programs": len(by_program), "programs_completed": len(completion),
           "turns": sum(len(t) for t in by_program.values()), "returning_turns": returning,
           "completion_ms": stats_ms(completion, scale), "turn_ttft_ms": stats_ms(ttft, scale)}
    if known and returning:
        out.update(returning_prompt_tokens=ret_prompt, returning_computed_tokens=ret_computed,
                   returning_computed_fraction=ret_computed / ret_prompt if ret_prompt else None,
                   prefix_tokens=prefix, prefix_recomputed_tokens=prefix_recomputed,
                   prefix_recomputed_fraction=prefix_recomputed / prefix if prefix else None)
    else:
        out.update(returning_prompt_tokens=None, returning_computed_tokens=None, returning_computed_fraction=None,
                   prefix_tokens=None, prefix_recomputed_tokens=None, prefix_recomputed_fraction=None)
    return out


def table(summaries: dict[str, dict]) -> str:
    """The programs' numbers of each policy's summary (those that have them), as a text table."""
    rows = [(name, s["programs"]) for name, s in summaries.items() if s.get("programs")]
    if not rows:
        return ""

    def ms(v):
        return "-" if v is None else f"{v:,.0f}"

    def frac(v):
        return "-" if v is None else f"{v:.3f}"

    head = (f"{'policy':<22} {'programs':>9} {'PCT p50':>10} {'PCT p99':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'ret. computed':>14} {'prefix recomp.':>15}")
    lines = ["programs (PCT: program completion time, ms; returning turns' prompt tokens computed, and of their "
             "cached prefix recomputed, as fractions):", head]
    for name, p in rows:
        lines.append(f"{name:<22} {p['programs_completed']:>4}/{p['programs']:<4} {ms(p['completion_ms']['p50']):>10} "
                     f"{ms(p['completion_ms']['p99']):>10} {ms(p['turn_ttft_ms']['p50']):>9} "
                     f"{ms(p['turn_ttft_ms']['p99']):>9} {frac(p['returning_computed_fraction']):>14} "
                     f"{frac(p['prefix_recomputed_fraction']):>15}")
    return "\n".join(lines)
