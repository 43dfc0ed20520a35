"""The pipecat TTS service (clients/pipecat_tts.py) in a real pipecat pipeline against a
real in-process server: an LLM turn of sub-word tokens in, frames out in pipecat's order
(started, audio, per-word text frames timed by the server's word timestamps, stopped,
the end of the turn), and a barge-in mid-sentence that cancels the stream, reports what
was spoken and leaves the service ready for the next turn. Skips without pipecat
(`pip install '.[pipecat]'`)."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("pipecat.services.tts_service", reason="pipecat is not installed: pip install '.[pipecat]'")

from pipecat.frames.frames import (  # noqa: E402
    EndFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.worker import PipelineParams, PipelineWorker  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402

from livespeech.client.client import Summary, split_pieces  # noqa: E402
from livespeech.client.pipecat_tts import LiveSpeechTTSService, TextAggregationMode  # noqa: E402
from conftest import HARD  # noqa: E402

TEXT = "Hello there, this is a streaming test."
RATE = 16000
LONG_WORDS = [f"word{i}" for i in range(300)]


@pytest.fixture(scope="module")
def srv(server_factory):
    return server_factory(max_sessions=2)


@pytest.fixture(scope="module")
def fake_srv(server_factory):
    return server_factory(fake=True, max_sessions=2)


class Recorder(FrameProcessor):
    """The end of the pipeline: keeps every downstream frame, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[Frame] = []
        self.audio = asyncio.Event()
        self.turn_ended = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM and not isinstance(frame, (StartFrame, EndFrame)):
            self.frames.append(frame)
            if isinstance(frame, TTSAudioRawFrame):
                self.audio.set()
            elif isinstance(frame, LLMFullResponseEndFrame):
                self.turn_ended.set()
        await self.push_frame(frame, direction)


async def run_pipeline(tts: LiveSpeechTTSService, script) -> Recorder:
    """Run [tts, recorder] while `script(worker, recorder)` drives it, then end it."""
    recorder = Recorder()
    worker = PipelineWorker(
        Pipeline([tts, recorder]), params=PipelineParams(audio_out_sample_rate=RATE), cancel_on_idle_timeout=False,
        enable_rtvi=False,
    )
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def on_started(worker, frame):
        started.set()

    async def drive() -> None:
        try:
            await asyncio.wait_for(started.wait(), 10)
            await asyncio.wait_for(script(worker, recorder), 30)
        except BaseException:
            await worker.cancel()  # else the pipeline runs on and the test hangs instead of failing
            raise
        await worker.queue_frame(EndFrame())

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await asyncio.gather(runner.run(), drive())
    return recorder


def summaries_of(tts: LiveSpeechTTSService) -> tuple[list[Summary], asyncio.Queue]:
    got: list[Summary] = []
    queue: asyncio.Queue = asyncio.Queue()

    @tts.event_handler("on_synthesis_summary")
    async def on_summary(service, context_id, summary):
        got.append(summary)
        queue.put_nowait(summary)

    return got, queue


async def llm_turn(worker: PipelineWorker, text: str, *, end: bool = True) -> None:
    await worker.queue_frame(LLMFullResponseStartFrame())
    for piece in split_pieces(text):
        await worker.queue_frame(LLMTextFrame(piece))
    if end:
        await worker.queue_frame(LLMFullResponseEndFrame())


def kinds(frames: list[Frame], types: tuple) -> list[type]:
    return [type(f) for f in frames if isinstance(f, types)]


def test_a_turn_of_tokens_becomes_started_audio_timed_words_stopped_in_order(srv) -> None:
    async def go():
        tts = LiveSpeechTTSService(address=srv.address, session_options=dict(n_future_chunks=1, **HARD))
        summaries, queue = summaries_of(tts)

        async def script(worker, recorder):
            await llm_turn(worker, TEXT)
            await queue.get()
            await recorder.turn_ended.wait()

        return await run_pipeline(tts, script), summaries

    recorder, summaries = asyncio.run(go())
    frames = recorder.frames
    tts_kinds = kinds(frames, (LLMFullResponseStartFrame, TTSStartedFrame, TTSAudioRawFrame, TTSStoppedFrame,
                               LLMFullResponseEndFrame))
    audio_n = tts_kinds.count(TTSAudioRawFrame)
    assert audio_n > 1
    assert tts_kinds == [LLMFullResponseStartFrame, TTSStartedFrame] + [TTSAudioRawFrame] * audio_n + [
        TTSStoppedFrame, LLMFullResponseEndFrame]

    start = next(i for i, f in enumerate(frames) if isinstance(f, TTSStartedFrame))
    stop = next(i for i, f in enumerate(frames) if isinstance(f, TTSStoppedFrame))
    words = [f for f in frames if isinstance(f, TTSTextFrame)]
    assert all(start < frames.index(w) < stop for w in words)
    assert [w.text for w in words] == TEXT.split()
    pts = [w.pts for w in words]
    assert all(p is not None for p in pts) and pts == sorted(pts) and len(set(pts)) == len(pts)

    (summary,) = summaries
    assert not summary.cancelled and summary.spoken_text == TEXT and summary.all_words_spoken
    audio = [f for f in frames if isinstance(f, TTSAudioRawFrame)]
    assert all(f.sample_rate == RATE and f.num_channels == 1 for f in audio)
    assert sum(len(f.audio) for f in audio) / 2 / RATE == pytest.approx(summary.audio_s, abs=0.01)
    assert srv.wait_idle()


def test_barge_in_mid_sentence_cancels_the_stream_and_the_next_turn_is_spoken(fake_srv) -> None:
    async def go():
        tts = LiveSpeechTTSService(address=fake_srv.address, session_options=dict(n_future_chunks=1))
        summaries, queue = summaries_of(tts)
        marks = {}

        async def script(worker, recorder):
            await llm_turn(worker, " ".join(LONG_WORDS) + " ", end=False)  # the LLM is still writing
            await recorder.audio.wait()
            marks["interrupt"] = len(recorder.frames)
            await worker.queue_frame(InterruptionFrame())
            await queue.get()  # the cancelled stream's summary
            marks["second"] = len(recorder.frames)
            await llm_turn(worker, "Still here.")
            await queue.get()
            await recorder.turn_ended.wait()

        return await run_pipeline(tts, script), summaries, marks

    recorder, summaries, marks = asyncio.run(go())
    frames = recorder.frames
    cancelled, second = summaries
    assert cancelled.cancelled and not cancelled.all_words_spoken
    spoken = cancelled.spoken_text.split()
    assert 0 < len(spoken) < len(LONG_WORDS) and spoken == LONG_WORDS[: len(spoken)]

    barge_in = next(i for i, f in enumerate(frames) if isinstance(f, InterruptionFrame))
    assert barge_in >= marks["interrupt"]
    first_turn, after = frames[:barge_in], frames[barge_in + 1 : marks["second"]]
    # nothing of the interrupted turn comes out after the barge-in: no audio, no words, no stop
    assert not any(isinstance(f, (TTSAudioRawFrame, TTSTextFrame, TTSStoppedFrame)) for f in after)
    heard = [f.text for f in first_turn if isinstance(f, TTSTextFrame)]
    assert heard == spoken[: len(heard)]  # the words pipecat heard were spoken, in order

    assert not second.cancelled and second.spoken_text == "Still here."
    second_turn = frames[marks["second"] :]
    assert kinds(second_turn, (TTSStartedFrame, TTSStoppedFrame, LLMFullResponseEndFrame)) == [
        TTSStartedFrame, TTSStoppedFrame, LLMFullResponseEndFrame]
    assert [f.text for f in second_turn if isinstance(f, TTSTextFrame)] == ["Still", "here."]
    assert fake_srv.wait_idle()


def test_barge_in_after_the_turn_went_quiet_cancels_its_open_stream(fake_srv) -> None:
    """The LLM pauses after "Hi there." without ending its turn: pipecat closes the audio
    context once its audio has been quiet for stop_frame_timeout_s, while the stream stays
    open for more text. A barge-in then still cancels that stream (pipecat no longer
    interrupts the closed context): the server reports a cancelled summary at once
    instead of holding the session until its idle timeout."""
    async def go():
        tts = LiveSpeechTTSService(address=fake_srv.address, stop_frame_timeout_s=0.5,
                                   session_options=dict(n_future_chunks=0))
        summaries, queue = summaries_of(tts)

        async def script(worker, recorder):
            await llm_turn(worker, "Hi there. ", end=False)
            await recorder.audio.wait()
            for _ in range(200):  # pipecat closes the quiet context
                if not tts.get_audio_contexts():
                    break
                await asyncio.sleep(0.02)
            assert not tts.get_audio_contexts() and len(tts._sessions) == 1
            await worker.queue_frame(InterruptionFrame())
            await asyncio.wait_for(queue.get(), 5)

        return await run_pipeline(tts, script), summaries

    _, summaries = asyncio.run(go())
    assert len(summaries) == 1 and summaries[0].cancelled
    assert summaries[0].spoken_text == "Hi there."
    assert fake_srv.wait_idle()


def test_sentence_aggregation_sends_each_sentence_with_its_space_on_one_stream(fake_srv) -> None:
    text = "First one here. Second one there."

    async def go():
        tts = LiveSpeechTTSService(address=fake_srv.address, text_aggregation_mode=TextAggregationMode.SENTENCE,
                                   session_options=dict(n_future_chunks=1))
        summaries, queue = summaries_of(tts)

        async def script(worker, recorder):
            await llm_turn(worker, text)
            await queue.get()
            await recorder.turn_ended.wait()

        return await run_pipeline(tts, script), summaries

    recorder, summaries = asyncio.run(go())
    (summary,) = summaries  # one stream for the turn's two sentences
    assert summary.spoken_text == text and not summary.cancelled
    assert [f.text for f in recorder.frames if isinstance(f, TTSTextFrame)] == text.split()
    assert fake_srv.wait_idle()
