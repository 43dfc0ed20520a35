"""The WebSocket and OpenAI-compatible HTTP endpoints (server/web.py) against a running
server with the real engine: text in, PCM and word timings out; cancel; statuses as close
codes and HTTP errors; bearer tokens."""
from __future__ import annotations

import asyncio
import json
import math
import struct

import aiohttp
import numpy as np
import pytest

from conftest import HARD

TEXT = "Hello there, this is a streaming test."
TOKEN = "webtoken-0123456789abcdef"
# protobuf's JSON mapping: infinity is the string "Infinity"
WS_HARD = {"guidance_lambda": "Infinity" if math.isinf(HARD["guidance_lambda"]) else HARD["guidance_lambda"],
           "seed": str(HARD["seed"])}


@pytest.fixture(scope="module")
def srv(server_factory):
    return server_factory(http_port=-1, max_sessions=4)


@pytest.fixture(scope="module")
def secured(server_factory):
    h = server_factory(http_port=-1, auth_tokens=f"acme:{TOKEN}")
    noise = (np.random.default_rng(0).standard_normal(24000) * 0.1).astype(np.float32)
    h.run(h.app.voices.register("default", noise, tenant="acme"))
    return h


def url(h, path: str, scheme: str = "http") -> str:
    return f"{scheme}://127.0.0.1:{h.app.http_port}{path}"


async def ws_session(h, messages: list, *, headers=None, protocols=(), on_audio=None) -> dict:
    """Send `messages` (dicts as JSON, str as they are), read to the close; returns the
    events, audio and close code/reason. `on_audio(ws, n)` runs after the n-th audio frame."""
    out = {"events": [], "audio": b"", "frames": 0}
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(url(h, "/v1/synthesize", "ws"), headers=headers, protocols=protocols) as ws:
            for m in messages:
                await (ws.send_str(m) if isinstance(m, str) else ws.send_json(m))
            out["reason"] = ""
            while True:
                msg = await ws.receive()
                if msg.type == aiohttp.WSMsgType.BINARY:
                    out["audio"] += msg.data
                    out["frames"] += 1
                    if on_audio is not None:
                        await on_audio(ws, out["frames"])
                elif msg.type == aiohttp.WSMsgType.TEXT:
                    out["events"].append(json.loads(msg.data))
                else:  # CLOSE: data is the code, extra the reason
                    out["reason"] = msg.extra or ""
                    break
            out["code"] = ws.close_code
            out["protocol"] = ws.protocol
    return out


def of(events: list, kind: str) -> list:
    return [e for e in events if e["type"] == kind]


def test_websocket_streams_pcm_words_and_summary(srv) -> None:
    config = {"type": "config", "config": {"sample_rate": 16000, **WS_HARD}}
    pieces = [{"type": "text", "text": p} for p in ("Hello the", "re, this is a stre", "aming test.")]
    r = srv.run(ws_session(srv, [config, *pieces, {"type": "end"}]))
    assert r["code"] == 1000
    events = r["events"]
    assert events[0]["type"] == "started" and events[0]["config"]["sample_rate"] == 16000
    assert events[0]["config"]["voice_id"] == "default" and events[0]["session_id"]
    assert events[-1]["type"] == "summary" and not events[-1]["cancelled"]
    summary = events[-1]
    assert summary["spoken_text"] == TEXT and summary["all_words_spoken"]
    words = of(events, "word")
    assert [w["word"] for w in words] == TEXT.split()
    assert all(a["start_s"] <= b["start_s"] and w["start_s"] <= w["end_s"] for a, b, w in zip(words, words[1:], words))
    assert r["frames"] > 1 and len(r["audio"]) % 2 == 0
    assert len(r["audio"]) / 2 / 16000 == pytest.approx(summary["audio_s"], abs=1e-3)
    assert srv.wait_idle()


def test_websocket_cancel_reports_what_was_spoken(srv) -> None:
    words = [f"word{i}" for i in range(300)]

    async def cancel_at_second_packet(ws, n):
        if n == 2:
            await ws.send_json({"type": "cancel"})
            await ws.send_json({"type": "text", "text": "dropped after the cancel "})

    config = {"type": "config", "config": {"n_future_chunks": 1, **WS_HARD}}
    text = [{"type": "text", "text": w + " "} for w in words]
    r = srv.run(ws_session(srv, [config, *text], on_audio=cancel_at_second_packet))
    assert r["code"] == 1000
    summary = r["events"][-1]
    assert summary["type"] == "summary" and summary["cancelled"]
    assert summary["spoken_text"].startswith("word0") and "word299" not in summary["spoken_text"]
    assert srv.wait_idle()


@pytest.mark.parametrize("messages, code, says", [
    (["this is not JSON"], 4400, "malformed JSON"),
    ([{"type": "config", "config": {"sample_rate": 12345}}], 4400, "sample_rate"),
    ([{"type": "config", "config": {"no_such_setting": 1}}], 4400, "no_such_setting"),
    ([{"type": "text", "text": "hello"}], 4400, "first message must be config"),
    ([{"type": "config", "config": {"voice_id": "nobody"}}], 4404, "nobody"),
    ([{"type": "config", "config": {}}, {"type": "config", "config": {}}], 4409, "config already received"),
    ([{"type": "config", "config": {}}, {"type": "text", "text": "x" * 2001}], 4400, "max_text_piece_chars"),
])
def test_websocket_refusals_close_with_the_status_as_code(srv, messages, code, says) -> None:
    r = srv.run(ws_session(srv, messages))
    errors = of(r["events"], "error")
    assert len(errors) == 1 and says in errors[0]["message"]
    assert r["code"] == code
    assert r["reason"].startswith(errors[0]["code"] + ": ")  # the close frame says it too
    assert errors[0]["code"] == {4400: "INVALID_ARGUMENT", 4404: "NOT_FOUND", 4409: "FAILED_PRECONDITION"}[code]
    assert srv.wait_idle()


def test_websocket_and_speech_need_a_token_when_tokens_are_configured(secured) -> None:
    config = {"type": "config", "config": WS_HARD}
    refused = secured.run(ws_session(secured, [config, {"type": "end"}]))
    assert refused["code"] == 4401 and of(refused["events"], "error")[0]["code"] == "UNAUTHENTICATED"
    wrong = secured.run(ws_session(secured, [config], headers={"Authorization": "Bearer not-the-token-at-all"}))
    assert wrong["code"] == 4401 and of(wrong["events"], "error")[0]["message"] == "invalid token"
    short = [config, {"type": "text", "text": "Hi there."}, {"type": "end"}]
    ok = secured.run(ws_session(secured, short, headers={"Authorization": f"Bearer {TOKEN}"}))
    assert ok["code"] == 1000 and ok["events"][-1]["spoken_text"] == "Hi there."
    # a browser's way: the subprotocols "bearer" and the token
    browser = secured.run(ws_session(secured, short, protocols=("bearer", TOKEN)))
    assert browser["code"] == 1000 and browser["protocol"] == "bearer"

    async def speech(headers):
        async with aiohttp.ClientSession() as session:
            async with session.post(url(secured, "/v1/audio/speech"), headers=headers,
                                    json={"model": "livespeech", "input": "Hi there.", "voice": "default"}) as resp:
                return resp.status, await resp.read()

    status, body = secured.run(speech({}))
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    status, body = secured.run(speech({"Authorization": f"Bearer {TOKEN}"}))
    assert status == 200 and body[:4] == b"RIFF"
    assert secured.wait_idle()


async def post_speech(h, body: dict) -> tuple[int, dict, bytes, int]:
    """(status, headers, body, number of body chunks the client read as they came)."""
    async with aiohttp.ClientSession() as session:
        async with session.post(url(h, "/v1/audio/speech"), json=body) as resp:
            data, chunks = b"", 0
            async for chunk in resp.content.iter_any():
                data += chunk
                chunks += 1
            return resp.status, dict(resp.headers), data, chunks


def test_openai_speech_streams_a_wav(srv) -> None:
    status, headers, data, _ = srv.run(post_speech(srv, {"model": "tts-1", "input": TEXT, "voice": "default",
                                                         "response_format": "wav"}))
    assert status == 200 and headers["Content-Type"] == "audio/wav"
    assert headers.get("Transfer-Encoding") == "chunked"  # streamed as it is made, no length up front
    riff, _, wave_id, fmt_id, fmt_len = struct.unpack("<4sI4s4sI", data[:20])
    assert (riff, wave_id, fmt_id, fmt_len) == (b"RIFF", b"WAVE", b"fmt ", 16)
    pcm_format, channels, rate, byte_rate, align, bits = struct.unpack("<HHIIHH", data[20:36])
    assert (pcm_format, channels, rate, byte_rate, align, bits) == (1, 1, 24000, 48000, 2, 16)
    assert data[36:40] == b"data"
    audio = data[44:]
    assert len(audio) > 0 and len(audio) % 2 == 0
    assert np.abs(np.frombuffer(audio, "<i2")).max() > 0
    assert srv.wait_idle()


def test_openai_speech_streams_pcm(srv) -> None:
    status, headers, data, _ = srv.run(post_speech(srv, {"model": "tts-1", "input": "Hi there, everybody.",
                                                         "voice": "default", "response_format": "pcm", "speed": 1.0}))
    assert status == 200 and headers["Content-Type"] == "audio/pcm"
    assert len(data) > 0 and len(data) % 2 == 0 and data[:4] != b"RIFF"
    assert srv.wait_idle()


@pytest.mark.parametrize("body, status, code", [
    ({"model": "tts-1", "input": "Hello.", "voice": "alloy"}, 404, "not_found"),
    ({"model": "tts-1", "input": "Hello.", "voice": "default", "response_format": "mp3"}, 400, "invalid_argument"),
    ({"model": "tts-1", "input": "Hello.", "voice": "default", "speed": 1.5}, 400, "invalid_argument"),
    ({"model": "tts-1", "input": "", "voice": "default"}, 400, "invalid_argument"),
    ({"model": "tts-1", "input": "Hello."}, 400, "invalid_argument"),
])
def test_openai_speech_errors_are_openai_error_json(srv, body, status, code) -> None:
    got, headers, data, _ = srv.run(post_speech(srv, body))
    assert got == status and headers["Content-Type"].startswith("application/json")
    error = json.loads(data)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code and error["message"]
    assert "param" in error


def test_openai_speech_refuses_malformed_json(srv) -> None:
    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.post(url(srv, "/v1/audio/speech"), data=b"{not json",
                                    headers={"Content-Type": "application/json"}) as resp:
                return resp.status, await resp.json()

    status, body = srv.run(go())
    assert status == 400 and "malformed JSON" in body["error"]["message"]


def test_drain_ends_a_websocket_session_with_unavailable_and_refuses_new_ones(server_factory) -> None:
    """SIGTERM's drain (no grace here): a WebSocket session still speaking ends with close
    code 4503 "server is shutting down", as gRPC's end with UNAVAILABLE; new ones are refused."""
    h = server_factory(http_port=-1)
    drained = []

    async def drain_at_first_packet(ws, n):
        if n == 1:
            h.app.service.draining = True  # the drain's first act: new sessions are refused from here on
            drained.append(await ws_session(h, [{"type": "config", "config": {}}]))
            drained.append(asyncio.ensure_future(h.app.drain(0.0)))

    text = [{"type": "text", "text": f"word{i} "} for i in range(300)]
    r = h.run(ws_session(h, [{"type": "config", "config": WS_HARD}, *text], on_audio=drain_at_first_packet))
    refused, drain = drained
    h.run(asyncio.wait_for(asyncio.shield(drain), 30))
    assert refused["code"] == 4503 and of(refused["events"], "error")[0]["message"] == "server is draining"
    assert r["code"] == 4503 and of(r["events"], "error")[0]["message"] == "server is shutting down"
    assert r["frames"] >= 1


async def get(h, path: str, headers=None) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url(h, path), headers=headers) as resp:
            return resp.status, dict(resp.headers), await resp.read()


def test_voices_lists_the_callers_voices_as_list_voices_does(srv, secured) -> None:
    status, _, body = srv.run(get(srv, "/v1/voices"))
    assert status == 200
    (voice,) = json.loads(body)["voices"]
    created = voice.pop("created_unix_ms")  # an int64: a string in protobuf's JSON mapping
    assert voice == {"voice_id": "default", "builtin": False, "reference_s": 1.0} and int(created) > 0
    status, _, body = secured.run(get(secured, "/v1/voices"))
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    status, _, body = secured.run(get(secured, "/v1/voices", {"Authorization": f"Bearer {TOKEN}"}))
    assert status == 200 and [v["voice_id"] for v in json.loads(body)["voices"]] == ["default"]


@pytest.mark.parametrize("path", ["/", "/demo"])
def test_the_demo_page_is_served(srv, path) -> None:
    status, headers, body = srv.run(get(srv, path))
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    page = body.decode()
    assert "/v1/synthesize" in page and "/v1/voices" in page
    assert "://" not in page  # nothing is fetched from another host


def test_a_full_server_refuses_websocket_and_speech_with_a_retry_hint(server_factory) -> None:
    """Every engine slot taken (here by one WebSocket session still waiting for text): a
    new WebSocket session closes with 4429 and an error naming the capacity and a retry
    hint, as gRPC's RESOURCE_EXHAUSTED; the speech endpoint answers 429 with Retry-After.
    Once the holder ends, a new session is served."""
    h = server_factory(http_port=-1, max_sessions=1)

    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(url(h, "/v1/synthesize", "ws")) as holder:
                await holder.send_json({"type": "config", "config": WS_HARD})
                await holder.send_json({"type": "text", "text": "Hold "})
                started = json.loads((await holder.receive()).data)
                refused = await ws_session(h, [{"type": "config", "config": WS_HARD}])
                speech = await post_speech(h, {"model": "livespeech", "input": "Hi.", "voice": "default"})
                await holder.send_json({"type": "cancel"})
                async for _ in holder:
                    pass
        after = await ws_session(h, [{"type": "config", "config": WS_HARD}, {"type": "text", "text": "Hi."},
                                     {"type": "end"}])
        return started, refused, speech, after

    started, refused, (status, headers, body, _), after = h.run(go())
    assert started["type"] == "started"
    error = of(refused["events"], "error")[0]
    assert refused["code"] == 4429 and error["code"] == "RESOURCE_EXHAUSTED" and error["retry_after_ms"] > 0
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert json.loads(body)["error"]["message"]
    assert after["code"] == 1000 and of(after["events"], "summary")[0]["spoken_text"] == "Hi."
