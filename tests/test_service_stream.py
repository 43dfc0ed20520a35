"""Synthesize over a real gRPC channel: audio, packets, words, concurrency, cancel, hang-up."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from livespeech.client.client import AsyncLiveSpeechClient, SynthesisResult, TextPiece, llm_stream
from conftest import END, HARD, config_msg, raw_synthesize, text_msg
from livespeech.api.protocol import pb
from livespeech.api.session import AudioPacket, Encoding

TEXT = "Hello there, this is a streaming test."


@pytest.fixture(scope="module")
def srv(server_factory):
    return server_factory(max_sessions=8)


def check_packets(r: SynthesisResult, rate: int, encoding: Encoding, packet_ms: int, min_packet_ms: int = 20) -> None:
    assert r.summary is not None and not r.summary.cancelled
    assert r.started.config.sample_rate == rate and r.started.config.encoding is encoding
    assert r.packets, "no audio"
    width = 2 if encoding is Encoding.PCM16 else 1
    n = rate * packet_ms // 1000 * width
    t = 0.0
    sizes = []
    for i, p in enumerate(r.packets):
        assert p.seq == i
        assert p.start_s == pytest.approx(t, abs=1e-6)
        t += p.duration_s
    total = 0
    # sizes come from the joined audio: every packet is at most packet_ms, and every one
    # but the last at least min_packet_ms (the first audio and a low listener buffer send
    # packets early)
    shortest = rate * min_packet_ms // 1000 * width
    for p in r.packets:
        sizes.append(round(p.duration_s * rate) * width)
        total += sizes[-1]
    assert all(shortest <= s <= n for s in sizes[:-1]) and 0 < sizes[-1] <= n
    assert total == len(r.audio)
    assert r.summary.audio_s == pytest.approx(t, abs=2 / rate + 1e-3)


def test_audio_for_each_rate_and_encoding_concurrently(srv) -> None:
    # (rate, encoding, packet_ms, min_packet_ms): None = the default (20 ms); equal to
    # packet_ms = fixed-size packets
    cases = [
        (8000, Encoding.MULAW, 20, None),
        (16000, Encoding.PCM16, 40, 40),
        (24000, Encoding.PCM16, 80, None),
        (48000, Encoding.MULAW, 100, 100),
        (48000, Encoding.PCM16, 60, None),
    ]

    async def one(client, rate, enc, ms, min_ms):
        raw = []
        sizes = {} if min_ms is None else {"min_packet_ms": min_ms}
        stream = client.synthesize(TEXT, sample_rate=rate, encoding=enc, packet_ms=ms, **sizes, **HARD)
        result = SynthesisResult()
        async for ev in stream:
            result.add(ev)
            if isinstance(ev, AudioPacket):
                raw.append(len(ev.data))
        return result, raw

    async def go():
        async with AsyncLiveSpeechClient(srv.address) as client:
            return await asyncio.gather(*(one(client, *c) for c in cases))

    results = srv.run(go())
    ids = set()
    for (rate, enc, ms, min_ms), (r, raw) in zip(cases, results):
        check_packets(r, rate, enc, ms, min_ms or 20)
        width = 2 if enc is Encoding.PCM16 else 1
        assert raw == [round(p.duration_s * rate) * width for p in r.packets]
        if min_ms == ms:
            assert all(b == rate * ms // 1000 * width for b in raw[:-1]) and raw[-1] <= rate * ms // 1000 * width
        ids.add(r.started.session_id)
        words = r.words
        assert all(w.start_s <= w.end_s for w in words)
        assert all(a.start_s <= b.start_s for a, b in zip(words, words[1:]))
        assert r.summary.spoken_text == TEXT
        assert [w.word for w in words] == TEXT.split()
    assert len(ids) == len(cases)
    assert srv.wait_idle()


def test_llm_paced_stream_with_timestamps_and_flush(srv) -> None:
    async def pieces():
        t = 0.0
        async for p in llm_stream(TEXT, rate=300, seed=3):
            t += 0.01
            yield TextPiece(p, timestamp_s=t)
        yield TextPiece("", flush=True)

    async def go():
        async with AsyncLiveSpeechClient(srv.address) as client:
            stream = client.synthesize(pieces(), n_future_chunks=1, **HARD)
            result = await stream.collect()
            return result, stream.client_ttfa_s

    r, ttfa = srv.run(go())
    assert r.summary is not None and r.packets and ttfa is not None and ttfa > 0
    assert r.summary.ttfa_s is not None
    assert r.summary.spoken_text == TEXT
    # one continuous utterance: gapless packets, every word once, in order, in time order
    assert [p.seq for p in r.packets] == list(range(len(r.packets)))
    for a, b in zip(r.packets, r.packets[1:]):
        assert b.start_s == pytest.approx(a.start_s + a.duration_s)
    assert [w.word for w in r.words] == TEXT.split()
    assert all(a.end_s <= b.start_s + 1e-9 for a, b in zip(r.words, r.words[1:]))
    assert r.words[-1].end_s <= r.summary.audio_s + 1e-9


def test_concurrent_sessions_do_not_mix(srv) -> None:
    texts = ["alpha beta gamma delta.", "one two three four five six.", "red green blue."]

    async def go():
        async with AsyncLiveSpeechClient(srv.address) as client:
            streams = [client.synthesize(llm_stream(t, rate=150, seed=i), **HARD) for i, t in enumerate(texts)]
            return await asyncio.gather(*(s.collect() for s in streams))

    results = srv.run(go())
    assert len({r.started.session_id for r in results}) == 3
    for t, r in zip(texts, results):
        assert r.summary is not None and r.packets
        assert r.summary.spoken_text == t
    assert srv.wait_idle()


def test_cancel_reports_spoken_text_and_frees_slot(srv) -> None:
    async def endless():
        for i in range(400):
            yield f"word{i} "
            await asyncio.sleep(0.01)

    async def go():
        async with AsyncLiveSpeechClient(srv.address) as client:
            stream = client.synthesize(endless(), n_future_chunks=1, **HARD)
            result = SynthesisResult()
            async for ev in stream:
                result.add(ev)
                if isinstance(ev, AudioPacket) and ev.seq == 1:
                    await stream.cancel()
            return result

    r = srv.run(go())
    assert r.summary is not None and r.summary.cancelled
    assert r.summary.spoken_text.startswith("word0")
    assert "word399" not in r.summary.spoken_text
    assert srv.wait_idle()
    assert srv.metrics.sessions_total.labels(outcome="cancelled")._value.get() >= 1


def test_client_hang_up_frees_slot(srv) -> None:
    before = srv.metrics.sessions_total.labels(outcome="disconnected")._value.get()

    async def go():
        call = srv.stub.Synthesize()
        await call.write(config_msg())
        await call.write(text_msg("keep talking please, there is a lot more text coming " * 3))
        while True:
            msg = await call.read()
            if msg.WhichOneof("response") == "audio":
                break
        assert srv.engine.active_sessions == 1
        call.cancel()

    srv.run(go())
    assert srv.wait_idle(), "the slot was not freed after the client hung up"
    assert srv.metrics.sessions_total.labels(outcome="disconnected")._value.get() == before + 1


def test_half_close_means_end_of_input_and_started_echo(srv) -> None:
    r = srv.run(raw_synthesize(srv.stub, [config_msg(sample_rate=16000), text_msg("short one.")]))
    assert r.code == grpc.StatusCode.OK, r.details
    kinds = r.kinds()
    assert kinds[0] == "started" and kinds[-1] == "summary" and "audio" in kinds
    echo = r.responses[0].started.config
    # every field is echoed with its effective value
    assert echo.sample_rate == 16000 and echo.packet_ms == 80 and echo.n_future_chunks == 2
    assert echo.encoding == pb.AUDIO_ENCODING_PCM16_LE and echo.voice_id
    assert echo.chunking.HasField("min_words") and echo.HasField("top_k")
    assert echo.chunking.HasField("release_when_waiting") and echo.chunking.release_when_waiting


def test_chunking_release_when_waiting_crosses_the_wire() -> None:
    from livespeech.api.protocol import config_from_proto, config_to_proto
    from livespeech.api.session import ChunkingConfig, SessionConfig

    assert config_from_proto(pb.SynthesizeConfig())[0].chunking.release_when_waiting  # unset: the default
    off = pb.SynthesizeConfig(chunking=pb.ChunkingPolicy(release_when_waiting=False))
    assert not config_from_proto(off)[0].chunking.release_when_waiting
    cfg = SessionConfig(chunking=ChunkingConfig(release_when_waiting=False))
    assert not config_from_proto(config_to_proto(cfg))[0].chunking.release_when_waiting


def test_explicit_end_of_input_and_unbounded_past(srv) -> None:
    r = srv.run(raw_synthesize(srv.stub, [config_msg(n_past_chunks=-1, n_future_chunks=0), text_msg("a b c"), END]))
    assert r.code == grpc.StatusCode.OK, r.details
    assert r.responses[0].started.config.n_past_chunks == -1


def test_sampling_settings_cross_the_wire() -> None:
    """Unset: the defaults (graphemes top-k 3, codebook 1's temperature 0.5, the others 1); set: the same values back,
    temperature 0 (greedy) included; out of range: a ConfigError naming the field."""
    from livespeech.api.protocol import config_from_proto, config_to_proto
    from livespeech.api.session import ConfigError, SessionConfig

    d = config_from_proto(pb.SynthesizeConfig())[0]
    assert (d.grapheme_top_k, d.grapheme_temperature, d.first_codebook_temperature, d.acoustic_temperature,
            d.top_k) == (3, 1.0, 0.5, 1.0, 20)
    cfg = SessionConfig(top_k=50, grapheme_top_k=1, grapheme_temperature=0.0, first_codebook_temperature=0.7,
                        acoustic_temperature=1.3)
    names = ("top_k", "grapheme_top_k", "grapheme_temperature", "first_codebook_temperature", "acoustic_temperature")

    def sampling(c):
        return tuple(getattr(c, n) for n in names)

    assert sampling(config_from_proto(config_to_proto(cfg))[0]) == (50, 1, 0.0, 0.7, 1.3)
    wire = pb.SynthesizeConfig(grapheme_top_k=5, acoustic_temperature=0.0)
    assert sampling(config_from_proto(wire)[0]) == (20, 5, 1.0, 0.5, 0.0)
    for field, value in [("grapheme_top_k", 0), ("grapheme_top_k", 1025), ("grapheme_temperature", -1.0),
                         ("first_codebook_temperature", 0.005), ("acoustic_temperature", float("nan")),
                         ("grapheme_temperature", 1e3)]:
        with pytest.raises(ConfigError, match=field):
            SessionConfig(**{field: value}).validate()


def test_the_summary_says_whether_every_word_was_spoken(srv) -> None:
    """Over the wire: all_words_spoken and the unspoken words (none here; the engine's
    tests drive sessions that leave words unspoken), and the mapping both ways."""
    from livespeech.api.protocol import summary_from_proto, summary_to_proto
    from livespeech.api.session import Summary

    async def go():
        async with AsyncLiveSpeechClient(srv.address) as client:
            return await client.synthesize_to_result(TEXT, **HARD)

    r = srv.run(go())
    assert r.summary is not None and r.summary.spoken_text == TEXT
    assert r.summary.all_words_spoken is True and r.summary.unspoken_words == ()
    partial = Summary(9, 0.12, None, 0.05, None, False, "Hello", False, ("there,", "you"))
    msg = summary_to_proto(partial)
    assert msg.HasField("all_words_spoken") and not msg.all_words_spoken
    assert list(msg.unspoken_words) == ["there,", "you"]
    assert not msg.HasField("ttfa_s") and msg.HasField("lookahead_wait_s")
    assert not summary_to_proto(Summary(0, 0.0, None, None, None, False, "")).HasField("all_words_spoken")
    for s in (partial, r.summary, Summary(0, 0.0, None, None, None, True, "")):
        assert summary_from_proto(summary_to_proto(s)) == s  # the client reads back what the server wrote


# the words before the last are long enough for their timing to go out with the audio
# sent before the next text: that audio lags the graphemes by the codebook delays (8 frames)
@pytest.mark.parametrize("text, options, flush", [
    ("Hi there.", {}, False),  # the last word is still being written: no space follows it
    ("Hello there, this is a test. Hi everybody.", {}, False),  # the last chunk's lookahead never comes
    ("Hi there, everybody", {"start_future_chunks": 2}, False),  # nor the first chunk's
    # a flush speaks what was sent without more lookahead, with the buffer delay off
    ("Hello there, this is a test. Hi everybody", {"max_buffer_delay_ms": 0}, True),
])
def test_text_whose_lookahead_never_comes_is_spoken_without_end_of_input(srv, text, options, flush) -> None:
    """No more text and no end of input: the text held is spoken after the session's
    buffer delay (or at a flush), not held until the idle timeout. The second-last word's
    timing goes out once the speech has moved into the last word; it arrives while the
    stream is still open, then end of input completes it with every word spoken."""
    words = text.split()

    async def go():
        call = srv.stub.Synthesize(timeout=20)
        await call.write(config_msg(**options))
        await call.write(text_msg(text, flush=flush))
        timed = []
        while not timed or timed[-1] != words[-2]:
            r = await call.read()
            assert r is not grpc.aio.EOF, "the stream ended before the speech reached the last word"
            if r.WhichOneof("response") == "word":
                timed.append(r.word.word)
        await call.write(END)
        responses = []
        while (r := await call.read()) is not grpc.aio.EOF:
            responses.append(r)
        return timed, responses, await call.code()

    timed, responses, code = srv.run(go())
    assert code == grpc.StatusCode.OK
    assert timed == words[:-1]
    summary = responses[-1].summary
    assert responses[-1].WhichOneof("response") == "summary"
    assert summary.spoken_text == text and summary.all_words_spoken


def test_max_buffer_delay_crosses_the_wire() -> None:
    from livespeech.api.protocol import config_from_proto, config_to_proto
    from livespeech.api.session import ConfigError, SessionConfig

    assert config_from_proto(pb.SynthesizeConfig())[0].max_buffer_delay_ms == SessionConfig().max_buffer_delay_ms
    assert config_from_proto(pb.SynthesizeConfig(max_buffer_delay_ms=0))[0].max_buffer_delay_ms == 0
    assert config_from_proto(config_to_proto(SessionConfig(max_buffer_delay_ms=1500)))[0].max_buffer_delay_ms == 1500
    with pytest.raises(ConfigError, match="max_buffer_delay_ms"):
        config_from_proto(pb.SynthesizeConfig(max_buffer_delay_ms=10_001))
