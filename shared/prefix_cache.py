"""Prefix caching for hybrid models: a prompt that starts with tokens an earlier request computed skips them.

A coding agent sends its whole conversation again every turn (25k tokens took 26-31 s on the CPU, every turn,
docs/agents.md). Attention layers keep K/V per block, so the full blocks of a common prefix can be shared (the block
manager counts holders). Gated DeltaNet layers, the PLE branch's conv tail and its n-gram context keep one state a
sequence that sums up every token so far and cannot be cut at an arbitrary position: a prefix is reusable only where
that state was saved. So the cache saves states:

- When a request's prefill reaches its snapshot position (the last block boundary at least `margin` tokens before
  the prompt's end), every stage copies the request's state slot into a snapshot slot after that step
  (`Plan.snapshots`). Once the step's result is back, the cache keeps (those tokens, their blocks, the snapshot).
- A later request whose prompt starts with those tokens and goes on for at least two more takes the blocks
  (shared), has the snapshot copied into its own slot before its first step (`SeqEntry.restore`), and its prefill
  starts there: only its new tokens are computed.

Why the margin: a chat's next turn renders the same history, but the generation prompt that ends this turn's prompt
(`<|im_start|>assistant\\n<think>\\n`) is often not how the template renders the finished answer in the next one; a
snapshot a few tokens before the end is still a prefix of the next turn.

Snapshot slots are state slots beyond the running requests' (`ClusterConfig.prefix_cache_states` of them); entries
are evicted least recently used when a snapshot slot is wanted or KV blocks run short (before any running request
is preempted). An entry a request is about to restore from is not evicted. Pure bookkeeping: the scheduler decides
when, the stages copy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from shared.block_manager import BlockManager


def agreeing_blocks(a: list[int], b: list[int], block: int, at_least: int = 0) -> int:
    """The largest multiple of `block` up to which `a` and `b` agree, if it is more than `at_least` (else
    `at_least`): a block-wise check first, then a binary search over list slices (C compares, no Python loop)."""
    lo, hi = at_least, min(len(a), len(b)) // block * block
    if hi <= lo or a[lo:lo + block] != b[lo:lo + block] or a[:lo] != b[:lo]:
        return at_least
    lo += block
    while lo < hi:                                               # the largest agreeing boundary in (lo, hi]
        mid = (lo + hi + block) // (2 * block) * block
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - block
    return lo


@dataclass
class CachedPrefix:
    tokens: list[int]            # the prefix (a whole number of blocks)
    blocks: list[int]            # their KV blocks, held once by the cache
    state: int                   # the snapshot slot holding every stage's per-sequence state after `tokens`
    last_used: int = 0
    users: int = 0               # requests admitted on it whose first step has not come back: not evictable

    @property
    def length(self) -> int:
        return len(self.tokens)


class PrefixCache:
    def __init__(self, blocks: BlockManager, block_size: int, states: list[int], margin: int = 8) -> None:
        self.blocks, self.block_size, self.margin = blocks, block_size, margin
        self.num_states = len(states)
        self._free_states = list(reversed(states))
        self.entries: list[CachedPrefix] = []
        self._clock = itertools.count(1)
        self.queries = 0             # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0                # of those, tokens served from the cache (prefix_cache_hits)

    # ---- lookups -----------------------------------------------------------------------------------------------
    def match(self, ids: list[int], count: bool = True) -> CachedPrefix | None:
        """The longest entry that `ids` starts with and that leaves at least two tokens to compute (a restoring
        step is never decode-shaped, and the last token is fed to sample from). Counts the query (unless not
        `count`: a preempted request admitted again, whose prompt was counted at its first admission)."""
        self.queries += len(ids) if count else 0
        best = None
        for e in self.entries:
            n = e.length
            if n + 2 > len(ids) or (best is not None and n <= best.length):
                continue
            if ids[n - 1] == e.tokens[-1] and ids[0] == e.tokens[0] and ids[:n] == e.tokens:
                best = e
        if best is not None:
            best.last_used = next(self._clock)
            self.hits += best.length if count else 0
        return best

    def shared_length(self, ids: list[int]) -> int:
        """The longest block boundary up to which `ids` agrees with some entry, whether or not that entry's whole
        prefix matches: where two prompts part (two conversations with one system prompt)."""
        best = 0
        for e in self.entries:
            best = max(best, agreeing_blocks(ids, e.tokens, self.block_size, best))
        return best

    def snapshot_positions(self, ids: list[int], start: int) -> list[int]:
        """Where a request whose prompt is `ids` and whose prefill starts at `start` saves its state: the last block
        boundary `margin` tokens or more before the prompt's end (the next turn of its conversation), and where it
        parts from the cached prefixes it shares a first part with (the next conversation that shares that part)."""
        if self.num_states == 0:
            return []
        last = (len(ids) - self.margin) // self.block_size * self.block_size
        return sorted({p for p in (self.shared_length(ids), last) if start < p <= last})

    # ---- entries -----------------------------------------------------------------------------------------------
    def reserve_state(self) -> int | None:
        """A free snapshot slot, evicting the least recently used entry if none is free; None if every entry is
        about to be restored from."""
        if not self._free_states and not self.evict_one():
            return None
        return self._free_states.pop()

    def unreserve(self, state: int) -> None:
        """A reserved slot whose snapshot never happened (its step was dropped)."""
        self._free_states.append(state)

    def add(self, tokens: list[int], blocks: list[int], state: int) -> None:
        """Keep a snapshot taken after `tokens` (the blocks get one more holder: the cache). The same tokens twice
        keep the older entry, and the new slot goes back."""
        assert len(tokens) % self.block_size == 0 and len(blocks) == len(tokens) // self.block_size
        for e in self.entries:
            if e.length == len(tokens) and e.tokens == tokens:
                e.last_used = next(self._clock)
                self._free_states.append(state)
                return
        self.blocks.share(blocks)
        self.entries.append(CachedPrefix(tokens, list(blocks), state, next(self._clock)))

    def evict_one(self, for_blocks: bool = False) -> bool:
        """Drop the least recently used entry nobody is about to restore from; False if there is none. With
        `for_blocks`, only an entry that frees a block (one no request and no other entry holds): dropping one whose
        blocks running requests share (a common system prompt) frees nothing and loses the prefix."""
        free = [e for e in self.entries if e.users == 0 and
                (not for_blocks or any(self.blocks.refcount(b) == 1 for b in e.blocks))]
        if not free:
            return False
        victim = min(free, key=lambda e: e.last_used)
        self.entries.remove(victim)
        self.blocks.release(victim.blocks)
        self._free_states.append(victim.state)
        return True

    def discard(self, entry: CachedPrefix) -> None:
        """Drop `entry` now (a step that restored it failed), unless a request is still about to restore it."""
        if entry.users == 0 and any(e is entry for e in self.entries):
            self.entries = [e for e in self.entries if e is not entry]
            self.blocks.release(entry.blocks)
            self._free_states.append(entry.state)

    def clear(self) -> None:
        """A stage restarted with empty caches (or every request was failed): no snapshot can be trusted."""
        for e in self.entries:
            self.blocks.release(e.blocks)
            self._free_states.append(e.state)
        self.entries.clear()

    @property
    def idle_blocks(self) -> int:
        """Blocks only the cache holds: free for the taking (an eviction away), as vLLM counts its cached blocks."""
        held: dict[int, int] = {}
        for e in self.entries:
            for b in e.blocks:
                held[b] = held.get(b, 0) + 1
        return sum(1 for b, n in held.items() if self.blocks.refcount(b) == n)

    @property
    def cached_blocks(self) -> int:
        """Distinct blocks the cache holds (entries share their common prefixes' blocks; running requests may
        hold them too)."""
        return len({b for e in self.entries for b in e.blocks})
