"""Undecodable request bytes, for every method of the service: INVALID_ARGUMENT naming
the problem, at most one log line per call and no traceback.

A raw channel with identity serializers sends bytes that no client library would
produce: invalid UTF-8 in a string field, and corrupt wire format.
"""
from __future__ import annotations

import logging

import grpc
import pytest

from conftest import END, config_msg
from livespeech.api.protocol import SERVICE, SERVICE_NAME

C = grpc.StatusCode

# hand-made wire bytes (field tags per protos/livespeech/v1/livespeech.proto)
BAD_UTF8 = b"\xc3\x28"
TEXT_BAD_UTF8 = b"\x12\x04\x0a\x02" + BAD_UTF8  # SynthesizeRequest.text.text
CONFIG_VOICE_BAD_UTF8 = b"\x0a\x04\x0a\x02" + BAD_UTF8  # SynthesizeRequest.config.voice_id
VOICE_ID_BAD_UTF8 = b"\x0a\x02" + BAD_UTF8  # RegisterVoiceRequest / DeleteVoiceRequest .voice_id
CORRUPT = b"\x12\x7f\x0a"  # a length-delimited field longer than the message

UNARY_CASES = [
    ("RegisterVoice", VOICE_ID_BAD_UTF8, "UTF-8"),
    ("RegisterVoice", CORRUPT, "corrupt"),
    ("DeleteVoice", VOICE_ID_BAD_UTF8, "UTF-8"),
    ("DeleteVoice", CORRUPT, "corrupt"),
    ("ListVoices", CORRUPT, "corrupt"),
]
STREAM_CASES = [
    ("first message", [CONFIG_VOICE_BAD_UTF8], "UTF-8"),
    ("first message", [CORRUPT], "corrupt"),
    ("text", [config_msg().SerializeToString(), TEXT_BAD_UTF8, END.SerializeToString()], "UTF-8"),
    ("text", [config_msg().SerializeToString(), CORRUPT, END.SerializeToString()], "corrupt"),
    ("text twice", [config_msg().SerializeToString(), CORRUPT, TEXT_BAD_UTF8, END.SerializeToString()], "corrupt"),
]


@pytest.fixture(scope="module")
def srv(server_factory):
    return server_factory(fake=True, max_sessions=2)


def test_every_method_is_covered() -> None:
    covered = {m for m, _, _ in UNARY_CASES} | {"Synthesize"}
    assert covered == {m.name for m in SERVICE.methods}


def _check_logs(caplog, calls: int) -> None:
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    mentions = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(mentions) <= calls, [r.getMessage() for r in mentions]


@pytest.mark.parametrize("method,payload,needle", UNARY_CASES)
def test_unary_malformed_request_is_invalid_argument(srv, caplog, method, payload, needle) -> None:
    async def go():
        call = srv.channel.unary_unary(f"/{SERVICE_NAME}/{method}")  # identity serializers: raw bytes
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call(payload, timeout=10)
        return e.value

    caplog.set_level(logging.INFO)
    err = srv.run(go())
    assert err.code() == C.INVALID_ARGUMENT, (err.code(), err.details())
    assert "malformed" in err.details() and needle in err.details(), err.details()
    _check_logs(caplog, 1)


@pytest.mark.parametrize("where,payloads,needle", STREAM_CASES)
def test_synthesize_malformed_message_is_invalid_argument(srv, caplog, where, payloads, needle) -> None:
    assert srv.wait_idle()

    async def go():
        call = srv.channel.stream_stream(f"/{SERVICE_NAME}/Synthesize")(timeout=10)
        for p in payloads:
            try:
                await call.write(p)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, Exception):
                break
        try:
            await call.done_writing()
        except Exception:
            pass
        async for _ in call:
            pass

    caplog.set_level(logging.INFO)
    try:
        srv.run(go())
        code, details = C.OK, ""
    except grpc.aio.AioRpcError as e:
        code, details = e.code(), e.details()
    assert code == C.INVALID_ARGUMENT, (code, details)
    assert "malformed" in details and needle in details, details
    _check_logs(caplog, 1)
    assert srv.wait_idle()


def test_register_voice_with_a_12_bit_wav_is_invalid_argument(srv) -> None:
    from livespeech.api.protocol import Stub, pb
    from test_audio import _wav_header

    async def go():
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await Stub(srv.channel).RegisterVoice(pb.RegisterVoiceRequest(voice_id="twelve", wav=_wav_header(12)))
        return e.value

    err = srv.run(go())
    assert err.code() == C.INVALID_ARGUMENT and "12-bit" in err.details(), (err.code(), err.details())
