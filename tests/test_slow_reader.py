"""A client that reads its audio slower than real time for longer than
`slow_reader_grace_s` is ended with RESOURCE_EXHAUSTED "client is not reading" and its
engine slot is freed; a client whose reading stalls for less than the grace is not.

The clients turn off gRPC's BDP probing: what a client's gRPC library takes into its
flow-control window counts as read (the server cannot see inside it), and with probing
that window grows to megabytes, tens of seconds of audio; without it, 64 KiB.
`max_buffered_packets` is set far above what these sessions make, so that only the
grace decides.
"""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from conftest import END, config_msg, text_msg
from livespeech.server.config import ServerConfig
from livespeech.api.protocol import Stub
from livespeech.api.session import ConfigError

C = grpc.StatusCode
GRACE_S = 0.5
RATE = 48_000  # bytes per second of audio: the small window fills quickly
WORDS = 300  # 24 s of the fake engine's audio, made in about 2 s
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def srv(server_factory):
    return server_factory(fake=True, max_sessions=2, slow_reader_grace_s=GRACE_S, max_buffered_packets=100_000)


def text_requests(end: bool) -> list:
    words = " ".join(f"w{i}" for i in range(WORDS)) + " "
    pieces = [words[i:i + 1000] for i in range(0, len(words), 1000)]
    return [config_msg(sample_rate=RATE), *(text_msg(p) for p in pieces)] + ([END] if end else [])


async def read_all(call) -> tuple[int, bool]:
    """(audio packets, summary seen) until the status."""
    packets, summary = 0, False
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            kind = msg.WhichOneof("response")
            packets += kind == "audio"
            summary = summary or kind == "summary"
    except grpc.aio.AioRpcError:
        pass
    return packets, summary


def test_the_grace_is_a_validated_setting() -> None:
    assert ServerConfig().slow_reader_grace_s > 0
    with pytest.raises(ConfigError, match="slow_reader_grace_s"):
        ServerConfig(slow_reader_grace_s=0)


def test_a_client_that_stops_reading_is_ended_and_its_slot_freed(srv) -> None:
    assert srv.wait_idle()

    async def start():
        ch = grpc.aio.insecure_channel(srv.address, options=SMALL_WINDOW)
        call = Stub(ch).Synthesize()
        for r in text_requests(end=False):  # no end of input: the session never completes by itself
            await call.write(r)
        assert (await call.read()).WhichOneof("response") == "started"
        return ch, call

    ch, call = srv.run(start())
    try:
        # the client reads nothing more; the server frees the slot on its own
        freed = srv.wait_idle(timeout=30)

        async def finish():
            packets, summary = await read_all(call)
            return freed, packets, summary, await call.code(), await call.details()

        freed, packets, summary, code, details = srv.run(finish())
    finally:
        srv.run(ch.close())
    assert freed
    assert (code, details) == (C.RESOURCE_EXHAUSTED, "client is not reading")
    assert not summary and packets < WORDS


@pytest.mark.parametrize("speed,stall_s,expect", [
    (0.5, 0.0, "cut"),  # half real time throughout
    (3.0, 0.3, "ok"),  # faster than real time, with stalls shorter than the grace
])
def test_reading_speed_against_real_time(srv, speed, stall_s, expect) -> None:
    assert srv.wait_idle()

    async def go():
        async with grpc.aio.insecure_channel(srv.address, options=SMALL_WINDOW) as ch:
            call = Stub(ch).Synthesize()
            for r in text_requests(end=True):
                await call.write(r)
            await call.done_writing()
            t0 = time.monotonic()
            audio_s, packets, summary = 0.0, 0, False
            try:
                while (msg := await call.read()) is not grpc.aio.EOF:
                    kind = msg.WhichOneof("response")
                    summary = summary or kind == "summary"
                    if kind != "audio":
                        continue
                    packets += 1
                    audio_s += msg.audio.duration_s
                    if stall_s and packets % 10 == 0:
                        await asyncio.sleep(stall_s)  # a brief network stall
                    await asyncio.sleep(max(0.0, t0 + audio_s / speed - time.monotonic()))
            except grpc.aio.AioRpcError:
                pass
            return await call.code(), await call.details(), summary

    code, details, summary = srv.run(go(), timeout=120)
    if expect == "cut":
        assert (code, details) == (C.RESOURCE_EXHAUSTED, "client is not reading") and not summary
    else:
        assert (code, summary) == (C.OK, True), (code, details)
    assert srv.wait_idle()
