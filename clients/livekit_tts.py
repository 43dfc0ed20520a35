"""LiveSpeech as a LiveKit Agents TTS plugin (`pip install 'livespeech[livekit]'`).

    from livespeech.client import livekit_tts

    session = AgentSession(stt=..., llm=..., tts=livekit_tts.TTS(address="127.0.0.1:50051"),
                           use_tts_aligned_transcript=True)

Capabilities: `streaming` (`stream()`: the LLM's tokens go to one `Synthesize` stream as
they come; `flush()` speaks what was sent without waiting for more lookahead,
`end_input()` is the stream's end of input) and `aligned_transcript` (each word's
`TimedString`, on the segment's audio timeline, rides with the audio through the
`AudioEmitter`). `synthesize(text)` is the same stream with all of the text at once.

Barge-in: LiveKit closes the stream (`aclose()`); the call is cancelled and the server
answers with a cancelled summary of what it had spoken. Every summary (cancelled or not)
is emitted as the `"synthesis_summary"` event: `tts.on("synthesis_summary", callback)`.

Retries: the client's `RetryPolicy` (refusals before the session started, honouring the
server's `retry-after-ms`); errors reach LiveKit as final (`retryable=False`), so a call
is never replayed twice over.
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional

try:
    from livekit.agents import (
        DEFAULT_API_CONNECT_OPTIONS,
        APIConnectionError,
        APIConnectOptions,
        APIStatusError,
        APITimeoutError,
        tts,
        utils,
    )
    from livekit.agents.types import TimedString
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"livespeech.client.livekit_tts needs LiveKit Agents ({e.name} is missing): pip install 'livespeech[livekit]'"
    ) from e

import grpc

from livespeech.api.session import SAMPLE_RATES, SessionConfig

from .client import (DEFAULT_TARGET, AsyncLiveSpeechClient, AudioPacket, ServerConnection, SynthesisSession, Summary,
                     WordTiming)

# how long a cancelled call may take to answer with its summary before it is hung up
CANCEL_REPORT_TIMEOUT_S = 10.0
# a gRPC status as the HTTP status LiveKit's errors carry
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.INTERNAL: 500,
}

def api_error(error: grpc.aio.AioRpcError) -> Exception:
    """A gRPC status as LiveKit's API error (final: the client already retried)."""
    message = f"LiveSpeech {error.code().name}: {error.details()}"
    if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        return APITimeoutError(message, retryable=False)
    if error.code() is grpc.StatusCode.UNAVAILABLE:
        return APIConnectionError(message, retryable=False)
    return APIStatusError(message, status_code=_HTTP_STATUS.get(error.code(), 500), retryable=False)


class TTS(tts.TTS):
    """`address`, `token`, `tls_ca` reach the server (or pass a ready `client`, an
    `AsyncLiveSpeechClient` made on the agent's loop); `voice_id`; `sample_rate` (8000,
    16000, 24000 or 48000); `session_config` and `session_options` (`SessionConfig`
    fields: `n_future_chunks`, `max_buffer_delay_ms`, `packet_ms`, ...) shape every
    stream."""

    def __init__(
        self,
        *,
        address: str = DEFAULT_TARGET,
        voice_id: Optional[str] = None,
        sample_rate: int = 24000,
        client: Optional[AsyncLiveSpeechClient] = None,
        token: Optional[str] = None,
        tls_ca: Optional[str] = None,
        session_config: Optional[SessionConfig] = None,
        session_options: Optional[dict[str, Any]] = None,
    ) -> None:
        if sample_rate not in SAMPLE_RATES:
            raise ValueError(f"sample_rate must be one of {SAMPLE_RATES}, got {sample_rate}")
        super().__init__(
            capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=True),
            sample_rate=sample_rate,
            num_channels=1,
        )
        self._server = ServerConnection(address, client, token, tls_ca, session_config, session_options)
        if voice_id:
            self._server.options["voice_id"] = voice_id
        self._tasks: set[asyncio.Task] = set()  # readers and cancels, outliving a closed stream

    @property
    def model(self) -> str:
        return "livespeech-2"

    @property
    def provider(self) -> str:
        return "livespeech"

    def update_options(self, *, voice_id: Optional[str] = None) -> None:
        """Change the voice from the next stream on."""
        if voice_id:
            self._server.options["voice_id"] = voice_id

    def synthesize(self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> "ChunkedStream":
        return ChunkedStream(tts=self, input_text=text, conn_options=conn_options)

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> "SynthesizeStream":
        return SynthesizeStream(tts=self, conn_options=conn_options)

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=CANCEL_REPORT_TIMEOUT_S)
        for task in list(self._tasks):
            task.cancel()
        await self._server.close()

    # -------------------------------------------------------------- sessions

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _open(self) -> tuple[SynthesisSession, asyncio.Queue]:
        """A session and the queue its reader fills (events, a gRPC error, then None). The reader is this object's task,
        not the stream's: grpc cancels a call whose read is cancelled, and a stream
        closed at barge-in must leave the call open for the cancel and its summary."""
        session = self._server.session(self.sample_rate)
        events: asyncio.Queue = asyncio.Queue()
        self._spawn(self._read(session, events))
        return session, events

    async def _read(self, session: SynthesisSession, events: asyncio.Queue) -> None:
        try:
            async for event in session:
                if isinstance(event, Summary):
                    self.emit("synthesis_summary", event)
                events.put_nowait(event)
        except grpc.aio.AioRpcError as e:
            events.put_nowait(e)
        finally:
            events.put_nowait(None)

    def _hang_up(self, session: SynthesisSession) -> None:
        """Cancel a session whose stream closed before its end (barge-in): the reader
        then reports the cancelled summary; a server that does not answer is hung up."""

        async def cancel() -> None:
            try:
                async with asyncio.timeout(CANCEL_REPORT_TIMEOUT_S):
                    await session.cancel()
            except TimeoutError:
                session.abort()

        self._spawn(cancel())


async def _play(events: asyncio.Queue, emitter: tts.AudioEmitter) -> None:
    """Audio and word timings into the emitter until the session ends."""
    while (event := await events.get()) is not None:
        if isinstance(event, grpc.aio.AioRpcError):
            raise api_error(event) from event
        if isinstance(event, AudioPacket):
            emitter.push(event.data)
        elif isinstance(event, WordTiming):
            emitter.push_timed_transcript(TimedString(event.word + " ", start_time=event.start_s, end_time=event.end_s))


class ChunkedStream(tts.ChunkedStream):
    """`synthesize(text)`: the whole text, then end of input, on one stream."""

    def __init__(self, *, tts: TTS, input_text: str, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._livespeech = tts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(
            request_id=utils.shortuuid(), sample_rate=self._livespeech.sample_rate, num_channels=1,
            mime_type="audio/pcm",
        )
        session, events = self._livespeech._open()
        ended = False
        try:
            await session.send(self._input_text)
            await session.end()
            await _play(events, output_emitter)
            ended = True
        finally:
            if not ended:
                self._livespeech._hang_up(session)
        output_emitter.flush()


class SynthesizeStream(tts.SynthesizeStream):
    """`stream()`: tokens pushed as they come, one segment per stream."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._livespeech = tts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        request_id = utils.shortuuid()
        output_emitter.initialize(
            request_id=request_id, sample_rate=self._livespeech.sample_rate, num_channels=1,
            mime_type="audio/pcm", stream=True,
        )
        output_emitter.start_segment(segment_id=request_id)
        session, events = self._livespeech._open()

        async def send_text() -> None:
            async for data in self._input_ch:
                if isinstance(data, self._FlushSentinel):
                    await session.flush()
                else:
                    self._mark_started()
                    await session.send(data)
            await session.end()

        sender = asyncio.create_task(send_text())
        ended = False
        try:
            await _play(events, output_emitter)
            ended = True
        finally:
            await utils.aio.cancel_and_wait(sender)
            if not ended:
                self._livespeech._hang_up(session)
        output_emitter.end_segment()
