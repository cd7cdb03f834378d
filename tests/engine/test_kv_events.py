"""KV-cache events end to end: an engine publishes its prefix cache's changes on a ZeroMQ socket in vLLM's
format; a subscriber that knows only that format rebuilds exactly which prefixes the engine holds in each
tier (device pool "GPU", host tier "CPU"), through evictions and offloads; the replay socket returns the
same batches; a full queue drops batches (counted) instead of blocking the engine."""

from __future__ import annotations

import functools
import socket
import time

import numpy as np
import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from jaxpaged import EngineConfig, LLMEngine, SamplingParams, load_params  # noqa: E402
from jaxpaged.config import KVEventsConfig  # noqa: E402
from jaxpaged.engine.kv_events import ZmqEventPublisher, offset_endpoint_port  # noqa: E402
from jaxpaged.kv.kv_events import BlockStored  # noqa: E402
from jaxpaged.llm import run_to_completion  # noqa: E402
from jaxpaged.models.tiny import tiny_checkpoint_path  # noqa: E402


# ---- the subscriber's side: vLLM's structs, written from its documented format (nothing of jaxpaged) ----------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredMsg(Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemovedMsg(Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class AllBlocksClearedMsg(Event, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStoredMsg | BlockRemovedMsg | AllBlocksClearedMsg]


DECODE = msgspec.msgpack.Decoder(KVEventBatch).decode


class CacheView:
    """What a router knows of one engine: per medium, the prefixes (token tuples) it holds."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int, tuple[int, ...]]] = {}  # hash -> (parent hash or 0, block tokens)
        self.held: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
        self.removed = {"GPU": 0, "CPU": 0}

    def apply(self, batch: KVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, BlockStoredMsg):
                parent = e.parent_block_hash or 0
                for i, h in enumerate(e.block_hashes):
                    tokens = tuple(e.token_ids[i * e.block_size:(i + 1) * e.block_size])
                    assert len(tokens) == e.block_size
                    self.blocks[h] = (parent, tokens)
                    self.held[e.medium].add(h)
                    parent = h
            elif isinstance(e, BlockRemovedMsg):
                for h in e.block_hashes:
                    self.held[e.medium].remove(h)  # (a block removed that was never stored fails here)
                    self.removed[e.medium] += 1
            else:
                for held in self.held.values():
                    held.clear()

    def prefixes(self, medium: str) -> set[tuple[int, ...]]:
        out = set()
        for h in self.held[medium]:
            tokens: tuple[int, ...] = ()
            while h:
                h, block = self.blocks[h]
                tokens = block + tokens
            out.add(tokens)
        return out


def engine_prefixes(trie) -> dict[str, set[tuple[int, ...]]]:
    """The prefixes the engine's trie holds in each tier, from its nodes."""
    out: dict[str, set[tuple[int, ...]]] = {"GPU": set(), "CPU": set()}
    for node in trie.walk():
        tokens, n = (), node
        while n.parent is not None:
            tokens, n = n.key + tokens, n.parent
        if node.block_id >= 0:
            out["GPU"].add(tokens)
        if node.host_slot >= 0:
            out["CPU"].add(tokens)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def params():
    return load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)


RNG = np.random.default_rng(7)
PREFIXES = [[int(t) for t in RNG.integers(1, 500, 48)] for _ in range(4)]
PROMPTS = [p + [int(t) for t in RNG.integers(1, 500, 5)] for p in PREFIXES for _ in range(2)]
SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def receive(sub, until_seq: int, timeout: float = 10.0) -> dict[int, bytes]:
    got: dict[int, bytes] = {}
    deadline = time.time() + timeout
    while until_seq not in got and time.time() < deadline:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@pod-0@tiny"
            got[int.from_bytes(seq, "big")] = payload
    return got


def replay(ctx, endpoint: str, start: int) -> dict[int, bytes]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        got = {}
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                return got
            got[seq] = payload
    finally:
        dealer.close(linger=0)


def test_a_subscriber_rebuilds_the_engines_prefix_cache_from_its_events():
    """Eight requests on four 48-token prefixes, twice, through a 12-block pool with a small host tier:
    blocks are stored, evicted, offloaded and reloaded. After every round the subscriber's view (from the
    PUB socket, gaps filled by the replay socket) equals the trie, tier by tier."""
    port, replay_port = free_port(), free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}",
                            replay_endpoint=f"tcp://*:{replay_port}", topic="kv@pod-0@tiny")
    eng = LLMEngine(params(), EngineConfig(block_size=16, num_blocks=12, max_model_len=96, max_num_batched_tokens=128,
                                           kv_offloading_size=4 * 24_576 / 2**30, kv_events_config=config))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    view, applied = CacheView(), 0
    try:
        for _ in range(2):
            run_to_completion(eng, PROMPTS, SP)
            pub, deadline = eng.kv_event_publisher, time.time() + 10
            while pub.published_batches < pub.num_batches:  # (every batch so far sent)
                assert time.time() < deadline
                time.sleep(0.01)
            last = pub.num_batches - 1
            got = receive(sub, last)
            missing = [s for s in range(applied, last + 1) if s not in got]  # (the slow joiner's first batches)
            if missing:
                got.update(replay(ctx, f"tcp://127.0.0.1:{replay_port}", missing[0]))
            for seq in range(applied, last + 1):
                batch = DECODE(got[seq])
                assert batch.data_parallel_rank == 0 and batch.ts > 0
                view.apply(batch)
            applied = last + 1
            truth = engine_prefixes(eng.kv.trie)
            assert view.prefixes("GPU") == truth["GPU"] and view.prefixes("CPU") == truth["CPU"]
        s = eng.stats()
        assert s["evictions"] > 0 and s["blocks_offloaded"] > 0 and s["blocks_reloaded"] > 0
        assert view.removed["GPU"] > 0 and view.held["CPU"]  # evictions and offloads were followed
        assert eng.stats()["kv_events_dropped_batches"] == 0
        # The replay socket holds every batch: the same bytes the PUB socket sent.
        again = replay(ctx, f"tcp://127.0.0.1:{replay_port}", 0)
        assert sorted(again) == list(range(applied))
        assert all(again[s] == got[s] for s in got)
    finally:
        sub.close(linger=0)
        eng.close()
    assert not eng.kv_event_publisher._thread.is_alive()


def test_the_wire_format_is_vllms():
    """A ``BlockStored`` is a tagged array with vLLM's fields in vLLM's order; hashes chain by parent."""
    from jaxpaged.engine.kv_events import to_wire
    from jaxpaged.kv.kv_events import BlockRemoved

    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(to_wire(1.5, [
        BlockStored([11, 12], None, list(range(4)), 2), BlockRemoved([11], "CPU")], 3)))
    assert raw == [1.5, [["BlockStored", [11, 12], None, [0, 1, 2, 3], 2, None, "GPU", None],
                         ["BlockRemoved", [11], "CPU"]], 3]


def test_a_full_queue_drops_batches_and_counts_them_without_blocking():
    port = free_port()
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                           endpoint=f"tcp://127.0.0.1:{port}".replace("127.0.0.1", "*"),
                                           max_queue_size=1))
    pub.shutdown()  # (nothing takes from the queue any more: the second batch finds it full)
    t0 = time.perf_counter()
    pub.publish([BlockStored([1], None, [0, 0], 2)])
    pub.publish([BlockStored([2], 1, [0, 1], 2), BlockStored([3], 2, [1, 1], 2)])
    assert time.perf_counter() - t0 < 0.5
    assert pub.stats()["kv_events_dropped_batches"] == 1 and pub.stats()["kv_events_dropped_events"] == 2


def test_kv_events_config_is_vllms_and_checked():
    cfg = EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "publisher": "zmq", '
                                        '"endpoint": "tcp://*:5557", "topic": "kv-events"}')
    assert cfg.kv_events_config == KVEventsConfig(True, "zmq", "tcp://*:5557", topic="kv-events")
    assert cfg.kv_events_config.enabled and not KVEventsConfig(True, "null").enabled
    with pytest.raises(ValueError, match="unknown field 'endpont'"):
        EngineConfig(kv_events_config={"endpont": "tcp://*:1"})
    with pytest.raises(ValueError, match="kv_events_config.publisher"):
        KVEventsConfig(publisher="kafka")
    with pytest.raises(ValueError, match="kv_events_config.max_queue_size"):
        KVEventsConfig(max_queue_size=0)
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig(kv_events_config="{enable")
    from jaxpaged.__main__ import build_parser, serve_llm_args

    kwargs = serve_llm_args(build_parser().parse_args(
        ["serve", "tiny", "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq"}']))
    assert EngineConfig.from_kwargs(**{k: v for k, v in kwargs.items() if k not in ("model", "dtype", "load_format")}
                                    ).kv_events_config == KVEventsConfig(True, "zmq")
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def test_the_tries_events_chain_their_hashes_and_keep_salts_apart():
    from jaxpaged.kv import PrefixTrie
    from jaxpaged.kv.kv_events import BlockRemoved, KVEventRecorder, block_hash

    trie = PrefixTrie(2, KVEventRecorder(2))
    trie.insert([1, 2, 3, 4, 5], [0, 1, 9])
    trie.insert([1, 2, 3, 4], [2, 3], cache_salt="tenant-a")
    plain, salted = trie.events.take()
    first = block_hash(0, (1, 2))
    assert plain == BlockStored([first, block_hash(first, (3, 4))], None, [1, 2, 3, 4], 2)
    assert salted.parent_block_hash is None and not set(salted.block_hashes) & set(plain.block_hashes)
    trie.insert([1, 2, 7, 7], [0, 4], start_block=1, parent=trie.node(0))  # a sibling under block 0
    assert trie.events.take() == [BlockStored([block_hash(first, (7, 7))], first, [7, 7], 2)]
    trie.remove(trie.node(0))
    (removed,) = trie.events.take()
    assert type(removed) is BlockRemoved and sorted(removed.block_hashes) == sorted(
        [first, block_hash(first, (3, 4)), block_hash(first, (7, 7))])
