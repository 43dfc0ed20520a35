"""Engines in child processes behind one server: `EnginePool` is the `EngineAPI` of N
engine processes, each an ordinary `Engine` (its own step thread, codec thread and slots).

Why: one engine steps on one thread, and a step is Python between torch calls, so an
engine uses about one core whatever the machine has (on the 2-core VM a server at 10
sessions used 1.15 cores, its step thread busy 92-96 %: docs/loadtest.md, "What fails
first"). The gRPC service, voices, metrics and drain stay in the server's process; each
session lives in one child, picked with the most free slots when it opens.

    parent (server)                              child i (`_child_main`)
    PooledSession.push_text ── checks (SessionInput) ──▶ ("cmd", id, command) ─▶ Engine.submit
    sink(event)  ◀── reader thread ◀── [("event", id, ev), ("ended", id), ("metric", ...)] ◀── outbox

The commands a child applies are the tuples `SessionInput` built in the parent: the text
is checked once, where the service can answer with a status. A child's metric updates
are applied to the server's `Metrics` (`RelayedMetrics`), so /metrics reads as one
engine's. A child that dies fails its own sessions (UNAVAILABLE); the other children's
sessions go on, and a new process takes its slots back once it has started. Children
ignore SIGINT and SIGTERM: the server drains, then stops them; a child whose parent is
gone exits (its pipe closes).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from livespeech.api.session import CapacityError, Failed, Finished, SessionConfig, Sink

from .config import ServerConfig
from .metrics import Metrics
from .session import SessionInput, SessionLimits, new_session_id

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading the model and warming up, all children at once
VOICE_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0
# a dead engine process is replaced after this; one that dies within RESPAWN_RESET_S of
# its start waits twice as long as the last time, up to RESPAWN_MAX_DELAY_S
RESPAWN_DELAY_S = 1.0
RESPAWN_RESET_S = 60.0
RESPAWN_MAX_DELAY_S = 60.0


@dataclass(frozen=True)
class PooledVoice:
    """An enrolled voice as the server's process holds it: the child's `Voice` pickled
    (its tensors by value), handed to the child that opens a session with it."""
    voice_id: str
    payload: bytes


class PooledSession(SessionInput):
    """The service's handle of a session held by a child engine."""


class _Child:
    def __init__(self, index: int, process: multiprocessing.process.BaseProcess, conn) -> None:
        self.index = index
        self.process = process
        self.conn = conn
        self.send_lock = threading.Lock()
        self.capacity = 0
        self.active = 0  # sessions opened on it and not yet ended (the pool's lock)
        self.alive = True
        self.reader: Optional[threading.Thread] = None
        self.started_at = time.monotonic()

    def send(self, message: tuple) -> None:
        with self.send_lock:
            self.conn.send(message)


class EnginePool:
    def __init__(self, config: ServerConfig, metrics: Metrics, processes: int, cpus: int,
                 build: Callable[[ServerConfig, Any, int], Any]) -> None:
        """`build(config, metrics, cpus)` makes a child's `Engine` (a module-level function:
        the children import it); `cpus`: the CPUs for each child's threads."""
        if processes < 2:
            raise ValueError("an engine pool has two engine processes or more")
        self.config = config
        self.metrics = metrics
        self.processes = processes
        self.cpus = cpus
        self.build = build
        self._children: list[_Child] = []
        self._lock = threading.Lock()
        self._sinks: dict[str, tuple[_Child, Sink]] = {}  # open sessions' sinks, until their last event
        self._voice_requests: dict[int, tuple[_Child, concurrent.futures.Future]] = {}
        self._request_ids = itertools.count()
        self._next_voice_child = itertools.count()
        self._limits: Optional[SessionLimits] = None
        self._builtin_voices: dict = {}
        self._stopping = False
        self._respawn_delays = [RESPAWN_DELAY_S] * processes

    # --- EngineAPI ---------------------------------------------------------------------------
    @property
    def active_sessions(self) -> int:
        with self._lock:
            return sum(c.active for c in self._children)

    @property
    def capacity(self) -> int:
        return sum(c.capacity for c in self._children if c.alive)

    @property
    def builtin_voices(self) -> dict:
        return self._builtin_voices

    def start(self) -> None:
        """Start the children and return once every one has loaded and warmed up."""
        if self._children:
            return
        self._children = [self._spawn(index) for index in range(self.processes)]
        try:
            for child in self._children:
                self._await_ready(child)
        except BaseException:
            self.stop()
            raise
        for child in self._children:
            self._listen(child)
        log.info("engine pool: %d processes, %s slots", self.processes, "+".join(str(c.capacity) for c in self._children))

    def _spawn(self, index: int) -> _Child:
        ctx = multiprocessing.get_context("spawn")  # a fork of a process with torch's threads is unsafe
        parent_end, child_end = ctx.Pipe()
        share = _split(self.config.max_sessions, self.processes)[index]
        child_config = dataclasses.replace(self.config, max_sessions=share, engine_processes=1)
        process = ctx.Process(target=_child_main, args=(child_end, self.build, child_config, self.cpus, index),
                              name=f"livespeech-engine-{index}", daemon=True)
        process.start()
        child_end.close()
        return _Child(index, process, parent_end)

    def _listen(self, child: _Child) -> None:
        child.reader = threading.Thread(target=self._read, args=(child,), name=f"livespeech-pool-{child.index}",
                                        daemon=True)
        child.reader.start()

    def _respawn(self, index: int, delay_s: float) -> None:
        """A replacement for the engine process that died (a thread of its own): its
        slots come back once it has started. Deaths in a row wait longer each time."""
        time.sleep(delay_s)
        if self._stopping:
            return
        child = None
        try:
            child = self._spawn(index)
            self._await_ready(child)
        except Exception:
            log.exception("engine process %d: the replacement failed to start", index)
            if child is not None and child.process.is_alive():
                child.process.kill()
            self._schedule_respawn(index, later=True)
            return
        child.started_at = time.monotonic()
        with self._lock:
            self._children[index] = child
        if self._stopping:
            self._shut(child)
            return
        self._listen(child)
        log.warning("engine process %d replaced: %d slots back", index, child.capacity)

    def _await_ready(self, child: _Child) -> None:
        if not child.conn.poll(START_TIMEOUT_S):
            raise RuntimeError(f"engine process {child.index} did not start in {START_TIMEOUT_S:.0f} s")
        try:
            kind, *rest = child.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"engine process {child.index} exited while starting "
                               f"(exit code {child.process.exitcode}; its log is above)") from None
        if kind != "ready":
            raise RuntimeError(f"engine process {child.index} failed to start: {rest[0]}")
        child.capacity, self._builtin_voices, self._limits = rest

    def stop(self) -> None:
        self._stopping = True
        for child in self._children:  # all asked first: they stop side by side
            self._ask_to_stop(child)
        for child in self._children:
            self._join(child)

    def _shut(self, child: _Child) -> None:
        self._ask_to_stop(child)
        self._join(child)

    @staticmethod
    def _ask_to_stop(child: _Child) -> None:
        try:
            child.send(("shutdown",))
        except (OSError, ValueError):
            pass  # already gone

    def _join(self, child: _Child) -> None:
        child.process.join(STOP_TIMEOUT_S)
        if child.process.is_alive():
            log.error("engine process %d did not stop in %.0f s: killed", child.index, STOP_TIMEOUT_S)
            child.process.kill()
            child.process.join(5)
        if child.reader is not None and child.reader is not threading.current_thread():
            child.reader.join(5)

    def make_voice(self, voice_id: str, audio, sample_rate: int) -> PooledVoice:
        alive = [c for c in self._children if c.alive]
        if not alive:
            raise RuntimeError("no engine process is running")
        child = alive[next(self._next_voice_child) % len(alive)]
        request, future = next(self._request_ids), concurrent.futures.Future()
        self._voice_requests[request] = (child, future)
        try:
            child.send(("voice", request, voice_id, audio, sample_rate))
            return future.result(VOICE_TIMEOUT_S)
        finally:
            self._voice_requests.pop(request, None)

    def open_session(self, config: SessionConfig, voice: PooledVoice, sink: Sink) -> PooledSession:
        config.validate()
        with self._lock:
            free = [c for c in self._children if c.alive and c.active < c.capacity]
            if not free:
                self.metrics.sessions_total.labels(outcome="rejected").inc()
                raise CapacityError(f"all {self.capacity} session slots are busy")
            child = min(free, key=lambda c: (c.active - c.capacity, c.index))  # the most free slots
            child.active += 1
            session = PooledSession(new_session_id(), config, self._submitter(child), self._limits)
            self._sinks[session.session_id] = (child, sink)
        self.metrics.active_sessions.inc()
        try:
            child.send(("open", session.session_id, config, voice.payload))
        except (OSError, ValueError):
            pass  # the child is gone: its reader fails the session
        return session

    def _submitter(self, child: _Child) -> Callable[[SessionInput, tuple], None]:
        def submit(session: SessionInput, command: tuple) -> None:
            if command[0] == "close":  # nothing more is delivered after a close
                self._sinks.pop(session.session_id, None)
            try:
                child.send(("cmd", session.session_id, command))
            except (OSError, ValueError):
                pass  # the child is gone: its reader failed the session
        return submit

    # --- the children's messages (a reader thread per child) ---------------------------------
    def _read(self, child: _Child) -> None:
        while True:
            try:
                batch = child.conn.recv()
            except (EOFError, OSError):
                break
            for message in batch:
                try:
                    self._handle(child, message)
                except Exception:
                    log.exception("engine pool: message %r from process %d", message[0], child.index)
        self._child_gone(child)

    def _handle(self, child: _Child, message: tuple) -> None:
        kind = message[0]
        if kind == "event":
            _, session_id, event = message
            entry = self._sinks.get(session_id)
            if entry is None:
                return  # closed: nothing more is delivered
            if isinstance(event, (Finished, Failed)):
                self._sinks.pop(session_id, None)
            entry[1](event)
        elif kind == "ended":
            with self._lock:
                child.active -= 1
            self.metrics.active_sessions.dec()
        elif kind == "metric":
            _, name, labels, method, value = message
            metric = getattr(self.metrics, name)
            if labels:
                metric = metric.labels(**dict(labels))
            getattr(metric, method)(value)
        elif kind == "voice":
            _, request, ok, value = message
            _, future = self._voice_requests.get(request, (None, None))
            if future is not None:
                if ok:
                    future.set_result(PooledVoice(value[0], value[1]))
                else:
                    future.set_exception(value)

    def _child_gone(self, child: _Child) -> None:
        """The child's pipe closed: it stopped, or died. A death fails its sessions."""
        child.alive = False
        with self._lock:
            lost, child.active = child.active, 0
            orphans = [(sid, sink) for sid, (c, sink) in self._sinks.items() if c is child]
            for sid, _ in orphans:
                del self._sinks[sid]
        if self._stopping and not orphans:
            return
        child.process.join(1)
        log.error("engine process %d exited (exit code %s): %d sessions failed", child.index,
                  child.process.exitcode, lost)
        if lost:
            self.metrics.errors_total.labels(code="UNAVAILABLE").inc(lost)
            self.metrics.sessions_total.labels(outcome="failed").inc(lost)
            self.metrics.active_sessions.dec(lost)
        for _, sink in orphans:
            sink(Failed("UNAVAILABLE", "the engine process serving this session exited"))
        for asked, future in list(self._voice_requests.values()):
            if asked is child and not future.done():
                future.set_exception(RuntimeError(f"engine process {child.index} exited"))
        if not self._stopping:
            self._schedule_respawn(child.index, later=time.monotonic() - child.started_at < RESPAWN_RESET_S)

    def _schedule_respawn(self, index: int, later: bool) -> None:
        """Replace engine `index` after RESPAWN_DELAY_S, or (`later`: it died soon after its
        start, or its replacement failed) after twice the last delay."""
        delay = min(2 * self._respawn_delays[index], RESPAWN_MAX_DELAY_S) if later else RESPAWN_DELAY_S
        self._respawn_delays[index] = delay
        threading.Thread(target=self._respawn, args=(index, delay), name="livespeech-respawn", daemon=True).start()


def _split(total: int, parts: int) -> list[int]:
    """`total` slots over `parts` engines, as evenly as they go."""
    return [total // parts + (i < total % parts) for i in range(parts)]


# ------------------------------------------------------------------ the child's side


class RelayedMetrics:
    """`Metrics` as an engine process sees it: each update is a message to the server,
    which applies it to its own (`EnginePool._handle`). Covers what the engine records:
    `inc`, `dec` and `observe`, with or without `labels`. The open sessions' gauge is the
    server's own: it counts a session from its open to its "ended" (or its engine's death),
    which a child's updates, lost with the child, would not."""

    KEPT_BY_SERVER = frozenset({"active_sessions"})

    def __init__(self, put: Callable[[tuple], None]) -> None:
        self._put = put

    def __getattr__(self, name: str) -> "_RelayedMetric":
        if name.startswith("_"):
            raise AttributeError(name)
        metric = _RelayedMetric(_dropped if name in self.KEPT_BY_SERVER else self._put, name, ())
        setattr(self, name, metric)
        return metric


def _dropped(message: tuple) -> None:
    pass


class _RelayedMetric:
    __slots__ = ("_put", "_name", "_labels")

    def __init__(self, put: Callable[[tuple], None], name: str, labels: tuple) -> None:
        self._put, self._name, self._labels = put, name, labels

    def labels(self, **labels: str) -> "_RelayedMetric":
        return _RelayedMetric(self._put, self._name, tuple(sorted(labels.items())))

    def inc(self, amount: float = 1) -> None:
        self._put(("metric", self._name, self._labels, "inc", amount))

    def dec(self, amount: float = 1) -> None:
        self._put(("metric", self._name, self._labels, "dec", amount))

    def observe(self, value: float) -> None:
        self._put(("metric", self._name, self._labels, "observe", value))


class _Outbox:
    """The child's messages to the server, sent in batches from a thread of their own, so
    the engine thread only queues them."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="livespeech-outbox", daemon=True)
        self._thread.start()

    def put(self, message: tuple) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            last = batch[-1] is None
            batch = [m for m in batch if m is not None]
            try:
                if batch:
                    self._conn.send(batch)
            except (OSError, ValueError):
                return  # the server is gone
            if last:
                return


def _child_main(conn, build: Callable, config: ServerConfig, cpus: int, index: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s engine-{index} %(name)s: %(message)s")
    outbox = _Outbox(conn)
    try:
        engine = build(config, RelayedMetrics(outbox.put), cpus)
        engine.start()
        from .engine import freeze_startup_objects

        freeze_startup_objects()
    except BaseException as exc:  # noqa: BLE001 - whatever stops the start is the parent's error message
        log.exception("engine process %d failed to start", index)
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    sessions: dict[str, Any] = {}

    def ended(session_id: str) -> None:
        sessions.pop(session_id, None)
        outbox.put(("ended", session_id))

    engine.on_session_end = ended
    voices = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="livespeech-voices")
    conn.send(("ready", engine.capacity, engine.builtin_voices, engine.session_limits))
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                log.error("engine process %d: the server is gone; stopping", index)
                break
            kind = message[0]
            if kind == "cmd":
                session = sessions.get(message[1])
                if session is not None:
                    engine.submit(session, message[2])
            elif kind == "open":
                _open(engine, sessions, outbox, *message[1:])
            elif kind == "voice":
                voices.submit(_make_voice, engine, outbox, *message[1:])
            elif kind == "shutdown":
                break
    finally:
        engine.stop()
        voices.shutdown(wait=False, cancel_futures=True)
        outbox.close()


def _open(engine, sessions: dict, outbox: _Outbox, session_id: str, config: SessionConfig, voice: bytes) -> None:
    def sink(event) -> None:
        outbox.put(("event", session_id, event))

    try:
        sessions[session_id] = engine.open_session(config, pickle.loads(voice), sink, session_id=session_id)
    except Exception as exc:  # the parent counted a free slot here: it should not happen
        log.exception("session %s: could not open", session_id)
        outbox.put(("event", session_id, Failed("INTERNAL", f"{type(exc).__name__} while opening the session")))
        outbox.put(("ended", session_id))


def _make_voice(engine, outbox: _Outbox, request: int, voice_id: str, audio, sample_rate: int) -> None:
    try:
        voice = engine.make_voice(voice_id, audio, sample_rate)
        outbox.put(("voice", request, True, (voice.voice_id, pickle.dumps(voice))))
    except Exception as exc:
        try:
            pickle.dumps(exc)
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        outbox.put(("voice", request, False, exc))
