"""The KV-cache events' publisher: each engine step's prefix-cache changes (``kv/kv_events.py``), sent on a
ZeroMQ PUB socket in vLLM's wire format, so llm-d's prefix-cache scorer (or any reader of vLLM's events)
routes by what this engine holds.

The wire format (vLLM's ``vllm/distributed/kv_events.py``): each message has three frames, the topic,
the batch's sequence number (8 bytes, big-endian) and the batch, msgpack-encoded as msgspec's
``array_like`` structs: a batch is ``[ts, [event, ...], data_parallel_rank]``; an event is a tagged array,
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]``,
``["BlockRemoved", block_hashes, medium]`` or ``["AllBlocksCleared"]``. An optional ROUTER socket
(``replay_endpoint``) replays kept batches: a request ``[b"", start_seq]`` (8 bytes, big-endian) is answered
with ``[b"", seq, batch]`` for every kept batch from ``start_seq`` on, then ``[b"", -1, b""]``.

Off the engine's path: ``publish`` only numbers the batch and puts it on a bounded queue (``put_nowait``);
a thread of its own converts, encodes and sends. A batch that finds the queue full is dropped and counted
(``dropped_batches``), never waited for: its sequence number is then missing from the stream, which tells a
subscriber its view is incomplete. ``zmq`` and ``msgspec`` are imported when a publisher is made
(``pip install 'jaxpaged[kv-events]'``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from collections import deque

from ..config import KVEventsConfig
from ..kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last message


@functools.cache
def wire_types():
    """vLLM's event structs in msgspec (made on first use: msgspec is an optional dependency).
    Returns ``(KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared)``."""
    import msgspec

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


def to_wire(ts: float, events: list[KVCacheEvent], data_parallel_rank: int | None):
    """A batch of ``kv.kv_events`` events as vLLM's ``KVEventBatch`` struct."""
    batch_type, stored_type, removed_type, cleared_type = wire_types()
    out = []
    for e in events:
        if type(e) is BlockStored:
            out.append(stored_type(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id,
                                   e.medium, e.lora_name))
        elif type(e) is BlockRemoved:
            out.append(removed_type(e.block_hashes, e.medium))
        elif type(e) is AllBlocksCleared:
            out.append(cleared_type())
        else:
            raise TypeError(f"not a KV-cache event: {e!r}")
    return batch_type(ts, out, data_parallel_rank)


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """``endpoint`` for data-parallel rank ``data_parallel_rank``, as vLLM numbers them: a tcp port plus the
    rank, an ``inproc``/``ipc`` name with ``_dp<rank>`` appended; rank 0 keeps it as given."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"kv_events_config.endpoint {endpoint!r} has no port to offset by the data-parallel rank")
        return f"{host}:{int(port) + data_parallel_rank}"
    raise ValueError(f"kv_events_config.endpoint must be tcp://, ipc:// or inproc://, got {endpoint!r}")


def _binds(endpoint: str) -> bool:
    """A stable address is bound, a remote one connected to (vLLM's rule)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes batches of KV-cache events on a ZeroMQ PUB socket from a thread of its own (module doc)."""

    SHUTDOWN_TIMEOUT = 2.0

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        self._topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = itertools.count()
        self.num_batches = 0  # handed to ``publish``: sent, dropped, or still queued
        self.dropped_batches = 0
        self.dropped_events = 0
        self.failed_batches = 0  # (counted by the publisher's thread; the two above by the engine's)
        self.published_batches = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            (self._pub.bind if _binds(self.endpoint) else self._pub.connect)(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as err:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {self.endpoint!r}"
                             f"{' / ' + repr(self.replay_endpoint) if self.replay_endpoint else ''}: {err}") from None
        self._thread = threading.Thread(target=self._run, name="jaxpaged-kv-events", daemon=True)
        self._thread.start()
        log.info("KV-cache events on %s%s", self.endpoint,
                 f" (replay on {self.replay_endpoint})" if self.replay_endpoint else "")

    # ---- the engine's side ---------------------------------------------------------------------------
    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queues one step's events (a batch); never blocks: a full queue drops the batch and counts it."""
        seq = next(self._seq)
        self.num_batches = seq + 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.dropped_batches += 1
            self.dropped_events += len(events)

    def stats(self) -> dict:
        return {"kv_events_published_batches": self.published_batches,
                "kv_events_dropped_batches": self.dropped_batches + self.failed_batches,
                "kv_events_dropped_events": self.dropped_events}

    def shutdown(self) -> None:
        """Sends what is queued (for up to ``SHUTDOWN_TIMEOUT`` seconds), then closes the sockets."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT)
        except queue.Full:
            pass
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT)

    # ---- the publisher's thread ----------------------------------------------------------------------
    def _run(self) -> None:
        import msgspec

        encode = msgspec.msgpack.Encoder().encode
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is None:
                    return
                seq, ts, events = item
                try:
                    payload = encode(to_wire(ts, events, self.data_parallel_rank))
                    seq_bytes = seq.to_bytes(8, "big")
                    self._pub.send_multipart((self._topic, seq_bytes, payload))
                except Exception:  # noqa: BLE001  (a batch lost, the engine unharmed)
                    log.exception("jaxpaged: a batch of KV-cache events could not be sent")
                    self.failed_batches += 1
                    continue
                self._buffer.append((seq, payload))
                self.published_batches += 1
        finally:
            self._close_sockets()

    def _serve_replay(self) -> None:
        try:
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("jaxpaged: a malformed KV-events replay request (%d frames) was ignored", len(frames))
                return
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))
        except Exception:  # noqa: BLE001  (a replay failed; publishing goes on)
            log.exception("jaxpaged: a KV-events replay request failed")

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=int(self.SHUTDOWN_TIMEOUT * 1000))


def make_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> ZmqEventPublisher | None:
    """The publisher ``config`` asks for, or ``None`` (events off, or the ``"null"`` publisher)."""
    if config is None or not config.enabled:
        return None
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as err:
        raise ValueError(f"kv_events_config: the zmq publisher needs pyzmq and msgspec: "
                         f"pip install 'jaxpaged[kv-events]' ({err})") from None
    return ZmqEventPublisher(config, data_parallel_rank)
