"""Stop strings over streamed text: emit text as soon as it cannot be the
start of a stop string; cut at the first stop string."""

from __future__ import annotations


class StopMatcher:
    """``include``: the stop string itself is part of the text (vLLM's include_stop_str_in_output)."""

    def __init__(self, stops: list[str], include: bool = False):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False
        self.include = include

    def feed(self, text: str) -> str:
        """Text safe to emit now. Sets ``stopped`` when a stop string appears."""
        if not self.stops:
            return text
        if self.stopped:
            return ""
        buf = self.held + text
        found = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if found:
            cut, stop = min(found)
            self.stopped = True
            self.held = ""
            return buf[:cut + (len(stop) if self.include else 0)]
        # Hold back the longest suffix that is a prefix of some stop string.
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep] if keep else buf

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out
