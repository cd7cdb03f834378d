"""KV memory: where every block of the paged KV pool is, and why. One concept per file:

* ``allocator``: free list, ref counts, LRU pool of unreferenced cached blocks;
* ``prefix_trie``: token-exact trie of full blocks (prefix caching), ``cache_salt`` roots;
* ``kv_events``: the prefix cache's changes as vLLM's KV-cache events (for routers);
* ``block_tables``: the block-table matrix (the only copy; a request holds a row);
* ``reservation``: the policy protocol and ``paged``; ``max_len``: the contiguous-cache policy;
* ``stats``: counters, snapshot, utilisation, event log, ``explain_prefix``;
* ``invariants``: the bookkeeping recomputed from scratch (tests);
* ``manager``: ``KVCacheManager``, the facade the scheduler talks to;
* ``errors``: what can go wrong.
"""

from jaxpaged.config import check_block_size
from jaxpaged.kv.allocator import BlockAllocator
from jaxpaged.kv.block_tables import BlockTables
from jaxpaged.kv.errors import BlockStateError, DoubleFreeError, OutOfBlocksError, RequestTooLargeError
from jaxpaged.kv.manager import KVCacheManager
from jaxpaged.kv.max_len import ContiguousReserver, MaxLenReservation, max_len_run_length
from jaxpaged.kv.prefix_trie import PrefixTrie, TrieNode
from jaxpaged.kv.reservation import PagedReservation, ReservationPolicy
from jaxpaged.kv.stats import EventLog, KVCounters, KVEvent, KVStats, PrefixDivergence, explain_prefix

__all__ = [
    "BlockAllocator", "BlockStateError", "BlockTables", "ContiguousReserver", "DoubleFreeError",
    "EventLog", "KVCacheManager", "KVCounters", "KVEvent", "KVStats", "MaxLenReservation", "OutOfBlocksError",
    "PagedReservation", "PrefixDivergence", "PrefixTrie", "RequestTooLargeError", "ReservationPolicy",
    "TrieNode", "check_block_size", "explain_prefix", "max_len_run_length",
]
