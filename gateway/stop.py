"""Stop strings over streamed text: emit as early as possible, never emit any part of a stop string.

Text arrives in arbitrary deltas (one token's worth, or less), so a stop string can be split across many of them.
`StopMatcher.feed` returns only text that can no longer become part of a match: it holds back the longest suffix of
what it has seen that is still a prefix of some stop string. When a stop string completes, everything before its
first occurrence is released and the rest (the stop string and whatever followed it) is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["StopMatcher"]


class StopMatcher:
    """Feed text deltas; get back text safe to emit. After a match, `stopped` is True and nothing more comes out."""

    def __init__(self, stops: Iterable[str] = ()) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None     # the stop string that ended generation

    def feed(self, delta: str) -> str:
        """Add text; return the part of it (and of earlier held text) that cannot start a stop string."""
        if self.stopped or not delta:
            return ""
        if not self.stops:
            return delta
        text = self._held + delta
        cut, which = self._first_match(text)
        if which is not None:
            self.stopped, self.matched, self._held = True, which, ""
            return text[:cut]
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """No more text is coming: held-back text can no longer grow into a stop string, so release it."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held

    @property
    def held(self) -> str:
        return self._held

    def _first_match(self, text: str) -> tuple[int, str | None]:
        """Earliest start of any stop string in text (the held part cannot hold a whole one, only start one)."""
        best, which = len(text) + 1, None
        for s in self.stops:
            i = text.find(s)
            if i != -1 and i < best:
                best, which = i, s
        return best, which

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string (0 if none)."""
        for k in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[len(text) - k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
