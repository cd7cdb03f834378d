"""One engine over several processes, one per host: ``jax.distributed``, and the leader's calls replayed.

Multi-controller JAX: each process runs its own copy of the program, and a computation over devices of
several processes runs only once every process has launched it, with the same inputs. The engine's host side
(scheduler, KV manager, step inputs) is a deterministic function of the calls it gets: scheduling counts
steps and tokens, never time, and a request without a seed draws it from the engine's generator
(``EngineConfig.seed``). So the processes are kept in step by making identical engine calls on every process's
engine: process 0, the leader (``LLM``, the server's engine process), sends each call that changes its
engine (``REPLAYED``) to the other processes before it runs it; each of them, a follower, runs it on its own
engine (``MultiProcessEngine.follow``). Every process then schedules the same steps, builds the same inputs
(host arrays passed to the step under a replicated sharding, the global value on every process) and
launches the same step; the sampled tokens come back replicated, so each reads its own copy. The outputs
that reach users are the leader's; a follower's are dropped.

What would make the replicas diverge is refused: structured outputs (a grammar compiles in a thread, and
whether it is ready decides a step) and the host tier (each process measures its own reload cost at
warm-up). Before a call runs, a follower compares its engine's state (``state_fingerprint``) with the
leader's, sent with the call, and stops with an error where they differ: diverged engines would launch
different computations and wait on each other forever. At start-up each follower compares its settings,
model and pool with the leader's (``engine_settings``); the pool's size is the smallest any process can
hold (``agreed_min``).

The channel is ``multiprocessing.connection`` (pickled calls, the connection authenticated by a shared key)
from the leader, listening on the coordinator's port + 1, to each follower: the calls travel on the host
network, never through a device, so a follower waiting for the next call holds no device.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from ..config import EngineConfig, split_host_port
from ..sampling import SamplingParams

AUTHKEY_ENV = "JAXPAGED_DISTRIBUTED_AUTHKEY"  # the channel's shared secret (required: the channel carries pickles)
CONNECT_SECONDS = 300.0  # how long a follower tries to reach the leader (jax.distributed's own start-up wait)
# The calls that change an engine (MultiProcessEngine replays them).
REPLAYED = ("add_request", "add_requests", "abort_request", "step", "warmup", "settle")


def initialize(config: EngineConfig) -> None:
    """``jax.distributed.initialize`` for ``config``'s processes, before any device is used (nothing for one
    process); then checks that ``tensor_parallel_size`` is every process's devices together."""
    if config.num_processes == 1:
        return
    _authkey()  # refused before anything is built, not after the engine's warm-up
    # A compiled program's locations would otherwise hold the whole Python stack it was traced under, which
    # differs between the leader (a server, LLM.generate) and a follower (follow): the executables' fingerprints
    # then differ, and so do the launch ids their cross-process collectives meet under (every process waited in
    # the first step's all-reduce for ever). The innermost frame, the engine's own code, is the same everywhere.
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
    # For the same reason each process compiles its own steps: JAX's persistent cache keys a program without
    # its locations, so one process could load a program compiled under another stack (or by another run)
    # while another compiles it afresh, and their fingerprints differ again.
    jax.config.update("jax_enable_compilation_cache", False)
    if not jax.distributed.is_initialized():
        if jax.config.jax_cpu_collectives_implementation is None:  # (a CPU's collectives across processes)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id)
    elif (jax.process_count(), jax.process_index()) != (config.num_processes, config.process_id):
        raise ValueError(f"jax.distributed is already initialized as process {jax.process_index()} of "
                         f"{jax.process_count()}, not process_id={config.process_id} of "
                         f"num_processes={config.num_processes}")
    if config.tensor_parallel_size != jax.device_count():
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}, but the {config.num_processes} "
                         f"processes have {jax.device_count()} devices together ({jax.local_device_count()} here): set "
                         f"tensor_parallel_size={jax.device_count()}")


def agreed_min(value: int) -> int:
    """The smallest of every process's ``value`` (a collective: every process calls it)."""
    if jax.process_count() == 1:
        return value
    return int(np.min(multihost_utils.process_allgather(np.int64(value))))


def engine_settings(engine) -> tuple:
    """What every process's engine must share: its settings (less the process's own), the model, the pool,
    the attention backend and the step's tuning."""
    config = dataclasses.replace(engine.config, process_id=0, kv_events_config=None)
    return (config, engine.params.config, engine.params.dtype, engine.num_blocks, engine.max_model_len,
            engine.runner.attention_backend, engine.runner.tuning)


def state_fingerprint(engine) -> tuple[int, ...]:
    """What replicas of one engine agree on after identical engine calls: steps run, sequences running and waiting,
    tokens generated, blocks used and cached."""
    scheduler, kv = engine.scheduler, engine.kv
    return (engine.metrics.total_steps, len(scheduler.running), len(scheduler.waiting),
            scheduler.counters.generated_tokens, kv.num_used_blocks, kv.num_cached_blocks)


def _authkey() -> bytes:
    """The shared secret the processes' channel authenticates with. Required: the channel carries pickled
    engine calls, and process 0 listens on every interface, so a key anyone could derive would let anyone
    who reaches the port run code in process 0 while it waits for its followers."""
    key = os.environ.get(AUTHKEY_ENV, "")
    if len(key) < 16:
        raise ValueError(f"several processes (num_processes > 1) need {AUTHKEY_ENV} set to the same secret of at "
                         f"least 16 characters in every process (e.g. `export {AUTHKEY_ENV}=$(openssl rand -hex 16)` "
                         f"and pass it to every host)")
    return key.encode()


def _dial(address: tuple[str, int], authkey: bytes) -> Connection:
    """A connection to the leader, tried until ``CONNECT_SECONDS`` pass (it listens once its engine is ready)."""
    deadline = time.monotonic() + CONNECT_SECONDS
    while True:
        try:
            return Client(address, authkey=authkey)
        except ConnectionRefusedError as err:
            if time.monotonic() > deadline:
                raise TimeoutError(f"process 0 did not accept a connection at {address[0]}:{address[1]} within "
                                   f"{CONNECT_SECONDS:.0f} s ({err})") from None
            time.sleep(0.2)


def connect(engine, config: EngineConfig) -> MultiProcessEngine:
    """``engine`` as one of ``config.num_processes`` replicas: the leader accepts every follower, sends it its
    settings and hears whether they match; a follower connects to the leader and checks them. Every process
    calls this once its engine is built and warmed up."""
    host, port = split_host_port(config.coordinator_address)
    authkey, settings = _authkey(), engine_settings(engine)
    if config.process_id == 0:
        followers: list[Connection] = []
        with Listener(("", port + 1), authkey=authkey) as listener:  # (every interface, as jax's coordinator)
            for _ in range(config.num_processes - 1):
                followers.append(listener.accept())
                followers[-1].send(settings)
        problems = [msg for ok, msg in (conn.recv() for conn in followers) if not ok]
        if problems:
            raise ValueError("; ".join(problems))
        replicated = MultiProcessEngine(engine, followers=followers)
        # A leader that exits without closing its engine (the server's engine process) still releases the
        # followers first: jax.distributed's own exit handler, which runs after this one, waits for every process.
        atexit.register(replicated.end_followers)
        return replicated
    leader = _dial((host, port + 1), authkey)
    theirs = leader.recv()
    names = ("engine settings", "model config", "dtype", "num_blocks", "max_model_len", "attention backend",
             "step tuning")
    differ = [f"{name}: {mine!r} here, {other!r} on process 0" for name, mine, other in zip(names, settings, theirs)
              if mine != other]
    message = f"process {config.process_id} does not match process 0: " + "; ".join(differ)
    leader.send((not differ, message))
    if differ:
        raise ValueError(message)
    return MultiProcessEngine(engine, leader=leader)


def _refuse_structured(values) -> None:
    for value in values:
        for sp in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(sp, SamplingParams) and sp.structured_outputs is not None:
                raise ValueError("SamplingParams.structured_outputs is not supported with several processes "
                                 "(num_processes > 1): a grammar compiles in a thread of each process, whose "
                                 "timing would let their engines schedule different steps")


class MultiProcessEngine:
    """This process's ``LLMEngine`` among several (``LLM.engine`` then). On the leader, each call of
    ``REPLAYED`` is sent to every follower, then run here; on a follower those calls raise, and ``follow``
    runs the leader's. Everything else (``stats``, ``scheduler``, ``has_unfinished_requests``, ...) is the
    engine's own."""

    def __init__(self, engine, followers: list[Connection] | None = None, leader: Connection | None = None):
        self.engine = engine
        self._followers = followers or []
        self._leader = leader

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    @property
    def is_leader(self) -> bool:
        return self._leader is None

    def _replay(self, name: str, *args, **kwargs):
        if not self.is_leader:
            raise RuntimeError(f"process {jax.process_index()} runs process 0's calls: call follow(), not {name}()")
        if name in ("add_request", "add_requests"):
            _refuse_structured(list(args) + list(kwargs.values()))
        message = (name, args, kwargs, state_fingerprint(self.engine))
        for conn in self._followers:
            conn.send(message)
        return getattr(self.engine, name)(*args, **kwargs)

    def add_request(self, *args, **kwargs):
        return self._replay("add_request", *args, **kwargs)

    def add_requests(self, *args, **kwargs):
        return self._replay("add_requests", *args, **kwargs)

    def abort_request(self, *args, **kwargs):
        return self._replay("abort_request", *args, **kwargs)

    def step(self):
        return self._replay("step")

    def warmup(self, *args, **kwargs):
        return self._replay("warmup", *args, **kwargs)

    def settle(self, *args, **kwargs):
        return self._replay("settle", *args, **kwargs)

    def follow(self) -> None:
        """Runs the leader's calls on this engine, in its order, until the leader closes its engine or exits;
        then closes this one. ``RuntimeError`` where this engine's state stops matching the leader's."""
        if self.is_leader:
            raise RuntimeError("process 0 takes the requests; follow() is for the other processes")
        while True:
            try:
                message = self._leader.recv()
            except (EOFError, ConnectionResetError):  # the leader exited
                break
            if message is None:  # the leader closed its engine
                break
            name, args, kwargs, expected = message
            here = state_fingerprint(self.engine)
            if here != expected:
                raise RuntimeError(f"process {jax.process_index()} diverged from process 0 before {name}(): "
                                   f"(steps, running, waiting, generated tokens, blocks used, cached) are {here} "
                                   f"here, {expected} there")
            try:
                getattr(self.engine, name)(*args, **kwargs)
            except (TypeError, ValueError, KeyError):
                pass  # refused on the leader too, engine unchanged there and here; the leader's caller has the error
        self.close()

    def end_followers(self) -> None:
        """Ends the followers' ``follow`` (on the leader; nothing elsewhere or a second time)."""
        for conn in self._followers:
            try:
                conn.send(None)
                conn.close()
            except OSError:  # (a follower already gone)
                pass
        self._followers = []

    def close(self) -> None:
        """Ends the followers' ``follow`` (on the leader), then closes the engine."""
        self.end_followers()
        if self._leader is not None:
            self._leader.close()
        self.engine.close()
