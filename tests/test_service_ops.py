"""Operations: health, reflection, metrics over HTTP, voices, drain, slow consumers,
fault isolation."""
from __future__ import annotations

import asyncio
import platform
import re
import urllib.error
import urllib.request
from importlib import metadata

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from livespeech.client.client import AsyncLiveSpeechClient, llm_stream
from conftest import END, HARD, config_msg, raw_synthesize, text_msg
from livespeech.api.audio import encode_wav
from livespeech.api.protocol import SERVICE_NAME, Stub
from livespeech.server.voices import VoiceStore

C = grpc.StatusCode
TEXT = "Hello there, this is a streaming test."


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("voices")


@pytest.fixture(scope="module")
def srv(server_factory, voices_dir):
    return server_factory(metrics_port=-1, voices_dir=voices_dir, max_voices=4, max_enrollment_seconds=2.0)


@pytest.fixture(scope="module")
def fake_srv(server_factory):
    return server_factory(fake=True, max_buffered_packets=8, idle_timeout_s=5.0)


def wav_bytes(seconds: float, rate: int = 16000, seed: int = 0) -> bytes:
    x = np.random.default_rng(seed).standard_normal(int(seconds * rate)).astype(np.float32) * 0.1
    return encode_wav(x, rate)


def test_health_and_reflection(srv) -> None:
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(srv.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE_NAME):
            assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(ch)
        assert SERVICE_NAME in db.get_services()
        service = DescriptorPool(db).FindServiceByName(SERVICE_NAME)
        methods = {m.name: m for m in service.methods}
        assert set(methods) == {"Synthesize", "RegisterVoice", "ListVoices", "DeleteVoice"}
        assert methods["Synthesize"].client_streaming and methods["Synthesize"].server_streaming
        assert methods["Synthesize"].input_type.fields_by_name["config"].message_type.name == "SynthesizeConfig"


def scrape(srv) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.app.metrics_port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(livespeech_\w+(?:\{[^}]*\})?) ([0-9.e+-]+|NaN|\+Inf)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_metrics_endpoint_is_conventional(srv) -> None:
    """Runtime collectors and build info on /metrics, on /metrics only; ratios carry _ratio."""
    base = f"http://127.0.0.1:{srv.app.metrics_port}"
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    names = {m.group(1) for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", text, re.M)}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds", "python_info"} <= names
    assert any(n.startswith("python_gc_") for n in names), sorted(names)
    m = re.search(r"^livespeech_build_info\{([^}]*)\} 1\.0$", text, re.M)
    assert m, "no livespeech_build_info"
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
    assert labels["version"] == metadata.version("livespeech") and labels["python"] == platform.python_version()
    assert labels["torch"] == metadata.version("torch")
    # the real-time factor is a ratio: the suffix says so (histogram samples after it)
    assert "livespeech_rtf_ratio_bucket" in text and "livespeech_rtf_ratio_count" in text
    assert not re.search(r"^livespeech_rtf_(bucket|count|sum)", text, re.M)
    for path in ("/", "/metric", "/metrics/", "/foo", "/favicon.ico"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + path, timeout=10)
        assert e.value.code == 404, path
    # a query string is still /metrics (Prometheus's name[] filter)
    one = urllib.request.urlopen(base + "/metrics?name[]=livespeech_build_info", timeout=10).read().decode()
    assert "livespeech_build_info{" in one and "process_cpu_seconds_total" not in one


def test_metrics_move_when_sessions_run(srv) -> None:
    before = scrape(srv)
    assert before['livespeech_sessions_total{outcome="completed"}'] >= 0

    async def go():
        async with AsyncLiveSpeechClient(srv.address) as client:
            await client.synthesize_to_result(TEXT, **HARD)
        return await raw_synthesize(srv.stub, [config_msg(voice_id="ghost"), END])

    r = srv.run(go())
    assert r.code == C.NOT_FOUND
    after = scrape(srv)
    assert after['livespeech_sessions_total{outcome="completed"}'] == before['livespeech_sessions_total{outcome="completed"}'] + 1
    assert after['livespeech_sessions_total{outcome="rejected"}'] == before['livespeech_sessions_total{outcome="rejected"}'] + 1
    assert after['livespeech_errors_total{code="NOT_FOUND"}'] >= 1
    for name in ("livespeech_ttfa_seconds_count", "livespeech_audio_seconds_total", "livespeech_step_seconds_count"):
        assert after[name] > before.get(name, 0.0), name
    assert after["livespeech_active_sessions"] == 0


def test_voices_register_list_use_persist_delete(srv, voices_dir) -> None:
    async def go():
        async with AsyncLiveSpeechClient(srv.address) as client:
            info = await client.register_voice("alice", wav=wav_bytes(1.0))
            assert not info.builtin and info.reference_s == pytest.approx(1.0, abs=0.01)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.register_voice("alice", wav=wav_bytes(1.0))
            assert e.value.code() == C.ALREADY_EXISTS
            pcm = (np.random.default_rng(1).standard_normal(8000) * 3000).astype("<i2").tobytes()
            await client.register_voice("alice", pcm16=pcm, sample_rate=8000, overwrite=True)
            for bad_id in ("../etc", "a/b", "", "x" * 65):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await client.register_voice(bad_id, wav=wav_bytes(0.5))
                assert e.value.code() == C.INVALID_ARGUMENT and "voice_id" in e.value.details()
            for audio, needle in ((dict(wav=wav_bytes(3.0)), "limit"), (dict(wav=b"RIFFjunk"), "WAV"), ({}, "audio")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await client.register_voice("bob", **audio)
                assert e.value.code() == C.INVALID_ARGUMENT and needle in e.value.details(), e.value.details()
            ids = {v.voice_id: v for v in await client.list_voices()}
            assert "alice" in ids and not ids["alice"].builtin
            r = await client.synthesize_to_result("Hi there.", voice_id="alice", **HARD)
            assert r.started.config.voice_id == "alice" and r.summary is not None
            # survives a restart: a fresh store on the same directory loads it
            store = VoiceStore(voices_dir, srv.engine)
            await store.load()
            assert await store.get("alice") is not None
            await client.delete_voice("alice")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.delete_voice("alice")
            assert e.value.code() == C.NOT_FOUND
            r = await raw_synthesize(srv.stub, [config_msg(voice_id="alice"), END])
            assert r.code == C.NOT_FOUND
            assert not (voices_dir / "alice.json").exists() and not (voices_dir / "alice.wav").exists()
            # the voice limit
            with pytest.raises(grpc.aio.AioRpcError) as e:
                for i in range(5):
                    await client.register_voice(f"v{i}", wav=wav_bytes(0.2))
            assert e.value.code() == C.RESOURCE_EXHAUSTED
            for v in await client.list_voices():
                if v.voice_id.startswith("v"):
                    await client.delete_voice(v.voice_id)

    srv.run(go())


def test_builtin_voices_are_read_only(fake_srv) -> None:
    async def go():
        async with AsyncLiveSpeechClient(fake_srv.address) as client:
            voices = await client.list_voices()
            assert [v.voice_id for v in voices if v.builtin] == ["default"]
            for op in (client.delete_voice("default"), client.register_voice("default", wav=wav_bytes(0.5))):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await op
                assert e.value.code() == C.FAILED_PRECONDITION

    fake_srv.run(go())


def test_failure_in_one_session_does_not_touch_another(fake_srv) -> None:
    async def go():
        async with AsyncLiveSpeechClient(fake_srv.address) as client:
            good = asyncio.ensure_future(client.synthesize_to_result(llm_stream(TEXT * 3, rate=400)))
            bad = await raw_synthesize(fake_srv.stub, [config_msg(), text_msg("this will <fail> now "), END])
            return bad, await good

    bad, good = fake_srv.run(go())
    assert bad.code == C.INTERNAL and "injected" in bad.details
    assert good.summary is not None and good.summary.spoken_text == " ".join((TEXT * 3).split())
    assert fake_srv.wait_idle()


def test_slow_consumer_is_cut_off(fake_srv) -> None:
    async def go():
        # a client that does not read: a small HTTP/2 window, so the server's writes block
        async with grpc.aio.insecure_channel(fake_srv.address, options=[("grpc.http2.bdp_probe", 0)]) as ch:
            call = Stub(ch).Synthesize()
            await call.write(config_msg(sample_rate=48000, packet_ms=20))
            for _ in range(8):
                await call.write(text_msg("many words to speak here " * 15))
            await call.write(END)
            for _ in range(200):  # the server frees the session without the client's help
                await asyncio.sleep(0.05)
                if fake_srv.engine.active_sessions == 0 and fake_srv.app.service.in_flight == 0:
                    break
            freed = fake_srv.engine.active_sessions == 0 and fake_srv.app.service.in_flight == 0
            with pytest.raises(grpc.aio.AioRpcError) as e:  # reading now gives the status
                while await call.read() is not grpc.aio.EOF:
                    pass
            return freed, e.value.code(), e.value.details()

    freed, code, details = fake_srv.run(go())
    assert freed
    assert code == C.RESOURCE_EXHAUSTED and "not reading" in details


def test_drain_finishes_in_flight_and_refuses_new(server_factory) -> None:
    h = server_factory()

    async def go():
        client = AsyncLiveSpeechClient(h.address)
        text = llm_stream(TEXT + " " + TEXT, rate=15, seed=1)  # ~1.6 s of text arriving
        in_flight = asyncio.ensure_future(client.synthesize_to_result(text, **HARD))
        await asyncio.sleep(0.3)
        drain = asyncio.ensure_future(h.app.drain())
        await asyncio.sleep(0.05)
        refused = await raw_synthesize(h.stub, [config_msg(), END])
        health = health_pb2_grpc.HealthStub(h.channel)
        status = (await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))).status
        assert not in_flight.done()
        result = await in_flight
        await drain
        await client.close()
        return refused, status, result

    refused, status, result = h.run(go())
    assert refused.code == C.UNAVAILABLE and "draining" in refused.details
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert result.summary is not None and not result.summary.cancelled
    assert result.summary.spoken_text == TEXT + " " + TEXT
    assert h.engine.active_sessions == 0


def test_drain_ends_sessions_still_running_after_grace(server_factory) -> None:
    h = server_factory(fake=True)

    async def go():
        call = h.stub.Synthesize()
        await call.write(config_msg())
        await call.write(text_msg("one"))  # waits for lookahead forever
        assert (await call.read()).WhichOneof("response") == "started"
        await h.app.drain(grace_s=0.2)
        return await call.code(), await call.details()

    code, details = h.run(go())
    assert code == C.UNAVAILABLE and "shutting down" in details
    assert h.engine.stopped and h.engine.active_sessions == 0
