"""Stop strings over streamed text: emit text as soon as it cannot be the
start of a stop string; cut at the first stop string."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text safe to emit now. Sets ``stopped`` when a stop string appears."""
        if not self.stops:
            return text
        if self.stopped:
            return ""
        buf = self.held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.held = ""
            return buf[:cut]
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
