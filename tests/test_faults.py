"""Faults, over a real channel to the real engine (random-init tiny model):

- clients that go away at every stage (before the config, before `started`, mid-audio,
  while the server is blocked on flow control, a whole connection closed, a client
  process killed with SIGKILL): every slot comes back, nothing else is disturbed;
- a client that stops reading: its buffer is bounded (`max_buffered_packets`), the
  session ends with RESOURCE_EXHAUSTED "client is not reading" without the client's
  help, and the server's memory does not follow the unread audio;
- clients that send text far faster than real time for seconds: the engine's command
  queue stays bounded, the text limit ends a session that goes over it, a paced session
  beside them is untouched;
- many streams opened and abandoned: each ends by its timeout or the RPC limit, and the
  server returns to rest (tasks, slots);
- an engine error inside one session (a voice whose enrollment K/V is NaN) ends that
  session with INTERNAL and no other.
Figures are printed (`pytest -s`) for docs/reliability.md.
"""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from livespeech.client.client import AsyncLiveSpeechClient, llm_stream
from conftest import CANCEL, END, HARD, config_msg, raw_synthesize, text_msg
from reliability_helpers import ROOT, ClientLoop, leaks, proc_stats, record, server_tasks
from livespeech.api.protocol import Stub
from livespeech.server.metrics import SESSION_OUTCOMES
from livespeech.server.runner import Voice
from livespeech.server.voices import VoiceInfo

C = grpc.StatusCode
TEXT = "Hello there, this is a streaming test."
LONG = "many words to speak here and then some more of them " * 40


@pytest.fixture(scope="module")
def srv(server_factory):
    return server_factory(
        max_sessions=4,
        max_buffered_packets=16,
        config_timeout_s=1.0,
        idle_timeout_s=3.0,  # also bounds an engine stall: the floods below starve the CPU
        max_text_piece_chars=500,
        max_session_text_chars=6_000,
    )


@pytest.fixture(scope="module")
def client(srv):
    loop = ClientLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def baseline(srv):
    assert srv.wait_idle()
    return server_tasks(srv)


def at_rest(srv, baseline: int, timeout: float = 15.0) -> None:
    left = leaks(srv, baseline, timeout)
    assert not left, f"server not back at rest: {left}"


def outcomes(srv) -> dict:
    return {o: srv.metrics.sessions_total.labels(outcome=o)._value.get() for o in SESSION_OUTCOMES}


def counted_since(srv, before: dict) -> dict:
    """The outcomes counted since `before`, the ones that moved only."""
    return {o: n - before[o] for o, n in outcomes(srv).items() if n != before[o]}


# ---------------------------------------------------------------- disconnects


def test_disconnect_at_every_stage_frees_everything(srv, client, baseline) -> None:
    async def hang_up(stage: str) -> None:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = Stub(ch)
            call = stub.Synthesize()
            if stage != "before_config":
                await call.write(config_msg())
                await call.write(text_msg(LONG[:400]))
            if stage == "after_started":
                assert (await call.read()).WhichOneof("response") == "started"
            if stage in ("mid_audio", "blocked_writer"):
                while (await call.read()).WhichOneof("response") != "audio":
                    pass
            if stage == "blocked_writer":
                await asyncio.sleep(1.0)  # not reading: the server's writes back up
            if stage == "channel_close":
                others = [stub.Synthesize() for _ in range(3)]
                for c in others:
                    await c.write(config_msg())
                    await c.write(text_msg(LONG[:300]))
                for c in others:
                    assert (await c.read()).WhichOneof("response") == "started"
                return  # leaving the block closes the connection under all four calls
            await asyncio.sleep(0.05)
            call.cancel()

    stages = ["before_config", "after_config", "after_started", "mid_audio", "blocked_writer", "channel_close"]
    seen = {}
    for stage in stages:
        before = outcomes(srv)
        client.run(hang_up(stage))
        at_rest(srv, baseline)
        seen[stage] = counted_since(srv, before)
    # every stream is counted once, as disconnected (channel_close hangs up four)
    assert seen == {stage: {"disconnected": 4 if stage == "channel_close" else 1} for stage in stages}, seen

    # a client process killed mid-stream: the kernel closes its socket, nobody says goodbye
    script = f"""
import asyncio, math, sys
sys.path.insert(0, {str(ROOT)!r})
import grpc
from livespeech.api.protocol import Stub, pb
async def main():
    ch = grpc.aio.insecure_channel({srv.address!r})
    call = Stub(ch).Synthesize()
    await call.write(pb.SynthesizeRequest(config=pb.SynthesizeConfig(guidance_lambda=math.inf)))
    await call.write(pb.SynthesizeRequest(text=pb.TextInput(text={LONG[:400]!r})))
    n = 0
    while n < 3:
        n += (await call.read()).WhichOneof("response") == "audio"
    print("READY", flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "READY"
        assert srv.engine.active_sessions == 1
        t0 = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        at_rest(srv, baseline)
        freed_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    record("faults_disconnect", dict(stages=stages + ["sigkill"], sigkill_slot_freed_s=round(freed_s, 3)))
    assert freed_s < 10


def test_cancel_that_overtakes_the_text_is_a_disconnect(srv, client, baseline) -> None:
    """A cancel drops the client's messages the server has not read yet, and grpc's asyncio
    server ends the request iterator as if the client had half-closed: without care the
    server hears "config, end of input" and completes a session with nothing said."""
    n, cap = 60, srv.engine.capacity

    async def go():
        async with grpc.aio.insecure_channel(srv.address) as ch, asyncio.timeout(60):
            stub = Stub(ch)
            for i in range(n):
                # below capacity, so that none is refused for it: a call not counted yet may
                # not have reached the server, and a counted session holds its slot until
                # the engine's next step
                while i - sum(counted_since(srv, before).values()) + srv.engine.active_sessions >= cap:
                    await asyncio.sleep(0.005)
                call = stub.Synthesize()
                await call.write(config_msg())
                await call.write(text_msg("cut off before it is read "))
                await asyncio.sleep(0.0005 * (i % 4))
                call.cancel()

    before = outcomes(srv)
    client.run(go())
    at_rest(srv, baseline)
    assert counted_since(srv, before) == {"disconnected": n}


# ---------------------------------------------------------------- slow consumer


def test_client_that_stops_reading_is_cut_off_with_bounded_memory(srv, client, baseline) -> None:
    service = srv.app.service
    stop = threading.Event()
    peak = {"queue": 0}

    async def sample_queues() -> None:  # on the server's loop: its own view of the buffers
        while not stop.is_set():
            for s in list(service._streams):
                peak["queue"] = max(peak["queue"], s.events.qsize())
            await asyncio.sleep(0.005)

    sampler = asyncio.run_coroutine_threadsafe(sample_queues(), srv.loop)
    rss0 = proc_stats()["rss_kb"]

    async def go():
        # no BDP probing: the HTTP/2 window stays small, so the server's writes block
        async with grpc.aio.insecure_channel(srv.address, options=[("grpc.http2.bdp_probe", 0)]) as ch:
            call = Stub(ch).Synthesize()
            t0 = time.monotonic()
            await call.write(config_msg(sample_rate=48000, packet_ms=20))
            for i in range(0, 3000, 500):
                await call.write(text_msg(LONG[i : i + 500]))
            await call.write(END)
            freed = None
            for _ in range(1200):  # the server frees the session without the client's help
                await asyncio.sleep(0.05)
                if srv.engine.active_sessions == 0 and service.in_flight == 0:
                    freed = time.monotonic() - t0
                    break
            with pytest.raises(grpc.aio.AioRpcError) as e:  # reading now gives the status
                while await call.read() is not grpc.aio.EOF:
                    pass
            return freed, e.value.code(), e.value.details()

    try:
        freed, code, details = client.run(go())
    finally:
        stop.set()
        sampler.result(5)
    rss1 = proc_stats()["rss_kb"]
    record("faults_slow_consumer", dict(
        max_buffered_packets=srv.app.config.max_buffered_packets, peak_queue=peak["queue"],
        freed_after_s=freed and round(freed, 2), rss_delta_mb=round((rss1 - rss0) / 1024, 1),
    ))
    assert freed is not None, "the session was not freed"
    assert code == C.RESOURCE_EXHAUSTED and "not reading" in details
    assert peak["queue"] <= srv.app.config.max_buffered_packets
    assert rss1 - rss0 < 100 * 1024  # the unread audio is not kept
    at_rest(srv, baseline)


# ---------------------------------------------------------------- fast senders

FLOOD_S = 8.0
FLOOD_PIECES = ("word ", "ab", "go ")  # at 200/s, 200/s, and as fast as the channel takes them


def test_clients_sending_faster_than_real_time(srv, client, baseline) -> None:
    stop = threading.Event()
    peak = {"commands": 0}

    def sample() -> None:
        while not stop.is_set():
            peak["commands"] = max(peak["commands"], len(srv.engine._commands) + len(srv.engine._urgent))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rss0 = proc_stats()["rss_kb"]

    async def flood(stub: Stub, rate: float, piece: str) -> tuple:
        """`rate` pieces/s (0: as fast as the channel takes them) for FLOOD_S, then
        barge in. ~4-char pieces at 200/s is ~50 words/s: ~20x real time."""
        call = stub.Synthesize()
        await call.write(config_msg())
        sent = 0
        t_end = time.monotonic() + FLOOD_S
        try:
            while time.monotonic() < t_end and not call.done():
                await call.write(text_msg(piece))
                sent += len(piece)
                if rate:
                    await asyncio.sleep(1 / rate)
            await call.write(CANCEL)
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            pass
        summary = None
        try:
            async for r in call:
                if r.WhichOneof("response") == "summary":
                    summary = r.summary
        except grpc.aio.AioRpcError:
            pass
        return await call.code(), await call.details(), sent, summary

    async def go():
        async with grpc.aio.insecure_channel(srv.address) as ch, AsyncLiveSpeechClient(srv.address) as paced_client:
            stub = Stub(ch)
            paced = asyncio.ensure_future(
                paced_client.synthesize_to_result(llm_stream(TEXT + " " + TEXT, rate=12, seed=2), **HARD)
            )
            floods = await asyncio.gather(*(flood(stub, rate, piece) for rate, piece in zip((200, 200, 0), FLOOD_PIECES)))
            try:
                return floods, await paced
            except grpc.aio.AioRpcError as e:
                return floods, (e.code(), e.details())

    t0 = time.monotonic()
    try:
        floods, paced = client.run(go(), timeout=FLOOD_S + 120)
    finally:
        stop.set()
        sampler.join()
    wall = time.monotonic() - t0
    rss1 = proc_stats()["rss_kb"]
    limit = srv.app.config.max_session_text_chars
    record("faults_fast_senders", dict(
        flood_s=FLOOD_S, wall_s=round(wall, 1), sent_chars=[f[2] for f in floods],
        codes=[f[0].name for f in floods], peak_engine_commands=peak["commands"],
        rss_delta_mb=round((rss1 - rss0) / 1024, 1),
    ))
    for code, details, sent, summary in floods:
        if sent > limit:  # went over the session's text limit: refused, not queued
            assert code == C.RESOURCE_EXHAUSTED and "max_session_text_chars" in details, (code, details)
        else:  # barge-in after the flood: a cancelled summary
            assert code == C.OK and summary is not None and summary.cancelled, (code, details)
    assert not isinstance(paced, tuple), f"the paced session failed: {paced}"
    assert paced.summary is not None and paced.summary.spoken_text == TEXT + " " + TEXT
    # each text message is one engine command and the engine drains them every iteration;
    # when the floods starve its thread, they pile up, but never beyond what the session
    # text limit lets in (messages refused or drained after a refusal are not forwarded)
    assert peak["commands"] <= sum(limit // len(p) + 1 for p in FLOOD_PIECES) + 100
    assert rss1 - rss0 < 200 * 1024
    at_rest(srv, baseline)


# ---------------------------------------------------------------- abandoned streams


async def status_after_reading(call) -> grpc.StatusCode:
    """The call's status once every response before it is read: a client learns the status
    only after the messages ahead of it (the holders below get the audio of their word,
    spoken after the buffer delay)."""
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError:
        pass
    return await call.code()


def test_many_abandoned_streams_end_and_leave_nothing(srv, client, baseline) -> None:
    n_silent, n_holding = 60, srv.engine.capacity

    async def go():
        channels = [grpc.aio.insecure_channel(srv.address) for _ in range(4)]
        stubs = [Stub(ch) for ch in channels]
        t0 = time.monotonic()
        # never send anything, never hang up
        silent = [stubs[i % 4].Synthesize() for i in range(n_silent)]
        for c in silent:
            await c.wait_for_connection()
        # take every slot with a config and one word (spoken after the buffer delay), then go silent
        holding = [stubs[i % 4].Synthesize() for i in range(n_holding)]
        for c in holding:
            await c.write(config_msg())
            await c.write(text_msg("one "))
        for c in holding:
            assert (await c.read()).WhichOneof("response") == "started"
        full = await raw_synthesize(stubs[0], [config_msg(), text_msg("x"), END])
        # and streams whose connection is dropped under them
        dropped_ch = grpc.aio.insecure_channel(srv.address)
        dropped = [Stub(dropped_ch).Synthesize() for _ in range(20)]
        for c in dropped:
            await c.write(config_msg(voice_id="nobody"))
        await dropped_ch.close()
        codes = [await status_after_reading(c) for c in silent + holding]
        elapsed = time.monotonic() - t0
        for ch in channels:
            await ch.close()
        return full, codes, elapsed

    full, codes, elapsed = client.run(go(), timeout=120)
    record("faults_abandoned", dict(
        silent=n_silent, holding=n_holding, dropped=20, all_ended_s=round(elapsed, 2),
        codes=sorted(set(c.name for c in codes)),
    ))
    assert full.code == C.RESOURCE_EXHAUSTED  # the holders really held every slot
    assert all(c == C.DEADLINE_EXCEEDED for c in codes), codes  # config or idle timeout
    at_rest(srv, baseline)


def test_stream_cap_refuses_excess_streams_before_any_work(server_factory, client) -> None:
    h = server_factory(max_sessions=2, max_synthesize_streams=10, config_timeout_s=1.0, retry_after_ms=250)

    async def go():
        async with grpc.aio.insecure_channel(h.address) as ch:
            calls = [Stub(ch).Synthesize() for _ in range(25)]
            return [(await c.code(), await c.details(), dict(await c.trailing_metadata() or ())) for c in calls]

    results = client.run(go(), timeout=60)
    codes = [c for c, _, _ in results]
    refused = [(d, t) for c, d, t in results if c == C.RESOURCE_EXHAUSTED]
    assert len(refused) == 15 and codes.count(C.DEADLINE_EXCEEDED) == 10, codes
    assert all("max_synthesize_streams" in d and t.get("retry-after-ms") == "250" for d, t in refused), refused
    assert h.wait_idle()


# ---------------------------------------------------------------- engine fault


def test_engine_error_ends_only_that_session(srv, client, baseline) -> None:
    good = srv.run(srv.app.voices.get("default"))
    bad = Voice("nan", good.enrollment, torch.full_like(good.kv, float("nan")))
    srv.app.voices._voices[("", "nan")] = (bad, VoiceInfo("nan", False))  # no RPC registers a broken voice
    try:
        async def go():
            async with AsyncLiveSpeechClient(srv.address) as c:
                ok = asyncio.ensure_future(c.synthesize_to_result(llm_stream(TEXT, rate=40, seed=1), **HARD))
                others = [asyncio.ensure_future(c.synthesize_to_result("Still fine here.", **HARD)) for _ in range(2)]
                broken = await raw_synthesize(Stub(c.channel), [config_msg(voice_id="nan"), text_msg(TEXT), END])
                return broken, await ok, await asyncio.gather(*others)

        broken, ok, others = client.run(go())
    finally:
        del srv.app.voices._voices[("", "nan")]
    assert broken.code == C.INTERNAL and "numerical" in broken.details, (broken.code, broken.details)
    assert ok.summary is not None and ok.summary.spoken_text == TEXT
    assert all(o.summary is not None and o.summary.spoken_text == "Still fine here." for o in others)
    record("faults_engine_error", dict(broken=broken.code.name, details=broken.details, others_ok=1 + len(others)))
    at_rest(srv, baseline)


def test_huge_speech_time_timestamp_fails_only_its_session(srv, client, baseline) -> None:
    async def go():
        async with AsyncLiveSpeechClient(srv.address) as c:
            bystander = asyncio.ensure_future(
                c.synthesize_to_result(llm_stream("An innocent bystander is speaking here.", rate=10, seed=3), **HARD)
            )
            await asyncio.sleep(0.5)
            call = Stub(c.channel).Synthesize()
            await call.write(config_msg(timestamps_are_speech_time=True))
            # whole words without punctuation: the chunker's timer releases them (not a text command)
            await call.write(text_msg("hello there ", ts=1e308))
            await asyncio.sleep(1.5)
            call.cancel()
            try:
                return await bystander
            except grpc.aio.AioRpcError as e:
                return e

    result = client.run(go())
    at_rest(srv, baseline)
    assert not isinstance(result, grpc.aio.AioRpcError), f"the bystander failed: {result.code()} {result.details()}"
    assert result.summary is not None and result.summary.spoken_text == "An innocent bystander is speaking here."
