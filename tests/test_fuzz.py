"""Property-based request streams (hypothesis) over a real gRPC channel to the real
engine (random-init tiny model).

Each example is one Synthesize call playing a random script: messages in any order
(config missing, late or twice; text, end_of_input, cancel, empty requests), configs
with values in and out of range (sample rates, packet sizes, np/nf, chunking, guidance
lambda incl. NaN/-inf, top_k, seeds up to 2^64-1, voice ids like "../x" or 10k chars,
inline enrollment that is empty, odd-length, too short, too long, at absurd rates),
texts with RTL scripts, emoji ZWJ sequences, combining marks, bidi overrides, NUL and
control characters, pieces at/over the server's piece limit and over the gRPC message
limit, timestamps that are NaN, +-inf, negative, -0.0, huge or decreasing, pauses,
a half-close at a random point (or none), and the client hanging up at a random time.

Every call must end with a status from the documented set (the .proto header), never
INTERNAL/UNKNOWN; a stream whose first message is not a config must get
INVALID_ARGUMENT; an OK stream must be `started` ... `summary` with contiguous packets.
After every example the server must be back at rest within a bound: no session in the
engine or the service, every engine slot free, no asyncio task beyond the baseline,
the engine thread alive.

Bounded for CI: LIVESPEECH_FUZZ_EXAMPLES (default 80) examples, derandomized (the same
streams every run); LIVESPEECH_FUZZ_RANDOM=1 explores new ones.
"""
from __future__ import annotations

import asyncio
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from livespeech.client.client import split_pieces
from reliability_helpers import ClientLoop, engine_state, leaks, record, server_tasks
from livespeech.api.protocol import Stub, pb

C = grpc.StatusCode
EXAMPLES = int(os.environ.get("LIVESPEECH_FUZZ_EXAMPLES", "80"))
RANDOM = os.environ.get("LIVESPEECH_FUZZ_RANDOM") == "1"
PIECE_LIMIT = 120
SESSION_LIMIT = 400
CALL_TIMEOUT_S = 30.0  # client deadline: an example never hangs the suite
# every status the .proto header documents; CANCELLED only when the client hung up
DOCUMENTED = {C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.FAILED_PRECONDITION, C.RESOURCE_EXHAUSTED, C.DEADLINE_EXCEEDED}


@pytest.fixture(scope="module")
def srv(server_factory):
    return server_factory(
        max_sessions=2,
        config_timeout_s=0.5,
        idle_timeout_s=1.0,
        max_text_piece_chars=PIECE_LIMIT,
        max_session_text_chars=SESSION_LIMIT,
        max_enrollment_seconds=1.0,
    )


@pytest.fixture(scope="module")
def client(srv):
    loop = ClientLoop()

    async def channel() -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(srv.address, options=[("grpc.max_send_message_length", 64 << 20)])

    ch = loop.run(channel())
    yield loop, Stub(ch)
    loop.run(ch.close())
    loop.close()


# ---------------------------------------------------------------- strategies

U32 = 2**32 - 1
ODD_CHARS = (
    "שלום עולם مرحبا بالعالم "  # RTL
    "👩\u200d👩\u200d👧 🏳️\u200d🌈 👍🏽 "  # emoji, ZWJ sequences, modifiers
    "e\u0301\u0302\u0303 a\u0308 "  # combining marks
    "\u202eevil\u202c \u200b\u200d\ufeff "  # bidi override, zero-width
    "\x00 \x07\x1b\x7f \r\n\t "  # NUL, controls, whitespace
    "Ａｂｃ ﬁ ℌ ẞ "  # compatibility forms
    "\U0010fffd \uffff "  # private use, noncharacter
    "Hello there, how are you? Fine. 42 — ok… "
)
texts = st.one_of(
    st.text(alphabet=st.sampled_from(ODD_CHARS), max_size=24),
    st.text(alphabet=st.sampled_from(ODD_CHARS), max_size=24),
    st.text(max_size=12),  # any code point hypothesis likes (no surrogates: not UTF-8)
    st.sampled_from(["", " ", ".", "a", "word ", "two words.", "\x00", "\u0301"]),
    st.sampled_from([PIECE_LIMIT, PIECE_LIMIT + 1, 10_000]).map(lambda n: "ab " * (n // 3) + "x" * (n % 3)),
)
SENTENCES = [
    "Hello there, how are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "Sure! Here is what I found: three results.",
    "One, two, three... go",
]
HUGE = 5 << 20  # over the server's gRPC max_receive_message_length (4 MiB here)
ABSURD = [math.nan, math.inf, -math.inf, -1.0, -0.0, 1e-300, 1e308, -1e308]
# mostly none or plausible (the session goes on), sometimes absurd or going backwards
timestamps = st.one_of(
    st.none(), st.none(), st.none(),
    st.sampled_from([0.0, 0.5, 3.0, 1e9]),
    st.sampled_from(ABSURD),
    st.floats(allow_nan=True, allow_infinity=True),
)


def opt(values: list) -> st.SearchStrategy:
    return st.sampled_from([None, *values])


# (field, values in range, values out of range)
FIELDS = (
    ("sample_rate", [8000, 16000, 24000, 48000], [0, 44100, U32]),
    ("packet_ms", [20, 80, 1000], [0, 19, 1001, U32]),
    ("n_past_chunks", [-1, 0, 4, 64], [65, -2, -(2**31), 2**31 - 1]),
    ("n_future_chunks", [0, 1, 2, 8], [9, -1]),
    ("start_future_chunks", [0], [9, -1]),
    ("min_packet_ms", [20], [0, 9, U32]),
    ("top_k", [1, 20, 1024], [0, 1025, U32]),
    ("seed", [0, 1, 2**64 - 1], []),
)
CHUNKING = (
    ("min_words", [1, 2], [0, 17]),
    ("max_words", [4, 16], [17, U32]),
    ("timer_ms", [0, 300, 10_000], [10_001, U32]),
    ("first_max_words", [2], [0, 17, U32]),
)


@st.composite
def configs(draw, wild: Optional[bool] = None) -> "pb.SynthesizeConfig":
    """In range (the session opens), or `wild`: any field may be out of range."""
    if wild is None:
        wild = draw(st.sampled_from([False, False, False, True]))
    msg = pb.SynthesizeConfig()
    # mostly hard guidance: an untrained model then speaks its text and stops
    lams = [math.inf] * 6 + [None, 0.0, 1.0, 1e308] + ([math.nan, -math.inf, -1.0] if wild else [])
    lam = draw(st.sampled_from(lams))
    if lam is not None:
        msg.guidance_lambda = lam
    for name, good, bad in FIELDS:
        v = draw(opt(good + (bad if wild else [])))
        if v is not None:
            setattr(msg, name, v)
    msg.encoding = draw(st.sampled_from([0, 1, 2] + ([3, 2**31 - 1] if wild else [])))
    msg.timestamps_are_speech_time = draw(st.booleans())
    if draw(st.booleans()):
        for name, good, bad in CHUNKING:
            v = draw(opt(good + (bad if wild else [])))
            if v is not None:
                setattr(msg.chunking, name, v)
        if draw(st.booleans()):
            msg.chunking.flush_on_punctuation = draw(st.booleans())
    voice = draw(st.sampled_from(["unset", "unset", "default", "enroll"] + (["id", "id", "enroll"] if wild else [])))
    if voice == "default":
        msg.voice_id = "default"
    elif voice == "id":
        msg.voice_id = draw(st.sampled_from(["", "../x", "a/b", "/etc/passwd", "nobody", "default\n", "x" * 10_000, "d\u0435fault"])
                            | st.text(max_size=20))
    elif voice == "enroll":
        good = (16000, 3200, False)  # 0.2 s
        rate, n, odd = good if not wild else (
            draw(st.sampled_from([0, 7999, 8000, 16000, 48000, 192_001, U32])),
            draw(st.sampled_from([0, 1, 400, 3200, 20_000])),  # 20k samples at 8 kHz: 2.5 s > the 1 s limit
            draw(st.booleans()),
        )
        pcm = (np.random.default_rng(n).standard_normal(n) * 3000).astype("<i2").tobytes()
        msg.enrollment.CopyFrom(pb.PcmAudio(pcm16_le=pcm[:-1] if odd else pcm, sample_rate=rate))
    return msg


def text_req(text: str, ts: Optional[float], flush: bool) -> "pb.SynthesizeRequest":
    t = pb.TextInput(text=text, flush=flush)
    if ts is not None:
        t.timestamp_s = ts
    return pb.SynthesizeRequest(text=t)


@st.composite
def actions(draw) -> tuple:
    kind = draw(st.sampled_from(["text"] * 12 + ["pause"] * 2 + ["end", "cancel", "config", "empty", "half_close"]))
    if kind == "text":
        return ("msg", text_req(draw(texts), draw(timestamps), draw(st.booleans())))
    if kind == "end":
        return ("msg", pb.SynthesizeRequest(end_of_input=pb.EndOfInput()))
    if kind == "cancel":
        return ("msg", pb.SynthesizeRequest(cancel=pb.Cancel()))
    if kind == "config":
        return ("msg", pb.SynthesizeRequest(config=draw(configs())))
    if kind == "empty":
        return ("msg", pb.SynthesizeRequest())
    if kind == "pause":
        return ("pause", draw(st.sampled_from([0.0, 0.01, 0.05, 0.2])))
    return ("half_close",)


@dataclass
class Script:
    actions: list
    half_close: bool  # after the last action (if no half_close action came first)
    hang_up_after_s: Optional[float]  # the client cancels the call after this long


@st.composite
def scripts(draw) -> Script:
    first = draw(st.sampled_from(["config"] * 9 + ["none", "other"]))
    acts: list = []
    if first == "config":
        acts.append(("msg", pb.SynthesizeRequest(config=draw(configs()))))
    elif first == "other":
        acts.append(draw(actions().filter(lambda a: not (a[0] == "msg" and a[1].WhichOneof("request") == "config"))))
    if draw(st.sampled_from([True, True, False])):  # a sentence in LLM-like pieces, so that many streams speak
        sentence = draw(st.sampled_from(SENTENCES))
        if draw(st.booleans()):  # with something odd spliced in
            at = draw(st.integers(0, len(sentence)))
            sentence = sentence[:at] + draw(st.text(alphabet=st.sampled_from(ODD_CHARS), min_size=1, max_size=6)) + sentence[at:]
        stamped = draw(st.booleans())
        for i, piece in enumerate(split_pieces(sentence)):
            acts.append(("msg", text_req(piece, 0.05 * i if stamped else None, False)))
        tail = draw(st.sampled_from(["none", "end", "random", "random"]))
        if tail == "end":
            acts.append(("msg", pb.SynthesizeRequest(end_of_input=pb.EndOfInput())))
        if tail != "random":
            return Script(acts, half_close=True, hang_up_after_s=draw(st.sampled_from([None] * 5 + [0.3, 1.0])))
    acts += draw(st.lists(actions(), max_size=8))
    if draw(st.sampled_from([False] * 14 + [True])):  # now and then a message over the gRPC size limit
        acts.insert(draw(st.integers(0, len(acts))), ("huge",))
    return Script(
        acts,
        half_close=draw(st.sampled_from([True, True, True, False])),
        hang_up_after_s=draw(st.sampled_from([None] * 5 + [0.0, 0.02, 0.1, 0.3, 1.0])),
    )


# ---------------------------------------------------------------- playing a script


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: list = field(default_factory=list)
    hung_up: bool = False


async def play(stub: Stub, script: Script) -> Outcome:
    call = stub.Synthesize(timeout=CALL_TIMEOUT_S)
    responses: list = []

    async def send() -> None:
        try:
            for act in script.actions:
                if act[0] == "msg":
                    await call.write(act[1])
                elif act[0] == "huge":
                    await call.write(text_req("y" * HUGE, None, False))
                elif act[0] == "pause":
                    await asyncio.sleep(act[1])
                else:
                    await call.done_writing()
                    return
            if script.half_close:
                await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            pass  # the call ended first: its status is what counts

    async def receive() -> None:
        try:
            async for r in call:
                responses.append(r)
        except grpc.aio.AioRpcError:
            pass
        except asyncio.CancelledError:  # grpc.aio's read of a call that was cancelled
            if asyncio.current_task().cancelling():
                raise  # this task itself is being cancelled

    sender = asyncio.create_task(send())
    reader = asyncio.create_task(receive())
    hung_up = False
    if script.hang_up_after_s is not None:
        done, _ = await asyncio.wait({reader}, timeout=script.hang_up_after_s)
        if not done:
            hung_up = call.cancel()
    await reader
    sender.cancel()
    await asyncio.gather(sender, return_exceptions=True)
    return Outcome(await call.code(), await call.details(), responses, hung_up)


def core_artefact(script: Script, out: Outcome) -> bool:
    """A message over max_receive_message_length is refused by the server's gRPC core
    (RESOURCE_EXHAUSTED "Received message larger than max"); when the client's write of
    it is still in flight, grpc's asyncio client replaces that status with its own
    INTERNAL "Internal error from Core" (grpc/grpc#36066). Client-side, and only then."""
    return out.code == C.INTERNAL and out.details == "Internal error from Core" and any(a[0] == "huge" for a in script.actions)


def check_outcome(script: Script, out: Outcome) -> None:
    allowed = DOCUMENTED | ({C.CANCELLED} if out.hung_up else set())
    if core_artefact(script, out):
        return
    assert out.code in allowed, f"{out.code.name}: {out.details!r}"
    if out.hung_up:
        return
    first = next((a for a in script.actions if a[0] != "pause"), None)
    if first is not None and not (first[0] == "msg" and first[1].WhichOneof("request") == "config"):
        if first[0] == "half_close" or first[0] == "msg" or first[0] == "huge":
            # an over-size message read while the refusal is on its way: gRPC's own status
            huge = any(a[0] == "huge" for a in script.actions)
            expected = {C.INVALID_ARGUMENT} | ({C.RESOURCE_EXHAUSTED} if huge else set())
            assert out.code in expected, f"no config first: {out.code.name} {out.details!r}"
    if out.code == C.OK:
        kinds = [r.WhichOneof("response") for r in out.responses]
        assert kinds[0] == "started" and kinds[-1] == "summary" and kinds.count("summary") == 1, kinds
        seqs = [r.audio.seq for r in out.responses if r.WhichOneof("response") == "audio"]
        assert seqs == list(range(len(seqs)))


# streams counts every example run, shrinking included
STATS: dict[str, Any] = dict(streams=0, started=0, with_audio=0, hung_up=0, crashes=0, leaks=0, codes={}, client_core_internal=0)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not RANDOM,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
@given(script=scripts())
def test_random_request_streams(srv, client, script: Script) -> None:
    loop, stub = client
    if "baseline" not in STATS:
        assert srv.wait_idle()
        STATS["baseline"] = server_tasks(srv)
    out = loop.run(play(stub, script), timeout=CALL_TIMEOUT_S + 30)
    STATS["streams"] += 1
    kinds = [r.WhichOneof("response") for r in out.responses]
    STATS["started"] += "started" in kinds
    STATS["with_audio"] += "audio" in kinds
    STATS["hung_up"] += out.hung_up
    STATS["codes"][out.code.name] = STATS["codes"].get(out.code.name, 0) + 1
    details = STATS.setdefault("details", {}).setdefault(out.code.name, set())
    if len(details) < 4:
        details.add(out.details[:60])
    if core_artefact(script, out):
        STATS["client_core_internal"] += 1
    elif out.code in (C.INTERNAL, C.UNKNOWN):
        STATS["crashes"] += 1
        kinds = STATS.setdefault("crash_kinds", {})
        kinds[out.details[:80]] = kinds.get(out.details[:80], 0) + 1
    left = leaks(srv, STATS["baseline"], timeout=10.0)
    if left:
        STATS["leaks"] += 1
    assert engine_state(srv)["engine_alive"], "the engine thread died"
    assert not left, f"not back at rest after the stream: {left}"
    check_outcome(script, out)


def test_fuzz_figures(srv) -> None:
    """Runs after the property (file order): the figures for docs/reliability.md."""
    if not STATS["streams"]:
        pytest.skip("the property did not run")
    figures = {k: v for k, v in STATS.items() if k not in ("baseline", "details")}
    figures["details"] = {k: sorted(v) for k, v in STATS.get("details", {}).items()}
    record("fuzz", dict(examples_setting=EXAMPLES, random=RANDOM, **figures))
    assert STATS["crashes"] == 0 and STATS["leaks"] == 0
    assert engine_state(srv)["engine_alive"]
