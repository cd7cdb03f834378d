"""Token-exact prefix trie over *full* KV blocks: the index of block-level prefix caching.

A node is one full block: its key is the exact tuple of its ``block_size`` token ids, and it sits under
the node of the block before it, so the path from the root spells the whole prefix. A hit is therefore
always a true prefix: there is no content hash to collide, and a block's K/V (which depends on every
token before it) is only ever reused after exactly the same tokens. Each node records the physical
block id that holds those K/V and when it was last used.

An optional ``cache_salt`` (e.g. a tenant id) selects a separate root, so requests with different
salts never share blocks. Only full blocks enter the trie; a partially filled last block never does.

The trie does not own memory: the ``BlockAllocator`` decides when an unreferenced cached block is
reclaimed and then calls ``evict(block_id)``.
"""

from __future__ import annotations

from typing import Hashable, Sequence as SequenceT

from jaxpaged.kv.allocator import check_block_size


class TrieNode:
    """One cached full block (or, with ``block_id == -1``, the root of one salt's subtree).

    ``key`` is the block's tuple of token ids; for a root it is the root's cache salt.
    """

    __slots__ = ("key", "block_id", "parent", "children", "alive")

    def __init__(self, key: Hashable, block_id: int, parent: TrieNode | None) -> None:
        self.key = key
        self.block_id = block_id
        self.parent = parent
        self.children: dict[tuple[int, ...], TrieNode] = {}
        self.alive = True  # False once evicted or detached: a stale cursor must not be followed

    def __repr__(self) -> str:
        return f"TrieNode(block_id={self.block_id}, children={len(self.children)})"


def _as_list(tokens: SequenceT[int]) -> list[int]:
    return tokens.tolist() if hasattr(tokens, "tolist") else tokens  # numpy -> python ints


class PrefixTrie:
    """Maps token prefixes (whole blocks at a time) to the physical blocks that hold their K/V."""

    def __init__(self, block_size: int) -> None:
        self.block_size = check_block_size(block_size)
        self._roots: dict[Hashable, TrieNode] = {}
        self._nodes: dict[int, TrieNode] = {}  # block id -> node

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._nodes

    def block_ids(self) -> list[int]:
        return list(self._nodes)

    def node(self, block_id: int) -> TrieNode:
        return self._nodes[block_id]

    def _root(self, cache_salt: Hashable, create: bool) -> TrieNode | None:
        root = self._roots.get(cache_salt)
        if root is None and create:
            # A root's key holds its salt, so an emptied root can be dropped in O(1).
            root = self._roots[cache_salt] = TrieNode(cache_salt, -1, None)
        return root

    # ---- lookup --------------------------------------------------------------------------------
    def longest_prefix(
        self, tokens: SequenceT[int], cache_salt: Hashable = None
    ) -> tuple[list[int], TrieNode | None]:
        """Longest cached run of full blocks of ``tokens`` that leaves at least one token to compute.

        Returns the physical block ids and the deepest matched node (``None`` if nothing matched).
        A prompt of exactly ``k`` full blocks matches at most ``k - 1``: the model still needs logits
        for the last prompt token, so at least that token's K/V must be computed.
        """
        bs = self.block_size
        max_blocks = (len(tokens) - 1) // bs
        node = self._roots.get(cache_salt)
        if node is None or max_blocks <= 0:
            return [], None
        tokens = _as_list(tokens)
        hits: list[int] = []
        for i in range(max_blocks):
            child = node.children.get(tuple(tokens[i * bs : (i + 1) * bs]))
            if child is None:
                break
            hits.append(child.block_id)
            node = child
        return hits, (node if hits else None)

    def match(self, tokens: SequenceT[int], cache_salt: Hashable = None) -> list[int]:
        """Physical block ids of the longest cached prefix of ``tokens`` (see ``longest_prefix``)."""
        return self.longest_prefix(tokens, cache_salt)[0]

    # ---- insertion -----------------------------------------------------------------------------
    def insert(
        self,
        tokens: SequenceT[int],
        block_ids: SequenceT[int],
        cache_salt: Hashable = None,
        *,
        num_blocks: int | None = None,
        start_block: int = 0,
        parent: TrieNode | None = None,
    ) -> tuple[list[int], TrieNode | None]:
        """Makes the first ``num_blocks`` full blocks of ``tokens`` findable.

        ``block_ids[i]`` is the physical block holding block ``i``'s K/V. ``parent`` is a cursor: the
        node reached after ``start_block`` blocks by an earlier call, so a growing sequence inserts
        each new block in O(1) instead of re-walking its prefix. A dead or missing cursor restarts
        from the root. If a node for a block's tokens already exists (another request computed the
        same prefix at the same time), that node is kept and followed; the duplicate block is not
        cached and will simply be freed by its owner.

        Returns the newly cached block ids (the caller marks them cached in the allocator) and the
        deepest node reached, to pass back as ``parent`` next time.
        """
        bs = self.block_size
        if num_blocks is None:
            num_blocks = len(tokens) // bs
        if num_blocks * bs > len(tokens) or num_blocks > len(block_ids):
            raise ValueError(
                f"cannot insert {num_blocks} full blocks from {len(tokens)} tokens and "
                f"{len(block_ids)} block ids (block_size={bs})"
            )
        if parent is None or not parent.alive or start_block <= 0:
            parent, start_block = None, 0
        if start_block >= num_blocks:
            return [], parent
        node = parent if parent is not None else self._root(cache_salt, create=True)
        tokens = _as_list(tokens)
        new: list[int] = []
        for i in range(start_block, num_blocks):
            key = tuple(tokens[i * bs : (i + 1) * bs])
            child = node.children.get(key)
            if child is None:
                block_id = int(block_ids[i])
                if block_id in self._nodes:
                    raise ValueError(
                        f"block {block_id} is already cached under a different prefix; a block "
                        "table must not reuse a cached block for other tokens"
                    )
                child = node.children[key] = TrieNode(key, block_id, node)
                self._nodes[block_id] = child
                new.append(block_id)
            node = child
        return new, node

    # ---- eviction ------------------------------------------------------------------------------
    def evict(self, block_id: int) -> list[int]:
        """Removes the node of an unreferenced block the allocator is reclaiming.

        Normally the node is a leaf (the allocator's LRU releases a sequence's deepest blocks first).
        If it still has children, they can no longer be reached from the root, so the whole subtree
        is detached and its block ids are returned for the allocator to uncache.
        """
        node = self._nodes.pop(block_id, None)
        if node is None:
            raise KeyError(f"block {block_id} is not in the prefix trie")
        parent = node.parent
        del parent.children[node.key]
        node.alive = False
        if parent.parent is None and not parent.children:  # empty salt root: drop it
            del self._roots[parent.key]
            parent.alive = False
        detached: list[int] = []
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            child.alive = False
            del self._nodes[child.block_id]
            detached.append(child.block_id)
            stack.extend(child.children.values())
        node.children.clear()
        return detached
