"""LiveSpeech as a pipecat TTS service (`pip install 'livespeech[pipecat]'`).

    from livespeech.client.pipecat_tts import LiveSpeechTTSService

    tts = LiveSpeechTTSService(address="127.0.0.1:50051", voice_id="default")
    pipeline = Pipeline([transport.input(), stt, user_agg, llm, tts, transport.output(), assistant_agg])

How pipecat's turn maps onto the server:
- text: the LLM's tokens go out as they come (`TextAggregationMode.TOKEN`, the default;
  the server takes sub-word pieces and keeps its own lookahead). With
  `TextAggregationMode.SENTENCE` each sentence the aggregator releases is sent with a
  flush, so it is spoken without waiting for the next one.
- one `Synthesize` stream per turn (per pipecat context); the end of the turn
  (`flush_audio`) is the stream's end of input.
- audio: `TTSStartedFrame`, `TTSAudioRawFrame`s at the pipeline's output rate, then
  `TTSStoppedFrame` when the server's summary arrives.
- words: each `WordTiming` goes to pipecat's word-timestamp API, which pushes a
  `TTSTextFrame` per word as its audio plays (so the assistant context holds what was
  heard).
- interruption: the turn's stream is cancelled; the server answers with a cancelled
  summary of what it had spoken. So is a stream whose audio context pipecat already
  closed because its audio went quiet (`stop_frame_timeout_s`: the LLM paused) while
  the stream stayed open: pipecat no longer interrupts that context itself. Every summary (cancelled or not) is reported to the
  `on_synthesis_summary(service, context_id, summary)` event handler.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any, Optional

try:
    from loguru import logger
    from pipecat.frames.frames import (CancelFrame, EndFrame, Frame, InterruptionFrame, StartFrame, TTSAudioRawFrame,
                                       TTSStoppedFrame)
    from pipecat.processors.frame_processor import FrameDirection
    from pipecat.services.settings import TTSSettings
    from pipecat.services.tts_service import TextAggregationMode, TTSService
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"livespeech.client.pipecat_tts needs pipecat ({e.name} is missing): pip install 'livespeech[pipecat]'"
    ) from e

import grpc

from livespeech.api.session import SAMPLE_RATES, SessionConfig

from .client import (DEFAULT_TARGET, AsyncLiveSpeechClient, AudioPacket, ServerConnection, SynthesisSession, Summary,
                     WordTiming)

# asked of the server when the pipeline's output rate is not one it makes; resampled here
FALLBACK_RATE = 24000


class LiveSpeechTTSService(TTSService):
    """A pipecat TTS service speaking through a LiveSpeech server over gRPC.

    `address`, `token`, `tls_ca` reach the server (or pass a ready `client`, an
    `AsyncLiveSpeechClient` made on the pipeline's loop); `voice_id` (also pipecat's
    runtime `voice` setting: it applies from the next turn); `session_config` and
    `session_options` (`SessionConfig` fields: `n_future_chunks`, `max_buffer_delay_ms`,
    `packet_ms`, ...) shape every stream. Other keywords go to pipecat's `TTSService`.
    """

    Settings = TTSSettings
    _settings: TTSSettings

    def __init__(
        self,
        *,
        address: str = DEFAULT_TARGET,
        voice_id: Optional[str] = None,
        client: Optional[AsyncLiveSpeechClient] = None,
        token: Optional[str] = None,
        tls_ca: Optional[str] = None,
        session_config: Optional[SessionConfig] = None,
        session_options: Optional[dict[str, Any]] = None,
        sample_rate: Optional[int] = None,
        text_aggregation_mode: TextAggregationMode = TextAggregationMode.TOKEN,
        settings: Optional[TTSSettings] = None,
        **kwargs: Any,
    ) -> None:
        store = TTSSettings(model=None, voice=voice_id, language=None)
        if settings is not None:
            store.apply_update(settings)
        kwargs.setdefault("append_trailing_space", True)  # sentence mode: "Hi." + "Yes." keep their space
        super().__init__(
            text_aggregation_mode=text_aggregation_mode,
            push_text_frames=False,  # TTSTextFrames come from the word timestamps
            push_start_frame=True,
            pause_frame_processing=False,
            sample_rate=sample_rate,
            settings=store,
            **kwargs,
        )
        self._server = ServerConnection(address, client, token, tls_ca, session_config, session_options)
        self._sessions: dict[str, SynthesisSession] = {}  # context id -> its open stream
        # contexts pipecat closed (quiet for stop_frame_timeout_s) whose stream is still open
        self._quiet: set[str] = set()
        self._readers: set[asyncio.Task] = set()
        self._register_event_handler("on_synthesis_summary")

    def can_generate_metrics(self) -> bool:
        return True

    @property
    def supports_processing_metrics(self) -> bool:
        return False  # run_tts hands the text over; the audio arrives on a reader task

    @property
    def server_sample_rate(self) -> int:
        """The rate asked of the server: the pipeline's when the server makes it."""
        return self.sample_rate if self.sample_rate in SAMPLE_RATES else FALLBACK_RATE

    # -------------------------------------------------------------- lifecycle

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        self._server.client()

    async def stop(self, frame: EndFrame) -> None:
        await super().stop(frame)  # plays out the contexts still queued
        await self._close()

    async def cancel(self, frame: CancelFrame) -> None:
        await super().cancel(frame)
        await self._close()

    async def cleanup(self) -> None:
        await super().cleanup()
        await self._close()

    async def _close(self) -> None:
        for session in self._sessions.values():
            session.abort()
        self._sessions.clear()
        for task in list(self._readers):
            await self.cancel_task(task)
        await self._server.close()

    # -------------------------------------------------------------- text in

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        session = self._sessions.get(context_id)
        if session is None:
            session = self._open(context_id)
        elif not session.accepting_text:
            logger.warning(f"{self}: text for context {context_id} after its end of input dropped: [{text}]")
            yield None
            return
        await session.send(text, flush=not self._is_streaming_tokens)
        await self.start_tts_usage_metrics(text)
        yield None  # the audio comes from the reader task

    def _open(self, context_id: str) -> SynthesisSession:
        options = {"voice_id": self._settings.voice} if self._settings.voice else {}
        session = self._server.session(self.server_sample_rate, **options)
        self._sessions[context_id] = session
        task = self.create_task(self._read(context_id, session), name=f"livespeech-{context_id}")
        self._readers.add(task)
        task.add_done_callback(self._readers.discard)
        return session

    async def flush_audio(self, context_id: Optional[str] = None) -> None:
        """The end of the turn: end of input for its stream."""
        session = self._sessions.get(context_id or self.get_active_audio_context_id() or "")
        if session is not None:
            await session.end()

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        """Barge-in: cancel the turn's stream (the server reports what it spoke)."""
        await self.stop_all_metrics()
        session = self._sessions.get(context_id)
        if session is not None:
            await session.cancel()
        await super().on_audio_context_interrupted(context_id)

    async def on_audio_context_completed(self, context_id: str) -> None:
        if context_id in self._sessions:
            self._quiet.add(context_id)
        await super().on_audio_context_completed(context_id)

    async def _handle_interruption(self, frame: InterruptionFrame, direction: FrameDirection) -> None:
        await super()._handle_interruption(frame, direction)  # the live contexts: on_audio_context_interrupted
        for context_id in list(self._quiet):
            session = self._sessions.get(context_id)
            if session is not None:
                await session.cancel()
        self._quiet.clear()

    # -------------------------------------------------------------- audio out

    async def _read(self, context_id: str, session: SynthesisSession) -> None:
        in_rate = self.server_sample_rate
        try:
            async for event in session:
                if isinstance(event, AudioPacket):
                    await self.stop_ttfb_metrics()
                    audio = event.data
                    if in_rate != self.sample_rate:
                        audio = await self._resampler.resample(audio, in_rate, self.sample_rate)
                    frame = TTSAudioRawFrame(audio, self.sample_rate, 1, context_id=context_id)
                    await self.append_to_audio_context(context_id, frame)
                elif isinstance(event, WordTiming):
                    await self.add_word_timestamps([(event.word, event.start_s)], context_id)
                elif isinstance(event, Summary):
                    await self._call_event_handler("on_synthesis_summary", context_id, event)
                    await self._end_context(context_id)
        except grpc.aio.AioRpcError as e:
            await self.push_error(error_msg=f"LiveSpeech {e.code().name}: {e.details()}", exception=e)
            await self._end_context(context_id)
        finally:
            if self._sessions.get(context_id) is session:
                del self._sessions[context_id]
                self._quiet.discard(context_id)

    async def _end_context(self, context_id: str) -> None:
        if self.audio_context_available(context_id):  # gone once interrupted
            await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
            await self.remove_audio_context(context_id)
