"""Shared fixtures: a real gRPC server on 127.0.0.1 (ephemeral ports) in a background
event loop, and helpers to run client coroutines on that loop from sync tests.

The engine is the real one (`livespeech.server.engine.Engine` on a randomly initialised tiny model)
when it is importable, else the test double `tests/fake_engine.py`; force one with
LIVESPEECH_TEST_ENGINE=fake|real. Tests that inject faults ask for the fake explicitly.
"""
from __future__ import annotations

import asyncio
import functools
import math
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import grpc
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fake_engine

from livespeech.server.app import App, build_server  # noqa: E402
from livespeech.server.config import ServerConfig  # noqa: E402
from livespeech.server.metrics import Metrics  # noqa: E402
from livespeech.api.protocol import Stub, pb  # noqa: E402
from livespeech.server.voices import VoiceStoreError  # noqa: E402

FAST = dict(host="127.0.0.1", port=0, metrics_port=0, drain_grace_s=5.0)


def real_engine_available() -> bool:
    if os.environ.get("LIVESPEECH_TEST_ENGINE") == "fake":
        return False
    try:
        import livespeech.models.loading  # noqa: F401
        import livespeech.server.engine  # noqa: F401
    except ImportError:
        if os.environ.get("LIVESPEECH_TEST_ENGINE") == "real":
            raise
        return False
    return True


# an untrained model follows the text only under hard guidance; the fake ignores these
HARD = dict(guidance_lambda=math.inf, seed=1)


@functools.lru_cache(maxsize=1)
def random_bundle() -> Any:
    """One randomly initialised tiny model per test process (engines only read it)."""
    import torch

    from livespeech.models.loading import load_bundle

    torch.set_num_threads(1)
    return load_bundle(random_init=True)


def make_engine(config: ServerConfig, metrics: Metrics, fake: bool = False) -> Any:
    if not fake and real_engine_available():
        from livespeech.server.app import engine_config
        from livespeech.server.engine import Engine

        return Engine(random_bundle(), engine_config(config), metrics)
    from fake_engine import FakeEngine

    return FakeEngine(capacity=config.max_sessions, metrics=metrics)


class Harness:
    """A server on its own event-loop thread; `run(coro)` executes on that loop."""

    def __init__(self, config: ServerConfig, fake: bool = False) -> None:
        import uvloop

        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.thread.start()
        self.metrics = Metrics()
        self.engine = make_engine(config, self.metrics, fake)
        self.app: App = self.run(build_server(config, self.engine, metrics=self.metrics))
        try:
            self.run(self.app.voices.default())
        except VoiceStoreError:  # a random-init bundle has no built-in voices
            noise = (np.random.default_rng(0).standard_normal(24000) * 0.1).astype(np.float32)
            self.run(self.app.voices.register("default", noise))
        self.channel: grpc.aio.Channel = self.run(self._channel())
        self.stub = Stub(self.channel)

    async def _channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.app.address)

    @property
    def address(self) -> str:
        return self.app.address

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run `await fn()` on the loop (fn builds the coroutine there)."""

        async def go() -> Any:
            return await fn()

        return self.run(go(), timeout)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once the engine holds no session."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.engine.active_sessions == 0 and self.app.service.in_flight == 0:
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        try:
            self.run(self.channel.close())
            self.run(self.app.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)


@pytest.fixture(scope="module")
def server_factory():
    made: list[Harness] = []

    def make(fake: bool = False, **overrides: Any) -> Harness:
        h = Harness(ServerConfig(**{**FAST, **overrides}), fake=fake)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


# ---------------------------------------------------------------- raw protocol helper


@dataclass
class RawResult:
    responses: list
    code: grpc.StatusCode
    details: str
    trailing: dict

    def kinds(self) -> list[str]:
        return [r.WhichOneof("response") for r in self.responses]

    def summaries(self) -> list:
        return [r.summary for r in self.responses if r.WhichOneof("response") == "summary"]


def numbered_words(n: int) -> list[str]:
    """n distinct words of letters alone ("worda", "wordb", "wordba", ...): each said as
    written, one chunk of the model's memory ("word1" would be said "word one",
    models/spoken_form.py)."""
    return ["word" + "".join("abcdefghij"[int(d)] for d in str(i)) for i in range(n)]


def config_msg(**kw: Any) -> "pb.SynthesizeRequest":
    return pb.SynthesizeRequest(config=pb.SynthesizeConfig(**{**HARD, **kw}))


def text_msg(text: str, ts: Optional[float] = None, flush: bool = False) -> "pb.SynthesizeRequest":
    t = pb.TextInput(text=text, flush=flush)
    if ts is not None:
        t.timestamp_s = ts
    return pb.SynthesizeRequest(text=t)


END = pb.SynthesizeRequest(end_of_input=pb.EndOfInput())
CANCEL = pb.SynthesizeRequest(cancel=pb.Cancel())


async def raw_synthesize(stub: Stub, requests: list, *, half_close: bool = True, timeout: float = 30.0) -> RawResult:
    """Send `requests` (then half-close), read everything, return responses + status."""
    call = stub.Synthesize(timeout=timeout)
    responses = []

    async def send() -> None:
        try:
            for r in requests:
                await call.write(r)
            if half_close:
                await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            pass

    sender = asyncio.create_task(send())
    try:
        async for r in call:
            responses.append(r)
    except grpc.aio.AioRpcError:
        pass
    await sender
    trailing = {k: v for k, v in (await call.trailing_metadata() or ())}
    return RawResult(responses, await call.code(), await call.details(), trailing)
