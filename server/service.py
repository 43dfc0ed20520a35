"""The LiveSpeech gRPC servicer (grpc.aio), and the session side every transport shares.

`SessionStream` is a synthesis stream without its transport: the engine's events queued
for the client, the idle and wall-clock timeouts, the slow-reader rules; with
`LiveSpeechService.admit` / `open_session` / `discharge` (admission, voice, tenant quota,
capacity, drain). gRPC's `_Stream` and the WebSocket/HTTP endpoints (server/web.py) are
transports over it.

One `Synthesize` stream = one `_Stream`: the handler reads the config, opens an engine
session, then runs a reader task (client messages -> `SessionHandle`) and a writer task
(engine events -> client). The engine thread calls the session's sink; the sink hands
each event to the event loop with `loop.call_soon_threadsafe`, into a queue the writer
drains. A client that does not read is ended with RESOURCE_EXHAUSTED "client is not
reading" (`ReadClock`): when gRPC flow control has blocked the writer and the audio the
client took falls behind real time by more than `slow_reader_grace_s`; or when the queue
reaches `max_buffered_packets` (a memory backstop).

Every way out of a stream goes through `Synthesize`'s `finally`: the engine handle is
closed (the slot is freed within one engine step), the outcome is counted, and a failure
becomes a defined status (an `RpcError`, or INTERNAL for a bug, which is logged).

Status choices (see also the .proto):
- no config within `config_timeout_s`: DEADLINE_EXCEEDED;
- more than `synthesize_stream_limit` streams open: RESOURCE_EXHAUSTED with
  `retry-after-ms`, refused like any stream (its messages drained: server/grpc_drain.py);
- a session's total text over `max_session_text_chars`: RESOURCE_EXHAUSTED (a single
  piece over `max_text_piece_chars` is INVALID_ARGUMENT); it, any other client error
  after the start, the idle timeout and the wall-clock cap end a started session after
  a summary of what was spoken (`SessionStream.end_early`);
- the client half-closes without `end_of_input`: treated as end of input, HALF_CLOSE_S
  later (server/grpc_drain.py);
- messages after `cancel` are ignored (a text pump may race the cancel);
- a message whose bytes do not decode (`protocol.Malformed`), in any method:
  INVALID_ARGUMENT "malformed <type>: <reason>", logged once per call (`decoded`).

Tenants: with authentication on (server/auth.py), calls reach this servicer only with a
valid token, and `current_tenant()` names the caller; voices are looked up, listed,
registered and deleted in that tenant's namespace (server/voices.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Iterator, Optional

import grpc

from livespeech.api.protocol import Enrollment, Malformed, config_from_proto, event_to_proto, pb, voice_info_to_proto
from livespeech.api.session import (
    AudioPacket,
    CapacityError,
    ConfigError,
    EngineAPI,
    Failed,
    Finished,
    SessionConfig,
    SessionEvent,
    SessionHandle,
    LimitError,
    Started,
    StateError,
    Voice,
    WordTiming,
)

from .audio import MODEL_SAMPLE_RATE
from .auth import current_tenant
from .config import ServerConfig
from .grpc_drain import confirm_half_close, drain, drain_requests
from .metrics import Metrics
from .voices import VoiceStore, VoiceStoreError, check_voice_id, decode_reference

log = logging.getLogger(__name__)
Code = grpc.StatusCode
ABORT_WAIT_S = 2.0  # longest wait for a client to take an error status
# the longest an early ending (`SessionStream.end_early`) waits for the engine's summary
# and its write to the client; then the status goes out without it
STOP_WAIT_S = 2.0


class RpcError(Exception):
    """Ends an RPC with this status. `from_engine`: relays an engine `Failed` (the engine
    counted it in `errors_total` already)."""

    def __init__(self, code: grpc.StatusCode, message: str, metadata: tuple = (), from_engine: bool = False) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.metadata = metadata
        self.from_engine = from_engine


def decoded(request: Any) -> Any:
    """The request, or RpcError INVALID_ARGUMENT if its bytes did not decode. Once per
    call: the first malformed message ends the call, later ones are dropped unread."""
    if isinstance(request, Malformed):
        log.info("refused a malformed request: %s", request.message)
        raise RpcError(Code.INVALID_ARGUMENT, request.message)
    return request


class ReadClock:
    """How far a client's reading is behind real time, counted only while the server
    has output waiting for it (`backlog`): with nothing to send, the server is the one
    behind. `balance_s` is the audio the client holds if it plays in real time:
    + each audio packet the transport takes, - the time that passes; clamped at 0 while
    there is no backlog (the client has everything there is). The client "is not
    reading" once the balance is below -grace, i.e. it would have waited that long for
    audio the server had. The clock starts with the first audio packet written."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.balance_s = 0.0
        self.since: Optional[float] = None  # last update; None until the first audio
        self.backlog = False

    def update(self, now: float, backlog: bool) -> None:
        """Account for the time up to `now` (under the previous backlog state), then take
        the new state."""
        if self.since is not None:
            self.balance_s -= now - self.since
            if not self.backlog:
                self.balance_s = max(self.balance_s, 0.0)
            self.since = now
        self.backlog = backlog

    def start(self, now: float) -> None:
        if self.since is None:
            self.since = now

    def took(self, audio_s: float) -> None:
        self.balance_s += audio_s

    def behind(self) -> bool:
        return self.balance_s < -self.grace_s

    def due_in(self) -> float:
        """Seconds until `behind()` at the earliest, if the backlog stays."""
        return max(self.balance_s + self.grace_s, 0.0) + 1e-3


class SessionStream:
    """The transport-neutral side of one synthesis stream (event loop): the engine's
    events queued for the client, the session's idle and wall-clock timeouts, and the
    slow-reader rules (`ReadClock`, `max_buffered_packets`). gRPC's `_Stream` and the
    WebSocket/HTTP adapters (server/web.py) are transports over it: they open the session
    with `LiveSpeechService.open_session`, forward client messages to `handle`, take
    events with `next_event` and write each under `timed_write`. The service's drain and
    tenant quota see every transport's streams (`LiveSpeechService.admit`)."""

    def __init__(self, service: "LiveSpeechService") -> None:
        self.service = service
        self.config = service.config
        self.loop = asyncio.get_running_loop()
        self.handle: Optional[SessionHandle] = None
        self.events: asyncio.Queue[SessionEvent] = asyncio.Queue()
        # resolved once: None (the session ended with its summary) or the RpcError to end it
        # with (after a summary when `stopping`)
        self.outcome: asyncio.Future = self.loop.create_future()
        # the status of an early ending whose summary is awaited (`end_early`)
        self.stopping: Optional[RpcError] = None
        self._stop_timer: Optional[asyncio.TimerHandle] = None
        self.last_activity = time.monotonic()
        self.closed = False
        self.released = False  # the engine handle was closed
        self.capacity_rejected = False
        self.tenant = current_tenant()
        self.opened_at = time.monotonic()
        self.read_clock = ReadClock(self.config.slow_reader_grace_s)
        self.writing = False  # the writer waits for the transport to take a message
        self._read_check: Optional[asyncio.TimerHandle] = None

    # ------------------------------------------------------------ engine side

    def sink(self, event: SessionEvent) -> None:
        """Called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    def _deliver(self, event: SessionEvent) -> None:
        if self.closed or self.outcome.done():
            return
        self.last_activity = time.monotonic()
        terminal = isinstance(event, (Finished, Failed))
        if not terminal and self.events.qsize() >= self.config.max_buffered_packets:
            self.finish(RpcError(Code.RESOURCE_EXHAUSTED, "client is not reading"))
            return
        self.events.put_nowait(event)
        self._backlog_changed()

    def _backlog_changed(self) -> None:
        """Update the read clock; while output waits for the client, check it when the
        grace could run out."""
        backlog = self.writing or not self.events.empty()
        clock = self.read_clock
        clock.update(self.loop.time(), backlog)
        if clock.behind():
            self.finish(RpcError(Code.RESOURCE_EXHAUSTED, "client is not reading"))
        elif backlog and clock.since is not None and self._read_check is None:
            self._read_check = self.loop.call_later(clock.due_in(), self._check_reading)

    def _check_reading(self) -> None:
        self._read_check = None
        if not (self.closed or self.outcome.done()):
            self._backlog_changed()

    def finish(self, outcome: Optional[RpcError]) -> None:
        if not self.outcome.done():
            self.outcome.set_result(outcome)

    def end_early(self, error: RpcError) -> None:
        """End the started session with `error` (its text limit, a timeout, a client
        error), the summary of what was spoken first: the engine stops it and answers
        with Finished(summary, error), which the transport writes before the status. Waits
        STOP_WAIT_S at most for that (an engine that does not answer, a client that does
        not take the write), then ends with the status alone."""
        if self.outcome.done() or self.stopping is not None:
            return
        stop = getattr(self.handle, "stop", None)
        if stop is None:
            self.finish(error)
            return
        self.stopping = error
        self._stop_timer = self.loop.call_later(STOP_WAIT_S, self.finish, error)
        try:
            stop(error.code.name, error.message)
        except Exception:  # pragma: no cover - the engine must not keep the status from the client
            log.exception("handle.stop() failed")
            self.finish(error)

    def ended(self, ev: Finished) -> Optional[RpcError]:
        """The outcome after a summary was written: the early ending's status, if any."""
        if self.stopping is not None:
            return self.stopping
        return None if ev.error is None else failed_error(ev.error)

    def release(self) -> None:
        """Free the engine slot (idempotent); nothing more is delivered."""
        self.closed = True
        if self._read_check is not None:
            self._read_check.cancel()
        if self._stop_timer is not None:
            self._stop_timer.cancel()
        if self.handle is not None and not self.released:
            self.released = True
            # the service ending a session with an error is a failure, not a disconnect
            failed = (self.outcome.done() and not self.outcome.cancelled()
                      and self.outcome.exception() is None and self.outcome.result() is not None)
            try:
                self.handle.close("failed" if failed else "disconnected")
            except Exception:  # pragma: no cover - the engine must not make us leak
                log.exception("handle.close() failed")

    # ------------------------------------------------------------ engine -> client

    async def next_event(self) -> SessionEvent:
        """The next engine event. Past the idle timeout or the session's wall-clock cap,
        the session ends early (`end_early`: DEADLINE_EXCEEDED after its summary); its
        last events still come from here."""
        idle, wall = self.config.idle_timeout_s, self.config.max_session_wall_s
        while True:
            if self.stopping is not None or self.outcome.done():
                return await self.events.get()
            now = time.monotonic()
            wall_left = self.opened_at + wall - now
            if wall_left <= 0:  # checked first: a session that is generating has events ready
                self.end_early(RpcError(Code.DEADLINE_EXCEEDED, f"session open for {wall:g} s (max_session_wall_s)"))
                continue
            if not self.events.empty():
                return self.events.get_nowait()
            remaining = self.last_activity + idle - now
            if remaining <= 0:
                self.end_early(RpcError(
                    Code.DEADLINE_EXCEEDED, f"session idle for {idle:g} s (no message and nothing to generate)"))
                continue
            try:
                async with asyncio.timeout(min(remaining, wall_left)):
                    return await self.events.get()
            except asyncio.TimeoutError:
                continue

    async def timed_write(self, write: Awaitable[Any], audio_s: float = 0.0, last: bool = False) -> None:
        """Await the transport's write of one event, with the time it waits (flow
        control) on the read clock; `audio_s`: the audio it carries; `last`: the summary
        (a client that took it read everything)."""
        if audio_s:
            self.read_clock.start(self.loop.time())
        self.writing = True
        self._backlog_changed()
        try:
            await write
        finally:
            self.writing = False
        if not last:
            self.read_clock.took(audio_s)
            self._backlog_changed()


class _Stream(SessionStream):
    """State of one Synthesize stream (event-loop side)."""

    def __init__(self, service: "LiveSpeechService", context: grpc.aio.ServicerContext) -> None:
        super().__init__(service)
        self.context = context
        self.tasks: list[asyncio.Task] = []
        self.requests_broken = False
        self.ending = False  # shutdown began: the reader drains, forwards nothing
        self.request_seen = asyncio.Event()  # set by the reader at each client message

    def close(self) -> None:
        """Every exit path: free the engine slot now, stop the helper tasks."""
        self.release()
        for t in self.tasks:
            t.cancel()

    async def discard_requests(self, it: AsyncIterator) -> None:
        """`drain_requests` before a stream ends early, unless a timed-out read already
        left the iterator unusable."""
        if not self.requests_broken:
            self.requests_broken = True
            await drain_requests(it)

    async def shutdown(self) -> None:
        """Free the slot; let a reader that is still reading take the client's writes in
        flight for a moment (a status that overtakes them turns into INTERNAL on grpc's
        asyncio client, grpc/grpc#36066; a client that half-closes costs nothing here);
        then `close()` and wait for the tasks: a write blocked on flow control must be
        cancelled before the status can be sent."""
        self.release()
        reader = self.tasks[0] if self.tasks else None
        if reader is not None and not reader.done():
            self.ending = True  # the reader drops messages from now on, and reports them

            async def next_message() -> None:
                self.request_seen.clear()
                seen = asyncio.ensure_future(self.request_seen.wait())
                try:
                    await asyncio.wait({reader, seen}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    seen.cancel()
                if reader.done():
                    raise StopAsyncIteration

            await drain(next_message)
        self.close()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    # ------------------------------------------------------------ main

    async def run(self, it: AsyncIterator) -> None:
        first = decoded(await self._first_message(it))
        if first.WhichOneof("request") != "config":
            raise RpcError(Code.INVALID_ARGUMENT, "first message must be config")
        try:
            cfg, enrollment = config_from_proto(first.config)
        except ConfigError as e:
            raise RpcError(Code.INVALID_ARGUMENT, str(e)) from None
        effective = await self.service.open_session(self, cfg, enrollment)
        await self.context.write(event_to_proto(Started(self.handle.session_id, effective)))
        for coro in (self._read(it), self._write()):
            task = asyncio.create_task(coro)
            task.add_done_callback(self._task_done)
            self.tasks.append(task)
        outcome = await self.outcome
        await self.shutdown()
        if outcome is not None:
            raise outcome

    def _task_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or self.outcome.done():
            return  # the stream is ending already (e.g. a read interrupted by the abort)
        exc = task.exception()
        if isinstance(exc, RpcError):
            self.finish(exc)
        elif exc is not None:
            log.error("session task failed", exc_info=exc)
            self.finish(RpcError(Code.INTERNAL, "internal error"))

    async def _first_message(self, it: AsyncIterator) -> Any:
        timeout = self.config.config_timeout_s
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for loses a cancel that comes as the
            # read ends, and a client's cancel comes exactly then (grpc_drain.HALF_CLOSE_S)
            async with asyncio.timeout(timeout):
                return await it.__anext__()
        except asyncio.TimeoutError:
            self.requests_broken = True  # the interrupted read leaves the iterator unusable
            raise RpcError(Code.DEADLINE_EXCEEDED, f"no config received within {timeout:g} s") from None
        except StopAsyncIteration:
            await confirm_half_close()
            raise RpcError(Code.INVALID_ARGUMENT, "first message must be config (the stream ended)") from None

    # ------------------------------------------------------------ client -> engine

    async def _read(self, it: AsyncIterator) -> None:
        ended = cancelled = False
        async for msg in it:
            self.last_activity = time.monotonic()
            self.request_seen.set()
            if self.ending or cancelled:  # the session is over: shutdown() decides when to stop
                continue
            try:
                kind = self._forward(msg)
            except RpcError as e:
                # the client's fault ends the started session after the summary of what
                # was spoken; keep reading (and dropping), so that shutdown() can take the
                # client's writes in flight (grpc_drain.REFUSE_READ_S)
                self.end_early(e)
                self.ending = True
                continue
            ended = ended or kind == "end_of_input"
            cancelled = kind == "cancel"
        if ended or cancelled or self.ending:
            return
        await confirm_half_close()
        if not self.ending:  # half-close = end of input
            with handle_errors():
                self.handle.end_input()

    def _forward(self, msg: Any) -> str:
        """One client message to the session handle; returns its kind."""
        handle = self.handle
        assert handle is not None
        kind = decoded(msg).WhichOneof("request")
        # limits, timestamps and ordering are validated by the handle (one place)
        if kind == "text":
            ts: Optional[float] = msg.text.timestamp_s if msg.text.HasField("timestamp_s") else None
            with handle_errors():
                handle.push_text(msg.text.text, ts, msg.text.flush)
        elif kind == "end_of_input":
            with handle_errors():
                handle.end_input()
        elif kind == "cancel":
            handle.cancel()
        elif kind == "config":
            raise RpcError(Code.FAILED_PRECONDITION, "config already received")
        else:
            raise RpcError(Code.INVALID_ARGUMENT, "request has no payload")
        return kind

    # ------------------------------------------------------------ engine -> client

    async def _write(self) -> None:
        while True:
            ev = await self.next_event()
            if isinstance(ev, AudioPacket):
                await self.timed_write(self.context.write(event_to_proto(ev)), ev.duration_s)
            elif isinstance(ev, WordTiming):
                await self.timed_write(self.context.write(event_to_proto(ev)))
            elif isinstance(ev, Finished):
                await self.timed_write(self.context.write(event_to_proto(ev.summary)), last=True)
                self.finish(self.ended(ev))
                return
            elif isinstance(ev, Failed):
                raise failed_error(ev)


def failed_error(ev: Failed) -> RpcError:
    """An engine `Failed` as the status that ends the stream."""
    code = Code.__members__.get(ev.code, Code.INTERNAL)
    return RpcError(Code.INTERNAL if code is Code.OK else code, ev.message, from_engine=True)


@contextlib.contextmanager
def handle_errors() -> Iterator[None]:
    """A `SessionHandle` call's errors as statuses."""
    try:
        yield
    except StateError as e:
        raise RpcError(Code.FAILED_PRECONDITION, str(e)) from None
    except LimitError as e:
        raise RpcError(Code.RESOURCE_EXHAUSTED, str(e)) from None
    except ConfigError as e:
        raise RpcError(Code.INVALID_ARGUMENT, str(e)) from None


class LiveSpeechService:
    """Registered with `protocol.method_handlers(service)`."""

    def __init__(self, config: ServerConfig, engine: EngineAPI, voices: VoiceStore, metrics: Metrics) -> None:
        self.config = config
        self.engine = engine
        self.voices = voices
        self.metrics = metrics
        self.draining = False
        self._streams: set[SessionStream] = set()
        self._open_streams = 0  # admitted under synthesize_stream_limit (not those being refused)
        self._changed = asyncio.Event()

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def tenant_sessions(self, tenant: str) -> int:
        """Engine sessions `tenant` holds now (a stream's slot is held from open_session
        until release)."""
        return sum(s.tenant == tenant and s.handle is not None and not s.released for s in self._streams)

    def check_tenant_quota(self, tenant: str) -> None:
        limit = self.config.max_sessions_per_tenant
        if limit and self.tenant_sessions(tenant) >= limit:
            raise RpcError(
                Code.RESOURCE_EXHAUSTED,
                f"tenant has {limit} sessions open (max_sessions_per_tenant); retry when one ends",
                (("retry-after-ms", str(self.config.retry_after_ms)),),
            )

    # ------------------------------------------------------------ streams of every transport

    def admit(self, stream: SessionStream) -> None:
        """Count a synthesis stream (of any transport) under `synthesize_stream_limit`;
        refused with RpcError while draining or at the limit. `discharge` when it ends."""
        self._streams.add(stream)  # the drain waits for it, refused or not
        if self.draining:
            raise RpcError(Code.UNAVAILABLE, "server is draining")
        limit = self.config.synthesize_stream_limit
        if self._open_streams >= limit:
            raise RpcError(
                Code.RESOURCE_EXHAUSTED,
                f"server has {limit} Synthesize streams open (max_synthesize_streams); retry later or elsewhere",
                (("retry-after-ms", str(self.config.retry_after_ms)),),
            )
        self._open_streams += 1

    def discharge(self, stream: SessionStream, admitted: bool) -> None:
        """`stream` ended: free its slot, stop counting it (`admitted`: it passed `admit`)."""
        if admitted:
            self._open_streams -= 1
        stream.release()
        self._streams.discard(stream)
        self._changed.set()

    async def open_session(self, stream: SessionStream, cfg: SessionConfig, enrollment: Optional[Enrollment]) -> SessionConfig:
        """Resolve the voice and open the engine session of `stream` (its `handle`), under
        the drain, the tenant quota and the engine's capacity; returns the effective config."""
        voice_id, voice = await self.resolve_voice(cfg, enrollment)
        if self.draining:
            raise RpcError(Code.UNAVAILABLE, "server is draining")
        effective = cfg.replace(voice_id=voice_id)
        self.check_tenant_quota(stream.tenant)
        try:
            stream.handle = self.engine.open_session(effective, voice, stream.sink)
        except CapacityError as e:
            stream.capacity_rejected = True  # the engine counted it as a rejected session
            raise RpcError(
                Code.RESOURCE_EXHAUSTED,
                f"server is at capacity ({e or 'no free session slot'}); retry later or elsewhere",
                (("retry-after-ms", str(self.config.retry_after_ms)),),
            ) from None
        except ConfigError as e:
            raise RpcError(Code.INVALID_ARGUMENT, str(e)) from None
        # the client's idle time starts now: a slow opening (the voice, a starved event loop)
        # is the server's, and the client's messages sent meanwhile are still unread
        stream.last_activity = time.monotonic()
        return effective

    # ------------------------------------------------------------ Synthesize

    async def Synthesize(self, request_iterator: AsyncIterator, context: grpc.aio.ServicerContext) -> None:
        stream = _Stream(self, context)
        outcome = "rejected"
        self._streams.add(stream)
        requests = request_iterator.__aiter__()
        admitted = False
        try:
            self.admit(stream)
            admitted = True
            await stream.run(requests)
        except RpcError as e:
            if stream.handle is None:  # refused: no reader task owns the requests
                await stream.discard_requests(requests)
            await self._abort(context, e)
        except asyncio.CancelledError:
            outcome = "disconnected"
            raise
        except Exception:
            log.exception("Synthesize failed")
            await self._abort(context, RpcError(Code.INTERNAL, "internal error"))
        finally:
            stream.close()
            # the engine counts the sessions it admitted or refused for capacity; the
            # streams that never got that far are counted here
            if stream.handle is None and not stream.capacity_rejected:
                self.metrics.sessions_total.labels(outcome=outcome).inc()
            self.discharge(stream, admitted)

    async def resolve_voice(self, cfg: SessionConfig, enrollment: Optional[Enrollment]) -> tuple[str, Voice]:
        try:
            if enrollment is not None:
                x = await asyncio.to_thread(
                    decode_reference,
                    pcm16_le=enrollment.pcm16_le,
                    sample_rate=enrollment.sample_rate,
                    max_seconds=self.config.max_enrollment_seconds,
                    field="enrollment",
                )
                voice = await asyncio.to_thread(self.engine.make_voice, "(inline)", x, MODEL_SAMPLE_RATE)
                return "", voice
            if cfg.voice_id:
                # the id's shape first: a malformed id is the client's mistake, and the
                # NOT_FOUND message would otherwise echo an arbitrarily long string
                check_voice_id(cfg.voice_id)
                return cfg.voice_id, await self.voices.get(cfg.voice_id, current_tenant())
            return await self.voices.default(current_tenant())
        except ConfigError as e:
            raise RpcError(Code.INVALID_ARGUMENT, str(e)) from None
        except VoiceStoreError as e:
            raise RpcError(Code[e.code], str(e)) from None

    async def _abort(self, context: grpc.aio.ServicerContext, e: RpcError) -> None:
        if not e.from_engine:
            self.metrics.errors_total.labels(code=e.code.name).inc()
        try:
            # the status follows the data already queued on the stream: a client that
            # does not read never takes it, so do not wait for that forever (the status
            # stays queued and reaches the client if it ever reads)
            async with asyncio.timeout(ABORT_WAIT_S):  # in this task: grpc wants abort here
                await context.abort(e.code, e.message, trailing_metadata=e.metadata)
        except TimeoutError:
            log.info("status %s not taken by the client within %.0f s", e.code.name, ABORT_WAIT_S)

    # ------------------------------------------------------------ drain

    async def drain(self, grace_s: float) -> int:
        """Refuse new streams; wait up to grace_s for in-flight ones; end the rest with
        UNAVAILABLE. Returns how many had to be ended."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline:
            self._changed.clear()
            try:
                async with asyncio.timeout(deadline - time.monotonic()):
                    await self._changed.wait()
            except asyncio.TimeoutError:
                break
        left = list(self._streams)
        for s in left:
            s.finish(RpcError(Code.UNAVAILABLE, "server is shutting down"))
        for _ in range(100):  # let their handlers send the status
            if not self._streams:
                break
            await asyncio.sleep(0.01)
        return len(left)

    # ------------------------------------------------------------ voices

    async def _unary(self, context: grpc.aio.ServicerContext, coro: Any) -> Any:
        try:
            return await coro
        except RpcError as e:
            await self._abort(context, e)
        except ConfigError as e:
            await self._abort(context, RpcError(Code.INVALID_ARGUMENT, str(e)))
        except VoiceStoreError as e:
            await self._abort(context, RpcError(Code[e.code], str(e)))
        except Exception:  # a bug: a defined status and a log line, not grpc's UNKNOWN
            log.exception("voice RPC failed")
            await self._abort(context, RpcError(Code.INTERNAL, "internal error"))

    async def RegisterVoice(self, request: "pb.RegisterVoiceRequest", context: grpc.aio.ServicerContext) -> Any:
        async def go() -> "pb.VoiceInfo":
            check_voice_id(decoded(request).voice_id)
            which = request.WhichOneof("audio")
            if which is None:
                raise ConfigError("audio: set pcm or wav")
            x = await asyncio.to_thread(
                decode_reference,
                pcm16_le=request.pcm.pcm16_le if which == "pcm" else None,
                sample_rate=request.pcm.sample_rate,
                wav=request.wav if which == "wav" else None,
                max_seconds=self.config.max_enrollment_seconds,
                field=which,
            )
            info = await self.voices.register(request.voice_id, x, overwrite=request.overwrite, tenant=current_tenant())
            return voice_info_to_proto(info)

        return await self._unary(context, go())

    async def ListVoices(self, request: "pb.ListVoicesRequest", context: grpc.aio.ServicerContext) -> Any:
        async def go() -> "pb.ListVoicesResponse":
            decoded(request)
            return pb.ListVoicesResponse(voices=[voice_info_to_proto(v) for v in await self.voices.list(current_tenant())])

        return await self._unary(context, go())

    async def DeleteVoice(self, request: "pb.DeleteVoiceRequest", context: grpc.aio.ServicerContext) -> Any:
        async def go() -> "pb.DeleteVoiceResponse":
            await self.voices.delete(decoded(request).voice_id, current_tenant())
            return pb.DeleteVoiceResponse()

        return await self._unary(context, go())
