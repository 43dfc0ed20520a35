"""Engines in child processes (server/engine_pool.py): sessions spread over the engines,
the audio an in-process engine makes, input checked in the server's process, capacity,
metrics relayed to the server's registry, a dead engine failing only its own sessions,
and the whole server over gRPC with its drain.

Each pool starts two engine processes on the untrained tiny model (a few seconds each)."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from conftest import FAST, HARD, config_msg, raw_synthesize, real_engine_available, text_msg

pytestmark = pytest.mark.skipif(not real_engine_available(), reason="needs the real engine (torch)")

from livespeech.api.session import (AudioPacket, CapacityError, ConfigError, Failed, Finished,  # noqa: E402
                                    SessionConfig, StateError)
from livespeech.server.app import build_engine, build_server, make_engine  # noqa: E402
from livespeech.server.config import ServerConfig  # noqa: E402
from livespeech.server.engine_pool import EnginePool  # noqa: E402
from livespeech.server.metrics import Metrics  # noqa: E402

POOL = dict(model_path="random:tiny", engine_processes=2, max_sessions=4)
NOISE = (np.random.default_rng(0).standard_normal(24000) * 0.1).astype(np.float32)
TEXT = "Hello there, this is a short test of the pool."


class Collector:
    def __init__(self) -> None:
        self.events: list = []
        self.done = threading.Event()

    def __call__(self, event) -> None:
        self.events.append(event)
        if isinstance(event, (Finished, Failed)):
            self.done.set()

    def of(self, cls) -> list:
        return [e for e in self.events if isinstance(e, cls)]

    def audio(self) -> np.ndarray:
        return np.frombuffer(b"".join(p.data for p in self.of(AudioPacket)), dtype="<i2")


def say(engine, voice, text: str = TEXT, wait: bool = True, **cfg) -> tuple:
    c = Collector()
    handle = engine.open_session(SessionConfig(**{**HARD, **cfg}), voice, c)
    for piece in text.split(" "):
        handle.push_text(piece + " ")
    handle.end_input()
    if wait:
        assert c.done.wait(60), "session did not finish"
    return handle, c


def wait_for(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture(scope="module")
def metrics():
    return Metrics()


@pytest.fixture(scope="module")
def pool(metrics):
    engine = make_engine(ServerConfig(**FAST, **POOL), metrics)
    assert isinstance(engine, EnginePool)
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def voice(pool):
    return pool.make_voice("noise", NOISE, 24000)


def sample(metrics: Metrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_an_engine_process_holds_the_model_an_engine_in_the_server_process_holds(pool, voice):
    """The child enrolls a voice bit for bit as an engine built here does (the same model
    and path), and a pooled session speaks its whole text. (Audio is compared within one
    engine elsewhere: a session's frames depend on when each word arrived.)"""
    import pickle

    import torch

    local = build_engine(ServerConfig(**FAST, model_path="random:tiny", max_sessions=1), Metrics(), cpus=1)
    here, there = local.make_voice("noise", NOISE, 24000), pickle.loads(voice.payload)
    assert torch.equal(here.enrollment, there.enrollment) and torch.equal(here.kv, there.kv)
    _, c = say(pool, voice)
    summary = c.of(Finished)[0].summary
    assert summary.all_words_spoken and summary.spoken_text.split() == TEXT.split()
    assert summary.frames > 0 and len(c.audio()) == round(summary.audio_s * 24000)


def test_sessions_spread_over_the_engines_and_the_slots_are_the_sum(pool, voice, metrics):
    assert pool.capacity == 4 and [c.capacity for c in pool._children] == [2, 2]
    rejected = sample(metrics, "livespeech_sessions_total", outcome="rejected")
    held = [say(pool, voice, wait=False) for _ in range(4)]
    assert sorted(c.active for c in pool._children) == [2, 2]
    with pytest.raises(CapacityError):
        pool.open_session(SessionConfig(**HARD), voice, Collector())
    assert sample(metrics, "livespeech_sessions_total", outcome="rejected") == rejected + 1
    for _, c in held:
        assert c.done.wait(60)
        assert c.of(Finished) and c.of(AudioPacket)
    assert wait_for(lambda: pool.active_sessions == 0)


def test_input_is_checked_in_the_server_process(pool, voice):
    c = Collector()
    handle = pool.open_session(SessionConfig(**HARD), voice, c)
    handle.push_text("one ", client_time_s=1.0)
    with pytest.raises(ConfigError, match="must not decrease"):
        handle.push_text("two ", client_time_s=0.5)
    with pytest.raises(ConfigError, match="max_text_piece_chars"):
        handle.push_text("x" * (ServerConfig.max_text_piece_chars + 1))
    handle.end_input()
    with pytest.raises(StateError):
        handle.push_text("three ")
    assert c.done.wait(60) and c.of(Finished)[0].summary.spoken_text.split() == ["one"]
    with pytest.raises(ConfigError):
        pool.open_session(SessionConfig(sample_rate=12345), voice, Collector())


def test_the_engines_metrics_reach_the_servers_registry(pool, voice, metrics):
    completed = sample(metrics, "livespeech_sessions_total", outcome="completed")
    steps = sample(metrics, "livespeech_step_seconds_count")
    say(pool, voice)
    assert wait_for(lambda: sample(metrics, "livespeech_sessions_total", outcome="completed") == completed + 1)
    assert sample(metrics, "livespeech_step_seconds_count") > steps
    assert sample(metrics, "livespeech_ttfa_seconds_count") > 0
    assert wait_for(lambda: sample(metrics, "livespeech_active_sessions") == 0)


def test_a_closed_session_frees_its_slot_and_sends_nothing_more(pool, voice):
    handle, c = say(pool, voice, text=TEXT * 4, wait=False)
    assert wait_for(lambda: c.of(AudioPacket))
    handle.close()
    n = len(c.events)
    assert wait_for(lambda: pool.active_sessions == 0)
    time.sleep(0.2)
    assert len(c.events) == n and not c.done.is_set()


def test_a_voice_the_engines_cannot_enroll_is_an_error_in_the_caller(pool):
    with pytest.raises(Exception) as info:
        pool.make_voice("empty", np.zeros(0, dtype=np.float32), 24000)
    assert not isinstance(info.value, TimeoutError)


def test_a_dead_engine_fails_only_its_own_sessions_and_is_replaced():
    metrics = Metrics()
    pool = make_engine(ServerConfig(**FAST, **POOL), metrics)
    pool.start()
    try:
        voice = pool.make_voice("noise", NOISE, 24000)
        (_, first), (_, second) = [say(pool, voice, text=TEXT * 3, wait=False) for _ in range(2)]
        assert sorted(c.active for c in pool._children) == [1, 1]
        victim = pool._children[0]
        os.kill(victim.process.pid, signal.SIGKILL)
        assert first.done.wait(60) and second.done.wait(60)
        failed = [c for c in (first, second) if c.of(Failed)]
        assert len(failed) == 1 and failed[0].of(Failed)[0].code == "UNAVAILABLE"
        assert [c for c in (first, second) if c.of(Finished)]
        assert pool.capacity == 2 and wait_for(lambda: pool.active_sessions == 0)
        assert sample(metrics, "livespeech_errors_total", code="UNAVAILABLE") == 1
        assert wait_for(lambda: sample(metrics, "livespeech_active_sessions") == 0)
        _, after = say(pool, voice)  # the other engine still serves
        assert after.of(Finished)
        assert wait_for(lambda: pool.capacity == 4, timeout=120)  # a new process took the slots back
        assert pool._children[0] is not victim and pool._children[0].process.is_alive()
        held = [say(pool, voice, wait=False) for _ in range(4)]
        for _, c in held:
            assert c.done.wait(60) and c.of(Finished)
    finally:
        pool.stop()
    assert all(not c.process.is_alive() for c in pool._children)


def test_the_server_with_an_engine_pool_serves_grpc_and_drains():
    config = ServerConfig(**FAST, **POOL)
    metrics = Metrics()
    engine = make_engine(config, metrics)

    async def run() -> tuple:
        app = await build_server(config, engine, metrics=metrics)
        try:
            await app.voices.register("default", NOISE)
            async with grpc.aio.insecure_channel(app.address) as channel:
                from livespeech.api.protocol import Stub

                results = await asyncio.gather(*[
                    raw_synthesize(Stub(channel), [config_msg(**HARD), text_msg(TEXT)]) for _ in range(3)])
        finally:
            await app.drain()
        return results

    results = asyncio.run(run())
    for r in results:
        assert r.code == grpc.StatusCode.OK, r.details
        assert "audio" in r.kinds() and len(r.summaries()) == 1
    assert all(c.process.exitcode == 0 for c in engine._children)


def test_how_many_engine_processes_a_server_runs():
    from livespeech.server.app import engine_processes

    assert engine_processes(ServerConfig(**FAST), cpus=8) == 1  # the default: one, in the server's process
    assert engine_processes(ServerConfig(**FAST, engine_processes=0), cpus=8) == 8
    assert engine_processes(ServerConfig(**FAST, engine_processes=0, max_sessions=3), cpus=8) == 3
    assert engine_processes(ServerConfig(**FAST, engine_processes=0, device="cuda"), cpus=8) == 1
    # K engines may share a GPU when asked for
    assert engine_processes(ServerConfig(**FAST, engine_processes=4, device="cuda"), cpus=8) == 4
    with pytest.raises(ConfigError, match="engine_processes"):
        ServerConfig(**FAST, engine_processes=-1)


def build_unless_marked(config, metrics, cpus):
    """A child's engine, unless the file named by $LIVESPEECH_TEST_NO_START exists."""
    if os.path.exists(os.environ.get("LIVESPEECH_TEST_NO_START", "/nonexistent")):
        raise RuntimeError("told not to start")
    return build_engine(config, metrics, cpus)


def test_a_replacement_that_fails_to_start_is_tried_again(tmp_path, monkeypatch):
    mark = tmp_path / "no-start"
    monkeypatch.setenv("LIVESPEECH_TEST_NO_START", str(mark))
    pool = EnginePool(ServerConfig(**FAST, **POOL), Metrics(), 2, cpus=1, build=build_unless_marked)
    pool.start()
    try:
        mark.touch()
        os.kill(pool._children[0].process.pid, signal.SIGKILL)
        assert wait_for(lambda: pool.capacity == 2)
        # the first replacement (after 2 s: a death soon after the start) fails; the next
        # waits twice as long
        assert wait_for(lambda: pool._respawn_delays[0] == 4.0, timeout=60)
        assert pool.capacity == 2
        mark.unlink()
        assert wait_for(lambda: pool.capacity == 4, timeout=120)  # the next try (4 s later) starts
        _, c = say(pool, pool.make_voice("noise", NOISE, 24000))
        assert c.of(Finished)
    finally:
        pool.stop()
    assert all(not c.process.is_alive() for c in pool._children)
