"""The push-style client session (`SynthesisSession` and its sync twin) against a real
in-process server: text pushed in pieces, flush, end, cancel, and the retry rule (a
refusal before `Started` is retried, honouring `retry-after-ms`; an error after audio
began is raised)."""
from __future__ import annotations

import asyncio
import random
import socket

import grpc
import pytest

from livespeech.client import (
    AsyncLiveSpeechClient,
    AudioPacket,
    LiveSpeechClient,
    RetryPolicy,
    Started,
    Summary,
    SynthesisResult,
    WordTiming,
)
from livespeech.client.client import split_pieces
from conftest import HARD

C = grpc.StatusCode
TEXT = "Hello there, this is a streaming test."
FIRST, REST = "Hello there,", " this is a streaming test."
RETRY_AFTER_MS = 50


@pytest.fixture(scope="module")
def srv(server_factory):
    return server_factory(max_sessions=2)


@pytest.fixture(scope="module")
def fake_srv(server_factory):
    return server_factory(fake=True, max_sessions=4)


def test_pieces_with_flush_and_end_give_audio_words_and_summary(srv) -> None:
    async def go():
        async with AsyncLiveSpeechClient(srv.address) as client:
            async with client.session(n_future_chunks=1, **HARD) as session:
                for piece in split_pieces(FIRST):
                    await session.send(piece)
                await session.flush()
                for piece in split_pieces(REST):
                    await session.send(piece)
                await session.end()
                events = [ev async for ev in session]
                return events, session.client_ttfa_s

    events, ttfa = srv.run(go())
    assert isinstance(events[0], Started) and isinstance(events[-1], Summary)
    r = SynthesisResult()
    for ev in events:
        r.add(ev)
    assert not r.summary.cancelled and r.summary.spoken_text == TEXT
    assert r.packets and [p.seq for p in r.packets] == list(range(len(r.packets)))
    for a, b in zip(r.packets, r.packets[1:]):
        assert b.start_s == pytest.approx(a.start_s + a.duration_s)
    assert [w.word for w in r.words] == TEXT.split()
    assert ttfa is not None and ttfa > 0
    assert srv.wait_idle()


def test_cancel_while_audio_streams_ends_with_a_cancelled_summary(fake_srv) -> None:
    words = [f"word{i}" for i in range(400)]

    async def go():
        async with AsyncLiveSpeechClient(fake_srv.address) as client:
            session = client.session(n_future_chunks=1)
            for w in words:
                await session.send(w + " ")
            await session.end()  # the write side stays open: a barge-in still reaches the server
            events = []
            async for ev in session:  # ends without an error
                events.append(ev)
                if isinstance(ev, AudioPacket) and ev.seq == 1:
                    await session.cancel()
                    await session.send("too late ")  # dropped: the session is cancelled
            return events

    events = fake_srv.run(go())
    summary = events[-1]
    assert isinstance(summary, Summary) and summary.cancelled
    assert summary.spoken_text.startswith("word0") and words[-1] not in summary.spoken_text
    assert "too late" not in summary.spoken_text and not summary.all_words_spoken
    assert sum(isinstance(ev, Summary) for ev in events) == 1
    assert fake_srv.wait_idle()


def test_sync_session_pushes_text_and_iterates_events(fake_srv) -> None:
    with LiveSpeechClient(fake_srv.address) as client:
        with client.session(n_future_chunks=1, sample_rate=16000) as session:
            for piece in split_pieces(TEXT):
                session.send(piece)
            session.flush()
            session.end()
            events = list(session)
    assert isinstance(events[0], Started) and events[0].config.sample_rate == 16000
    assert any(isinstance(ev, AudioPacket) for ev in events)
    assert [ev.word for ev in events if isinstance(ev, WordTiming)] == TEXT.split()
    assert isinstance(events[-1], Summary) and events[-1].spoken_text == TEXT
    assert fake_srv.wait_idle()


def test_capacity_refusal_is_retried_after_retry_after_and_replays_the_text(server_factory) -> None:
    h = server_factory(fake=True, max_sessions=1, retry_after_ms=RETRY_AFTER_MS)
    retry = RetryPolicy(attempts=50, backoff_s=0.01)

    async def go():
        async with AsyncLiveSpeechClient(h.address, retry=retry) as client:
            holder = client.session(n_future_chunks=1)
            await holder.send("one two three")  # waits for lookahead: holds the only slot
            assert isinstance(await holder.__anext__(), Started)

            waiting = client.session(n_future_chunks=1)
            await waiting.send(FIRST)
            result = asyncio.ensure_future(waiting.collect())
            async with asyncio.timeout(30):
                while not waiting.refusals:
                    await asyncio.sleep(0.01)
            await waiting.send(REST)  # sent between attempts: replayed with the rest
            await waiting.end()
            await holder.end()
            held = await holder.collect()
            return held, await result, waiting.refusals

    held, result, refusals = h.run(go())
    assert held.summary is not None and held.summary.spoken_text == "one two three"
    assert result.started is not None and result.summary is not None and not result.summary.cancelled
    assert result.summary.spoken_text == TEXT and result.audio
    assert refusals and all(r.code == C.RESOURCE_EXHAUSTED for r in refusals)
    assert all(r.retry_after_s == RETRY_AFTER_MS / 1000 and r.delay_s >= r.retry_after_s for r in refusals)
    assert h.wait_idle()


def test_unavailable_after_audio_began_is_raised_not_retried(server_factory) -> None:
    h = server_factory(fake=True)

    async def go():
        async with AsyncLiveSpeechClient(h.address, retry=RetryPolicy(attempts=10)) as client:
            session = client.session(n_future_chunks=1)
            await session.send("one two three four ")  # no end: the last words wait for lookahead
            events = []
            async for ev in session:
                events.append(ev)
                if isinstance(ev, AudioPacket):
                    break
            await h.app.service.drain(0.0)  # ends the streams in flight with UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for ev in session:
                    events.append(ev)
            return e.value, events, session.refusals, [ev async for ev in session]

    error, events, refusals, after = h.run(go())
    assert error.code() == C.UNAVAILABLE and "shutting down" in error.details()
    assert isinstance(events[0], Started) and any(isinstance(ev, AudioPacket) for ev in events)
    assert refusals == [] and after == []
    assert len(h.engine.opened) == 1


def test_unavailable_before_started_is_retried_then_raised() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go():
        async with AsyncLiveSpeechClient(f"127.0.0.1:{port}", retry=RetryPolicy(attempts=3, backoff_s=0.01)) as client:
            session = client.session()
            await session.send("hello")
            await session.end()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await session.collect()
            return e.value.code(), session.refusals

    code, refusals = asyncio.run(go())
    assert code == C.UNAVAILABLE
    assert [r.code for r in refusals] == [C.UNAVAILABLE] * 2  # 3 attempts: 2 retried, the last raised
    assert all(r.retry_after_s is None for r in refusals)


def test_retry_wait_is_capped_backoff_and_never_shorter_than_retry_after() -> None:
    policy = RetryPolicy(backoff_s=0.1, multiplier=2.0, max_backoff_s=0.5, jitter=0.2)
    rng = random.Random(0)
    for retry, (low, high) in enumerate([(0.1, 0.12), (0.2, 0.24), (0.4, 0.48), (0.5, 0.6), (0.5, 0.6)]):
        assert low <= policy.delay_s(retry, None, rng) <= high
    assert 2.0 <= policy.delay_s(0, 2.0, rng) <= 2.4  # the server's hint wins over a shorter backoff
    assert 0.4 <= policy.delay_s(2, 0.05, rng) <= 0.48
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)


def test_the_text_limit_error_carries_the_summary_of_what_was_spoken(server_factory) -> None:
    """Over its text limit a session ends with a summary, then RESOURCE_EXHAUSTED: the sync
    client raises the error with that summary (`error.summary`) and what it received
    (`error.result`). The last word is still being written when the limit is reached,
    and no buffer delay releases it: unspoken."""
    h = server_factory(max_sessions=1, max_session_text_chars=40, max_text_piece_chars=40)
    text = "one two three four five six seven eight nine ten eleven twelve"
    accepted = text[:40].split()  # the pieces up to the limit: "one" ... "eight"
    with LiveSpeechClient(h.address) as client:
        with pytest.raises(grpc.RpcError) as e:
            client.synthesize_to_result(split_pieces(text), max_buffer_delay_ms=0, **HARD)
    error = e.value
    assert error.code() == C.RESOURCE_EXHAUSTED and "max_session_text_chars" in error.details()
    s = error.summary
    assert s is not None and not s.cancelled and s.all_words_spoken is False and s.unspoken_words[-1] == "eight"
    unspoken = list(s.unspoken_words)
    assert unspoken == accepted[len(accepted) - len(unspoken):]
    assert len(s.spoken_text.split()) + len(unspoken) in (len(accepted), len(accepted) + 1)
    assert error.result.summary == s and error.result.started is not None
    assert h.wait_idle()
