"""Token-exact prefix trie over *full* KV blocks: the index of block-level prefix caching.

A node is one full block: its key is the exact tuple of its ``block_size`` token ids, and it sits under
the node of the block before it, so the path from the root spells the whole prefix. A hit is therefore
always a true prefix: there is no content hash to collide, and a block's K/V (which depends on every
token before it) is only ever reused after exactly the same tokens. Each node records where those K/V
live: a physical block of the device pool (``block_id``), a slot of the host tier (``host_slot``,
``kv/host_tier.py``), or both; a node always lives in at least one.

An optional ``cache_salt`` (e.g. a tenant id) selects a separate root, so requests with different
salts never share blocks. Only full blocks enter the trie; a partially filled last block never does.

The trie does not own memory: the ``BlockAllocator`` (device) and the ``HostBlockPool`` (host) decide
when a cached block is reclaimed; the reservation policy then moves the node to the other tier
(``drop_gpu`` / ``drop_host``) or removes it with its subtree (``remove``).

With a ``KVEventRecorder`` (KV-cache events on), every change of where a node lives is recorded as vLLM's
``BlockStored`` / ``BlockRemoved`` of that tier, and each node carries the hash that names it in them
(``kv/kv_events.py``).
"""

from __future__ import annotations

from typing import Hashable, Sequence as SequenceT

from jaxpaged.config import check_block_size
from jaxpaged.kv.kv_events import MEDIUM_CPU, MEDIUM_GPU, KVEventRecorder, block_hash, root_hash


class TrieNode:
    """One cached full block (or, with ``parent is None``, the root of one salt's subtree).

    ``key`` is the block's tuple of token ids; for a root it is the root's cache salt. ``block_id``: the
    device pool's block holding its K/V (-1: not on the device); ``host_slot``: the host tier's slot
    holding a copy (-1: none). ``hash``: its name in KV-cache events (0 when they are off; for a root,
    its salt's seed).
    """

    __slots__ = ("key", "block_id", "host_slot", "parent", "children", "alive", "hash")

    def __init__(self, key: Hashable, block_id: int, parent: TrieNode | None) -> None:
        self.key = key
        self.block_id = block_id
        self.host_slot = -1
        self.parent = parent
        self.children: dict[tuple[int, ...], TrieNode] = {}
        self.alive = True  # False once evicted or detached: a stale cursor must not be followed
        self.hash = 0

    @property
    def tier(self) -> str:
        """Where the block's K/V live: ``"device"`` (the pool, on the GPU or whatever device runs the
        engine), ``"host"`` (the host tier) or ``"device+host"``."""
        return {(True, False): "device", (False, True): "host", (True, True): "device+host"}[
            (self.block_id >= 0, self.host_slot >= 0)]

    def __repr__(self) -> str:
        return f"TrieNode(block_id={self.block_id}, host_slot={self.host_slot}, children={len(self.children)})"


def _as_list(tokens: SequenceT[int]) -> list[int]:
    return tokens.tolist() if hasattr(tokens, "tolist") else tokens  # numpy -> python ints


class PrefixTrie:
    """Maps token prefixes (whole blocks at a time) to the physical blocks that hold their K/V."""

    def __init__(self, block_size: int, events: KVEventRecorder | None = None) -> None:
        self.block_size = check_block_size(block_size)
        self.events = events
        self._roots: dict[Hashable, TrieNode] = {}
        self._nodes: dict[int, TrieNode] = {}  # device block id -> node
        self._host_nodes: dict[int, TrieNode] = {}  # host slot -> node

    def __len__(self) -> int:
        """Device blocks the trie holds."""
        return len(self._nodes)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._nodes

    def block_ids(self) -> list[int]:
        """Device blocks the trie holds."""
        return list(self._nodes)

    def host_slots(self) -> list[int]:
        """Host-tier slots the trie holds."""
        return list(self._host_nodes)

    def node(self, block_id: int) -> TrieNode:
        return self._nodes[block_id]

    def walk(self):
        """Every node below the roots, depth first (O(nodes): for invariant checks)."""
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def host_node(self, slot: int) -> TrieNode:
        return self._host_nodes[slot]

    def _root(self, cache_salt: Hashable, create: bool) -> TrieNode | None:
        root = self._roots.get(cache_salt)
        if root is None and create:
            # A root's key holds its salt, so an emptied root can be dropped in O(1).
            root = self._roots[cache_salt] = TrieNode(cache_salt, -1, None)
            if self.events is not None:
                root.hash = root_hash(cache_salt)
        return root

    def _stored(self, node: TrieNode, medium: str) -> None:
        parent = node.parent
        self.events.stored(node.hash, parent.hash if parent.parent is not None else None, node.key, medium)

    def _removed(self, node: TrieNode) -> None:
        """Records that ``node`` left the trie: removed from each tier it lived in."""
        if node.block_id >= 0:
            self.events.removed(node.hash, MEDIUM_GPU)
        if node.host_slot >= 0:
            self.events.removed(node.hash, MEDIUM_CPU)

    # ---- lookup --------------------------------------------------------------------------------
    def longest_prefix(self, tokens: SequenceT[int], cache_salt: Hashable = None) -> list[TrieNode]:
        """Nodes of the longest cached run of full blocks of ``tokens`` (in either tier) that leaves at
        least one token to compute, root side first.

        A prompt of exactly ``k`` full blocks matches at most ``k - 1``: the model still needs logits
        for the last prompt token, so at least that token's K/V must be computed.
        """
        return self.path(tokens, cache_salt, max_blocks=(len(tokens) - 1) // self.block_size)

    def path(self, tokens: SequenceT[int], cache_salt: Hashable = None, max_blocks: int | None = None) -> list[TrieNode]:
        """Nodes of the cached full blocks of ``tokens`` from the first on, up to ``max_blocks``."""
        bs = self.block_size
        if max_blocks is None:
            max_blocks = len(tokens) // bs
        node = self._roots.get(cache_salt)
        if node is None or max_blocks <= 0:
            return []
        tokens = _as_list(tokens)
        hits: list[TrieNode] = []
        for i in range(max_blocks):
            child = node.children.get(tuple(tokens[i * bs : (i + 1) * bs]))
            if child is None:
                break
            hits.append(child)
            node = child
        return hits

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
        node reached after ``start_block`` blocks by an earlier insert, so a growing sequence inserts
        each new block in O(1) instead of re-walking its prefix. A dead or missing cursor restarts
        from the root. If a node for a block's tokens already exists (another request computed the
        same prefix at the same time), that node is kept and followed; the duplicate block is not
        cached and will simply be freed by its owner, unless the node lives on the host tier only:
        then the freshly computed block becomes its device copy.

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
            if child is None or child.block_id < 0:
                block_id = int(block_ids[i])
                if block_id in self._nodes:
                    raise ValueError(
                        f"block {block_id} is already cached under a different prefix; a block "
                        "table must not reuse a cached block for other tokens"
                    )
                if child is None:
                    child = node.children[key] = TrieNode(key, block_id, node)
                    if self.events is not None:
                        child.hash = block_hash(node.hash, key)
                else:
                    child.block_id = block_id
                self._nodes[block_id] = child
                new.append(block_id)
                if self.events is not None:
                    self._stored(child, MEDIUM_GPU)
            node = child
        return new, node

    # ---- tiers ---------------------------------------------------------------------------------
    def attach_gpu(self, node: TrieNode, block_id: int) -> None:
        """A host-only node's K/V now (also) live in device block ``block_id`` (a reload)."""
        if node.block_id >= 0 or block_id in self._nodes:
            raise ValueError(f"cannot attach block {block_id} to {node!r}")
        node.block_id = block_id
        self._nodes[block_id] = node
        if self.events is not None:
            self._stored(node, MEDIUM_GPU)

    def drop_gpu(self, block_id: int) -> TrieNode:
        """The device block of a node that also has a host copy is reclaimed: the node stays, host only."""
        node = self._nodes.pop(block_id)
        if node.host_slot < 0:
            raise ValueError(f"block {block_id} has no host copy: remove its node instead")
        node.block_id = -1
        if self.events is not None:
            self.events.removed(node.hash, MEDIUM_GPU)
        return node

    def set_host(self, node: TrieNode, slot: int) -> None:
        """Host slot ``slot`` now holds a copy of ``node``'s K/V (an offload)."""
        if node.host_slot >= 0 or slot in self._host_nodes:
            raise ValueError(f"cannot give host slot {slot} to {node!r}")
        node.host_slot = slot
        self._host_nodes[slot] = node
        if self.events is not None:
            self._stored(node, MEDIUM_CPU)

    def drop_host(self, slot: int) -> TrieNode:
        """The host copy of a node that also lives on the device is reclaimed: the node stays."""
        node = self._host_nodes.pop(slot)
        if node.block_id < 0:
            raise ValueError(f"host slot {slot} is its node's only copy: remove the node instead")
        node.host_slot = -1
        if self.events is not None:
            self.events.removed(node.hash, MEDIUM_CPU)
        return node

    def remove(self, node: TrieNode) -> list[TrieNode]:
        """Removes ``node`` and its subtree (no longer reachable from the root); returns the removed
        descendants (not ``node``), whose device blocks and host slots the caller releases."""
        if self.events is not None:
            self._removed(node)
        for index, key in ((self._nodes, node.block_id), (self._host_nodes, node.host_slot)):
            if key >= 0:
                del index[key]
        parent = node.parent
        del parent.children[node.key]
        node.alive = False
        if parent.parent is None and not parent.children:  # empty salt root: drop it
            del self._roots[parent.key]
            parent.alive = False
        removed: list[TrieNode] = []
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            child.alive = False
            if self.events is not None:
                self._removed(child)
            if child.block_id >= 0:
                del self._nodes[child.block_id]
            if child.host_slot >= 0:
                del self._host_nodes[child.host_slot]
            removed.append(child)
            stack.extend(child.children.values())
        node.children.clear()
        return removed
