"""Soak: many sessions against one server process (`livespeech serve`, random-init tiny
model, 127.0.0.1), sequential runs alternating with concurrent batches, short texts.

Sessions mix the ways a session ends: completed (most), barge-in cancel after the first
audio, client hang-up mid-audio, refused (unknown voice, bad config), inline
enrollment. After a warm-up (which also grows the thread pools to their working size),
the server's resident memory (VmRSS) must grow less than 5%, and its open file
descriptors and threads must come back to the warm-up baseline once it is idle.

LIVESPEECH_SOAK_SESSIONS sets the count (default 200, affordable in CI on 2 cores);
docs/reliability.md quotes a run of 1000. LIVESPEECH_SOAK_KINDS (e.g. `enroll`) runs
only those kinds of session, to tell which one moves the memory.
"""
from __future__ import annotations

import asyncio
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter

import grpc
import numpy as np
import pytest

from reliability_helpers import ROOT, proc_stats, record
from livespeech.api.protocol import Stub, pb

C = grpc.StatusCode
SESSIONS = int(os.environ.get("LIVESPEECH_SOAK_SESSIONS", "200"))
WARMUP = max(40, SESSIONS // 10)
MAX_SESSIONS = 8
BATCH = 8  # concurrent sessions per batch
SEQ = 8  # sequential sessions per run
TEXTS = ["Hi there.", "Short one.", "Okay, got it.", "Yes, sure thing.", "See you soon!", "One two three."]
ENROLL = (np.sin(np.arange(4800) * 0.05) * 8000).astype("<i2").tobytes()  # 0.2 s at 24 kHz
EXPECTED = {"complete": C.OK, "cancel": C.OK, "enroll": C.OK, "hang_up": C.CANCELLED,
            "unknown_voice": C.NOT_FOUND, "bad_config": C.INVALID_ARGUMENT}
KINDS = [k for k in os.environ.get("LIVESPEECH_SOAK_KINDS", "").split(",") if k] or (
    ["complete"] * 16 + ["cancel", "cancel", "hang_up", "hang_up", "unknown_voice", "bad_config", "enroll"])
if set(KINDS) - set(EXPECTED):
    raise ValueError(f"LIVESPEECH_SOAK_KINDS: unknown kinds {sorted(set(KINDS) - set(EXPECTED))}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("soak") / "server.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable, "-m", "livespeech.client.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
        "--model-path", "random:tiny", "--max-sessions", str(MAX_SESSIONS), "--torch-threads", "1",
        "--voices-dir", "", "--config-timeout-s", "5", "--idle-timeout-s", "10",
    ]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"serving on 127\.0\.0\.1:(\d+)", log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield proc, f"127.0.0.1:{m.group(1)}", log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


async def one(stub: Stub, kind: str, text: str) -> tuple[grpc.StatusCode, str]:
    cfg = pb.SynthesizeConfig(guidance_lambda=math.inf, seed=1)
    if kind == "unknown_voice":
        cfg.voice_id = "nobody"
    elif kind == "bad_config":
        cfg.sample_rate = 44100
    elif kind == "enroll":
        cfg.enrollment.CopyFrom(pb.PcmAudio(pcm16_le=ENROLL, sample_rate=24000))
    call = stub.Synthesize(timeout=60)
    try:
        await call.write(pb.SynthesizeRequest(config=cfg))
        if kind == "cancel":  # enough text for a packet's worth of speech before the text runs dry
            text += " and then a few more words follow here, and then some more after that, a lot more "
        await call.write(pb.SynthesizeRequest(text=pb.TextInput(text=text)))
        if kind != "cancel":
            await call.done_writing()
        async for msg in call:
            if msg.WhichOneof("response") == "audio":
                if kind == "cancel":
                    await call.write(pb.SynthesizeRequest(cancel=pb.Cancel()))
                    await call.done_writing()
                    kind = "cancelled"
                elif kind == "hang_up":
                    call.cancel()
                    return C.CANCELLED, ""
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
        pass
    return await call.code(), await call.details()


def wait_quiet(pid: int, seconds: float = 1.0) -> dict:
    """Stats once the process has settled (sessions freed, helper threads parked)."""
    time.sleep(seconds)
    return proc_stats(pid)


def test_soak(server) -> None:
    proc, address, log = server
    outcomes: Counter = Counter()
    wrong: list = []
    samples: list[int] = []
    n = 0

    async def run(count: int) -> None:
        nonlocal n
        async with grpc.aio.insecure_channel(address) as ch:
            stub = Stub(ch)
            await stub.RegisterVoice(pb.RegisterVoiceRequest(voice_id="default", pcm=pb.PcmAudio(
                pcm16_le=ENROLL, sample_rate=24000), overwrite=True))
            done = 0
            while done < count:
                concurrent = (done // (SEQ + BATCH)) % 2 == 1 or done % (SEQ + BATCH) >= SEQ
                k = min(BATCH if concurrent else 1, count - done)
                jobs = [(KINDS[(n + i) % len(KINDS)], TEXTS[(n + i) % len(TEXTS)]) for i in range(k)]
                codes = await asyncio.gather(*(one(stub, kind, text) for kind, text in jobs))
                for (kind, text), (code, details) in zip(jobs, codes):
                    outcomes[f"{kind}:{code.name}"] += 1
                    if code != EXPECTED[kind]:
                        wrong.append((kind, text, code.name, details))
                n += k
                done += k
                if n % 50 < k:
                    samples.append(proc_stats(proc.pid)["rss_kb"])

    t0 = time.monotonic()
    asyncio.run(run(WARMUP))
    base = wait_quiet(proc.pid)
    t1 = time.monotonic()
    asyncio.run(run(SESSIONS - WARMUP))
    wall = time.monotonic() - t1
    end = wait_quiet(proc.pid, 2.0)
    assert proc.poll() is None, log.read_text()[-3000:]
    growth = (end["rss_kb"] - base["rss_kb"]) / base["rss_kb"]
    record("soak", dict(
        kinds=sorted(set(KINDS)), sessions=SESSIONS, warmup=WARMUP, measured_sessions=SESSIONS - WARMUP,
        wall_s=round(wall, 1),
        total_s=round(time.monotonic() - t0, 1), sessions_per_s=round((SESSIONS - WARMUP) / wall, 2),
        rss_mb=dict(baseline=round(base["rss_kb"] / 1024, 1), end=round(end["rss_kb"] / 1024, 1),
                    peak_sampled=round(max(samples, default=0) / 1024, 1),
                    # every 50 sessions from the start: a plateau and a leak read apart here
                    every_50_sessions=[round(kb / 1024, 1) for kb in samples]),
        rss_growth_pct=round(100 * growth, 2), fds=dict(baseline=base["fds"], end=end["fds"]),
        threads=dict(baseline=base["threads"], end=end["threads"]), outcomes=dict(sorted(outcomes.items())),
        wrong=wrong[:5],
    ))
    assert not wrong, wrong[:10]
    assert growth < 0.05, f"RSS grew {100 * growth:.1f}% after warm-up"
    assert end["fds"] <= base["fds"], (base, end)
    assert end["threads"] <= base["threads"], (base, end)
    assert "Traceback" not in log.read_text()
