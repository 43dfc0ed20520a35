"""The LiveKit Agents TTS plugin (clients/livekit_tts.py) with LiveKit's own stream and
AudioEmitter against a real in-process server: tokens in, PCM frames out (one segment,
the last frame final), each word's aligned `TimedString` riding with the audio it is
spoken in, `synthesize()` for a whole text, and a barge-in (`aclose()` mid-sentence)
that cancels the call and reports what was spoken. Skips without LiveKit Agents
(`pip install '.[livekit]'`)."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("livekit.agents.tts", reason="LiveKit Agents is not installed: pip install '.[livekit]'")

from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT  # noqa: E402

from livespeech.client import livekit_tts  # noqa: E402
from livespeech.client.client import Summary, split_pieces  # noqa: E402
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


def summaries_of(tts: livekit_tts.TTS) -> asyncio.Queue:
    queue: asyncio.Queue = asyncio.Queue()
    tts.on("synthesis_summary", queue.put_nowait)
    return queue


def test_streamed_tokens_become_one_segment_of_pcm_with_aligned_words(srv) -> None:
    async def go():
        tts = livekit_tts.TTS(address=srv.address, sample_rate=RATE, session_options=dict(n_future_chunks=1, **HARD))
        summaries = summaries_of(tts)
        assert tts.capabilities.streaming and tts.capabilities.aligned_transcript
        async with tts.stream() as stream:
            for piece in split_pieces(TEXT):
                stream.push_text(piece)
            stream.end_input()
            events = [ev async for ev in stream]
        summary = await asyncio.wait_for(summaries.get(), 30)
        await tts.aclose()
        return events, summary

    events, summary = asyncio.run(go())
    assert not summary.cancelled and summary.spoken_text == TEXT and summary.all_words_spoken
    assert len(events) > 1 and len({ev.segment_id for ev in events}) == 1
    assert [ev.is_final for ev in events] == [False] * (len(events) - 1) + [True]
    assert all(ev.frame.sample_rate == RATE and ev.frame.num_channels == 1 for ev in events)
    assert sum(ev.frame.duration for ev in events) == pytest.approx(summary.audio_s, abs=0.01)

    words = [w for ev in events for w in ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]
    assert [str(w) for w in words] == [w + " " for w in TEXT.split()]
    starts = [w.start_time for w in words]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert all(w.start_time < w.end_time <= summary.audio_s + 1e-6 for w in words)  # on the segment's timeline
    assert srv.wait_idle()


def test_synthesize_speaks_the_whole_text(fake_srv) -> None:
    async def go():
        tts = livekit_tts.TTS(address=fake_srv.address, sample_rate=RATE)
        summaries = summaries_of(tts)
        async with tts.synthesize(TEXT) as chunked:
            frame = await chunked.collect()
        summary = await asyncio.wait_for(summaries.get(), 30)
        await tts.aclose()
        return frame, summary

    frame, summary = asyncio.run(go())
    assert summary.spoken_text == TEXT and not summary.cancelled
    assert frame.sample_rate == RATE and frame.duration == pytest.approx(summary.audio_s, abs=0.01)
    assert fake_srv.wait_idle()


def test_closing_the_stream_mid_sentence_cancels_and_reports_what_was_spoken(fake_srv) -> None:
    async def go():
        tts = livekit_tts.TTS(address=fake_srv.address, sample_rate=RATE, session_options=dict(n_future_chunks=1))
        summaries = summaries_of(tts)
        stream = tts.stream()
        stream.push_text(" ".join(LONG_WORDS) + " ")  # no end of input: the LLM is still writing
        heard = []
        async for ev in stream:
            heard += ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])
            if heard:
                break
        await stream.aclose()  # what LiveKit does at barge-in
        summary = await asyncio.wait_for(summaries.get(), 30)
        await tts.aclose()
        return heard, summary

    heard, summary = asyncio.run(go())
    assert isinstance(summary, Summary) and summary.cancelled and not summary.all_words_spoken
    spoken = summary.spoken_text.split()
    assert 0 < len(spoken) < len(LONG_WORDS) and spoken == LONG_WORDS[: len(spoken)]
    assert [str(w).strip() for w in heard] == spoken[: len(heard)]
    assert fake_srv.wait_idle()
