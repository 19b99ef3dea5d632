"""Stop strings over streamed text: emit as early as possible, never emit any part of a stop string.

Text arrives in arbitrary deltas (one token's worth, or less), so a stop string can be split across many of them.
`StopMatcher.feed` returns only text that can no longer become part of a match: it holds back the longest suffix of
what it has seen that is still a prefix of some stop string. When a stop string completes, everything before its
first occurrence is released and the rest (the stop string and whatever followed it) is dropped. With `include`
(vLLM's `include_stop_str_in_output`) the stop string itself is released too, and nothing is held back: the text
may end with a stop string's beginning, since a completed one would be emitted anyway.

The held-back suffix is tracked with one Knuth-Morris-Pratt state per stop string, advanced over each delta's
characters only: checking every suffix length against every stop string on each delta (the first version) cost
O(held^2) a delta, 0.33 s for one delta with 100k characters held.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["StopMatcher"]


class StopMatcher:
    """Feed text deltas; get back text safe to emit. After a match, `stopped` is True and nothing more comes out."""

    def __init__(self, stops: Iterable[str] = (), include: bool = False) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.include = include
        self._fail = [_prefix_function(s) for s in self.stops]
        self._state = [0] * len(self.stops)    # per stop: the longest prefix of it that the text seen ends with
        self._held = ""
        self._tail = ""                     # the end of the text already emitted: where a stop string may start
        self._keep = max((len(x) for x in self.stops), default=1) - 1
        self.stopped = False
        self.matched: str | None = None     # the stop string that ended generation

    def feed(self, delta: str) -> str:
        """Add text; return the part of it (and of earlier held text) that cannot start a stop string."""
        if self.stopped or not delta:
            return ""
        if not self.stops:
            return delta
        text = self._held + delta
        start, which = self._first_match(text)
        if which is not None:
            self.stopped, self.matched, self._held = True, which, ""
            return text[:start + len(which)] if self.include else text[:max(0, start)]
        keep = 0 if self.include else min(self._advance(delta), len(text))
        self._held = text[len(text) - keep:] if keep else ""
        self._emitted(text[: len(text) - keep])
        return text[: len(text) - keep]

    def observe(self, delta: str) -> None:
        """Text emitted without being checked (the tokens before `min_tokens`): no stop string may end inside it,
        but one may start in it and end in text fed later (vLLM's check looks back that far too)."""
        if self.stopped or not delta or not self.stops:
            return
        self._advance(delta)
        self._emitted(delta)

    def _emitted(self, text: str) -> None:
        self._tail = (self._tail + text)[max(0, len(self._tail) + len(text) - self._keep):] if self._keep else ""

    def flush(self) -> str:
        """No more text is coming: held-back text can no longer grow into a stop string, so release it."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held

    @property
    def held(self) -> str:
        return self._held

    def _first_match(self, text: str) -> tuple[int, str | None]:
        """Earliest start of any stop string that ends in `text` (the held part cannot hold a whole one, only start
        one), as an index into `text`: negative when it starts in the emitted tail (the cut is then at 0)."""
        full, tail = self._tail + text, len(self._tail)
        best, which = len(full) + 1, None
        for s in self.stops:
            i = full.find(s, max(0, tail - len(s) + 1))      # it must end past the tail
            if i != -1 and i < best:
                best, which = i, s
        return best - tail, which

    def _advance(self, delta: str) -> int:
        """Advance every stop string's KMP state over `delta`; the longest suffix of the text seen that is a proper
        prefix of some stop string (no stop string occurs whole: `_first_match` found none)."""
        for i, (stop, fail) in enumerate(zip(self.stops, self._fail)):
            k = self._state[i]
            for c in delta:
                while k and (k == len(stop) or stop[k] != c):
                    k = fail[k - 1]
                if stop[k] == c:
                    k += 1
            self._state[i] = k
        return max(self._state, default=0)


def _prefix_function(s: str) -> list[int]:
    """pi[i]: the length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    pi = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = pi[k - 1]
        if s[i] == s[k]:
            k += 1
        pi[i] = k
    return pi
