"""The host tier's bookkeeping: slots of host memory that hold evicted cached blocks, and the copies due.

With ``EngineConfig(kv_offloading_size=GiB)`` the prefix cache has a second tier under the device
pool. A slot holds one device block's K/V for every layer, contiguously (one copy per block). The
policy (``kv/reservation.py``) is *write-back on eviction*: when the device pool's LRU reclaims a
cached block that has no host copy yet, the block is copied to a host slot and its trie node stays
findable there; a later prefix hit on it allocates a device block and copies it back (a reload)
instead of recomputing it. A reloaded block keeps its host copy, so evicting it again copies nothing.

Slots are a free list, an LRU of the unpinned used ones (evicted least recently used first when the
tier is full) and a pinned set (the sources of the reloads an admission is queueing, which its own
evictions must not reclaim). Every operation is O(1).

Copies are not made here: ``Transfer`` records, in the order the bookkeeping decided them, what the
device side (``engine/kv_transfer.py``) must copy before the next step runs.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from typing import Callable, NamedTuple

from jaxpaged.kv.errors import BlockStateError


class Transfer(NamedTuple):
    """One block copy between the tiers: ``offload`` (device ``block_id`` -> host ``slot``) or
    ``reload`` (host ``slot`` -> device ``block_id``)."""

    kind: str
    block_id: int
    slot: int


@dataclasses.dataclass(frozen=True)
class ReloadCost:
    """What a host-tier hit costs either way, measured on the device at warm-up: copying ``n`` blocks back
    takes ``fixed_seconds + n * seconds_per_block``; computing their tokens again takes ``n * block_size
    * recompute_seconds_per_token``. A hit is reloaded only where the copy is the cheaper, so the tier
    never makes a request slower than no tier would (small models prefill a block faster than a PCIe
    copy moves it)."""

    seconds_per_block: float
    fixed_seconds: float
    recompute_seconds_per_token: float
    block_size: int

    def worth_reloading(self, num_blocks: int) -> bool:
        """Whether copying ``num_blocks`` blocks back beats computing their tokens again."""
        return (self.fixed_seconds + num_blocks * self.seconds_per_block
                < num_blocks * self.block_size * self.recompute_seconds_per_token)

    @property
    def ever_worth_reloading(self) -> bool:
        """Whether a long enough run of blocks is worth reloading (else offloading is wasted work)."""
        return self.seconds_per_block < self.block_size * self.recompute_seconds_per_token


class HostBlockPool:
    """Slots ``0 .. num_slots - 1`` of the host tier.

    ``on_evict(slot)`` is called when ``allocate`` reclaims the least recently used unpinned slot,
    before handing it out again (the policy drops or removes the slot's trie node).
    """

    def __init__(self, num_slots: int, on_evict: Callable[[int], None] | None = None) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots must be an int >= 0, got {num_slots!r}")
        self.num_slots = num_slots
        self.on_evict = on_evict
        self._free: deque[int] = deque(range(num_slots))
        self._lru: OrderedDict[int, None] = OrderedDict()  # used, unpinned; least recently used first
        self._pinned: set[int] = set()
        self.num_evictions = 0

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def used_slots(self) -> set[int]:
        """Slots holding a block (pinned or not): for invariant checks."""
        return set(self._lru) | self._pinned

    def allocate(self) -> int | None:
        """A slot for a new copy: a free one, else the least recently used unpinned one (``on_evict``
        first). ``None`` if every slot is pinned (or there are none): the caller does without."""
        if self._free:
            slot = self._free.popleft()
        elif self._lru:
            slot, _ = self._lru.popitem(last=False)
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(slot)
        else:
            return None
        self._lru[slot] = None
        return slot

    def touch(self, slot: int) -> None:
        """Marks a used slot most recently used."""
        self._lru.move_to_end(slot)

    def pin(self, slot: int) -> None:
        """Keeps ``slot`` from eviction (until ``unpin``)."""
        del self._lru[slot]
        self._pinned.add(slot)

    def unpin(self, slot: int) -> None:
        """Makes ``slot`` evictable again, as the most recently used."""
        self._pinned.remove(slot)
        self._lru[slot] = None

    def release(self, slot: int) -> None:
        """``slot`` holds nothing findable any more (its node was removed): back to the free list."""
        if slot in self._lru:
            del self._lru[slot]
        elif slot in self._pinned:
            self._pinned.remove(slot)
        else:
            raise BlockStateError(f"host slot {slot} released but not in use")
        self._free.append(slot)
