"""KV blocks and recurrent-state slots: who owns which, behind methods.

The engine core places every cache entry: stages only allocate the pools and follow the block tables and slots in
each plan. Blocks carry reference counts so that requests can share a prefix's blocks (prefix caching): a block
returns to the free list when its last holder lets go. Slots hold one request's DeltaNet and n-gram state and are
never shared.
"""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """More blocks were asked for than are free (callers check `can_allocate` first)."""


class BlockManager:
    def __init__(self, num_blocks: int, num_slots: int) -> None:
        self.num_blocks, self.num_slots = num_blocks, num_slots
        self._free_blocks = list(range(num_blocks - 1, -1, -1))    # popped from the end: low ids first
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._refs = [0] * num_blocks

    # ---- blocks --------------------------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free_blocks)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free_blocks)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks, each held once."""
        if n > len(self._free_blocks):
            raise OutOfBlocks(f"{n} KV blocks asked for, {len(self._free_blocks)} free")
        out = [self._free_blocks.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of `blocks` (already allocated)."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        """One holder fewer for each of `blocks`; those nobody holds any more are free again (in reverse, so the
        next allocation reuses the most recently freed first)."""
        for b in reversed(blocks):
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is released more often than it was held")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free_blocks.append(b)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    # ---- slots ---------------------------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free_slots)

    def allocate_slot(self) -> int:
        if not self._free_slots:
            raise OutOfBlocks("no free state slot")
        return self._free_slots.pop()

    def release_slot(self, slot: int) -> None:
        if slot in self._free_slots or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not in use")
        self._free_slots.append(slot)
