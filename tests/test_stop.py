"""StopMatcher: stop strings split across deltas never leak, and text is released as soon as it is safe."""

from __future__ import annotations

import random

import pytest

from gateway.stop import StopMatcher


def run(stops: list[str], deltas: list[str]) -> tuple[str, bool, list[str]]:
    m = StopMatcher(stops)
    out = []
    for d in deltas:
        out.append(m.feed(d))
        if m.stopped:
            break
    if not m.stopped:
        out.append(m.flush())
    return "".join(out), m.stopped, out


def reference(stops: list[str], text: str) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops if s) if i != -1]
    return (text[: min(hits)], True) if hits else (text, False)


def split_reference(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    """What a stream of `deltas` gives: generation ends with the first delta that completes a stop string, cut at
    the earliest start of the stop strings complete by then. With several stop strings that depends on the split
    (stops "abc" and "b": deltas a, b, c give "a", one delta "abc" gives ""), as vLLM's check after each token does;
    `reference` (the whole text at once) is the one-delta case."""
    seen = ""
    for d in deltas:
        seen += d
        text, stopped = reference(stops, seen)
        if stopped:
            return text, True
    return seen, False


def test_with_two_stop_strings_the_split_decides_which_ends_the_text():
    assert run(["abc", "b"], ["a", "b", "c"])[:2] == ("a", True)       # "b" completes first
    assert run(["abc", "b"], ["abc"])[:2] == ("", True)                # both complete: the earlier start
    assert split_reference(["abc", "b"], ["a", "b", "c"]) == ("a", True)


def test_no_stops_passes_through():
    assert run([], ["ab", "cd"]) == ("abcd", False, ["ab", "cd", ""])


def test_stop_split_across_many_deltas():
    text, stopped, pieces = run(["<END>"], ["hello ", "<", "E", "N", "D", ">", " after"])
    assert (text, stopped) == ("hello ", True)
    assert pieces[0] == "hello " and all(p == "" for p in pieces[1:])


def test_held_prefix_released_when_it_stops_matching():
    m = StopMatcher(["<END>"])
    assert m.feed("a<E") == "a"
    assert m.held == "<E"
    assert m.feed("x") == "<Ex"
    assert m.flush() == ""


def test_flush_releases_held_text_at_end():
    m = StopMatcher(["stop"])
    assert m.feed("go st") == "go "
    assert m.flush() == "st"
    assert not m.stopped


def test_match_at_the_very_start():
    assert run(["ab"], ["ab", "cd"])[:2] == ("", True)
    assert run(["ab"], ["a", "bcd"])[:2] == ("", True)


def test_overlapping_prefixes():
    # "aab" inside "aaab": the first candidate start fails, a later one succeeds.
    assert run(["aab"], ["a", "a", "a", "b", "z"])[:2] == ("a", True)
    assert run(["abab"], ["ab", "ab", "ab"])[:2] == ("", True)
    assert run(["abac"], ["ab", "ab", "ac"])[:2] == ("ab", True)


def test_multiple_stops_earliest_wins():
    assert run(["world", "lo w"], ["hello world"])[:2] == ("hel", True)
    assert run(["xyz", "b"], ["a", "b", "xyz"])[:2] == ("a", True)
    # One stop is a prefix of another: the shorter one matches first.
    assert run(["ab", "abc"], ["a", "bc"])[:2] == ("", True)


def test_nothing_after_stop():
    m = StopMatcher(["."])
    assert m.feed("one. two") == "one"
    assert m.feed("three") == ""
    assert m.flush() == ""
    assert m.matched == "."


def test_unicode_and_empty_deltas():
    assert run(["東京"], ["naïve ", "", "東", "", "京 🍣"])[:2] == ("naïve ", True)


@pytest.mark.parametrize("seed", range(200))
def test_random_splits_match_reference(seed):
    rng = random.Random(seed)
    alphabet = "ab c"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 10))))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    got, stopped, pieces = run(stops, deltas)
    assert (got, stopped) == split_reference(stops, deltas)
    # Emitted text is released as early as possible: after each delta, only a possible stop-string start is held.
    emitted = ""
    for d_end, piece in zip(range(len(deltas)), pieces):
        emitted += piece
        seen = "".join(deltas[: d_end + 1])
        if not stopped:
            held = seen[len(emitted):]
            assert len(held) < max(len(s) for s in stops)
            assert held == "" or any(s.startswith(held) for s in stops)


def _held_reference(text: str, stops: list[str]) -> int:
    """The longest suffix of text that is a proper prefix of some stop string, by trying every length."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@pytest.mark.parametrize("seed", range(40))
def test_held_text_is_the_longest_partial_match_on_self_overlapping_stops(seed):
    """The KMP states (one per stop string, advanced over each delta only) hold back exactly the longest suffix that
    may still grow into a stop string, on the stop strings where a naive restart goes wrong (aab in aaab, abab in
    ababab...)."""
    rng = random.Random(seed)
    stops = ["".join(rng.choice("ab") for _ in range(rng.randint(2, 7))) for _ in range(rng.randint(1, 4))]
    m = StopMatcher(stops)
    seen = ""
    for _ in range(60):
        delta = "".join(rng.choice("abc") for _ in range(rng.randint(0, 4)))
        m.feed(delta)
        if m.stopped:
            break
        seen += delta
        assert m.held == seen[len(seen) - _held_reference(seen, stops):] if _held_reference(seen, stops) else \
            m.held == "", (stops, seen, m.held)


def test_a_long_stop_string_is_matched_without_rescanning_the_held_text():
    stop = "x" * 20000 + "!"
    m = StopMatcher([stop])
    out = "".join(m.feed("x") for _ in range(20000))          # all held: each may start the stop string
    assert out == "" and len(m.held) == 20000
    assert m.feed("y") == "x" * 20000 + "y" and m.held == ""


def _reference_after(stops: list[str], text: str, start: int) -> tuple[str, bool]:
    """vLLM's min_tokens rule: text[:start] is emitted unchecked; the earliest stop string that ends past `start`
    ends the output there (cut no earlier than `start`: what was emitted stays)."""
    hits = []
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i != -1:
            hits.append(i)
    return (text[: max(start, min(hits))], True) if hits else (text, False)


@pytest.mark.parametrize("seed", range(60))
def test_text_observed_before_min_tokens_can_start_a_stop_string(seed):
    """Deltas before min_tokens are emitted unchecked (`observe`): a stop string wholly inside them does not stop,
    but one that starts there and ends in a later delta does (it went unmatched: the matcher never saw its start),
    and everything emitted before the boundary stays emitted."""
    rng = random.Random(seed)
    alphabet = "ab c"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(1, len(text) + 1), k=min(len(text), rng.randint(1, 10))))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if b > a]
    unchecked = rng.randint(0, len(deltas))
    m = StopMatcher(stops)
    out = []
    for i, d in enumerate(deltas):
        if i < unchecked:
            m.observe(d)
            out.append(d)
        else:
            out.append(m.feed(d))
            if m.stopped:
                break
    if not m.stopped:
        out.append(m.flush())
    start = sum(len(d) for d in deltas[:unchecked])
    assert ("".join(out), m.stopped) == _reference_after(stops, text, start)


def test_a_stop_string_straddling_the_min_tokens_boundary_stops():
    m = StopMatcher(["END"])
    m.observe("the E")
    assert m.feed("ND and more") == "" and m.stopped and m.matched == "END"
