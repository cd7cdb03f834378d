"""KV-cache events: the prefix cache's changes as vLLM reports them (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), so a router that follows vLLM's events (llm-d's prefix-cache scorer) follows ours.

The prefix trie records one event for each change of where a cached block lives: a block that becomes
findable in a tier is *stored* there, one that stops being findable there is *removed*. The tiers are
vLLM's media: ``"GPU"`` for the device pool (whatever device runs the engine) and ``"CPU"`` for the host
tier. Nothing here sends anything: ``engine/kv_events.py`` takes each step's events and publishes them.

Block hashes. vLLM names a block by a hash of (its parent block's hash, its tokens, extra keys); the trie
needs none (it is token-exact), so a hash is derived for events only, the same way: 63 bits of BLAKE2b
over the parent's hash and the block's token ids (the first block's parent is the ``cache_salt``'s seed).
Equal prefixes under equal salts get equal hashes in every process and on every replica; a hash is never 0
(llm-d reads 0 as "no parent"). A collision could only make a router's guess wrong, never a cache hit:
the trie still matches tokens exactly.
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from typing import Hashable

MEDIUM_GPU = "GPU"  # vLLM's name of the device pool's tier
MEDIUM_CPU = "CPU"  # vLLM's name of the host tier (its CPU offloading's)
_MASK = (1 << 63) - 1  # hashes fit a signed 64-bit integer too (every msgpack reader's int)


def root_hash(cache_salt: Hashable) -> int:
    """The seed a salt's first blocks chain from (0 for no salt: the first block has no parent)."""
    if cache_salt is None:
        return 0
    return int.from_bytes(hashlib.blake2b(repr(cache_salt).encode(), digest_size=8).digest(), "big") & _MASK or 1


def block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """The hash of a full block of ``token_ids`` after the block hashed ``parent_hash`` (0: the first)."""
    h = hashlib.blake2b(parent_hash.to_bytes(8, "big"), digest_size=8)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "big") & _MASK or 1


@dataclasses.dataclass(slots=True)
class BlockStored:
    """Blocks that became findable in ``medium``: a chain, each block the next one's parent.
    ``token_ids`` are all their tokens, ``block_size`` per block; ``parent_block_hash`` is the first
    block's parent (``None``: the first block of a prompt)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


@dataclasses.dataclass(slots=True)
class BlockRemoved:
    """Blocks that stopped being findable in ``medium`` (evicted, or moved to another tier)."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU


@dataclasses.dataclass(slots=True)
class AllBlocksCleared:
    """Nothing is cached any more (an engine that starts: whatever a router knew of it is gone)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventRecorder:
    """The events of the trie's changes since the last ``take``, in order. Consecutive stores of a chain
    in one tier are one ``BlockStored`` (as vLLM records one per request and step)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.events: list[KVCacheEvent] = []

    def stored(self, hash_: int, parent_hash: int | None, tokens: tuple[int, ...], medium: str) -> None:
        """Block ``hash_`` of ``tokens`` is findable in ``medium`` now (``parent_hash``: ``None`` for a
        prompt's first block)."""
        last = self.events[-1] if self.events else None
        if type(last) is BlockStored and last.medium == medium and parent_hash is not None \
                and last.block_hashes[-1] == parent_hash:
            last.block_hashes.append(hash_)
            last.token_ids.extend(tokens)
            return
        self.events.append(BlockStored([hash_], parent_hash, list(tokens), self.block_size, medium=medium))

    def removed(self, hash_: int, medium: str) -> None:
        last = self.events[-1] if self.events else None
        if type(last) is BlockRemoved and last.medium == medium:
            last.block_hashes.append(hash_)
        else:
            self.events.append(BlockRemoved([hash_], medium))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events
