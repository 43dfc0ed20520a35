"""Drive concurrent sessions over real gRPC (clients/client.py) and measure them.

Two ways to speak a turn (workload.py):
- streaming: one Synthesize call, the pieces sent as the upstream produces them;
- sentence (the baseline): each sentence waits until its last piece was produced (as if
  the LLM had to finish the sentence first), then is synthesised in offline mode
  (n_past_chunks=-1, the whole sentence in one message, end of input at once), one call
  after another; the calls' audio plays back to back.

Every turn is timed from its first piece (the moment the upstream produced its first
token): `ttfa_user_s` = first audio packet received - that moment, for both modes. The
server's own TTFA / lookahead wait / compute FPL come from the (first) call's summary.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import grpc

from .playback import Packet, concat_timelines, describe, percentile, simulate_playback
from .workload import Pacing, Turn, make_turn

STREAMING = "streaming"
SENTENCE = "sentence"


@dataclass
class LevelSpec:
    n: int  # concurrent sessions
    mode: str  # STREAMING | SENTENCE
    duration_s: float  # new turns start only within this window
    max_sessions: int  # and at most this many turns in all
    corpus: tuple[str, ...]
    sentences_per_turn: int
    pacing: Pacing
    config: dict  # SessionConfig overrides for the streaming calls
    baseline_config: dict  # ... for the sentence-level calls
    session_timeout_s: float = 120.0
    ramp_s: float = 1.0  # worker i starts at i * ramp_s / n
    seed: int = 0
    prebuffer_s: float = 0.0


@dataclass
class TurnRecord:
    mode: str
    worker: int
    turn: int
    seed: int
    sentences: int
    words: int
    chars: int
    upstream_s: float  # when the last piece was produced (after the first)
    t_start: float = 0.0  # monotonic, first piece
    t_end: float = 0.0
    calls: int = 0
    ttfa_user_s: Optional[float] = None
    # from the server's summary of the first call
    ttfa_server_s: Optional[float] = None
    lookahead_wait_s: Optional[float] = None
    compute_fpl_s: Optional[float] = None
    audio_s: float = 0.0  # from the summaries (sum over calls)
    frames: int = 0
    spoken_words: int = 0  # words in the summaries' spoken_text (all of `words` when the whole text was spoken)
    packets: int = 0
    underruns: int = 0
    starved_s: float = 0.0
    max_stall_s: float = 0.0
    late_fixed_clock: int = 0
    # where the first stalls were: (position on the audio timeline s, stall s)
    stalls: list = dataclasses.field(default_factory=list)
    # the least audio the listener held when a packet arrived, and where (livespeech.loadtest.playback)
    min_slack_s: Optional[float] = None
    min_slack_at_s: Optional[float] = None
    timeline_gaps_s: float = 0.0
    completed: bool = False
    error: Optional[str] = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _seed(base: int, worker: int, turn: int) -> int:
    return (base * 1_000_003 + worker * 10_007 + turn) % (2**31)


async def _collect(stream, packets: list[Packet]) -> Any:
    """Read a call to the end; returns its Summary (None if none came)."""
    from livespeech.api.session import AudioPacket, Summary

    summary = None
    async for ev in stream:
        now = time.monotonic()
        if isinstance(ev, AudioPacket):
            packets.append(Packet(now, ev.start_s, ev.duration_s))
        elif isinstance(ev, Summary):
            summary = ev
    return summary


def _err(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code().name
    if isinstance(e, asyncio.TimeoutError):
        return "CLIENT_TIMEOUT"
    return type(e).__name__


async def run_streaming_turn(client, turn: Turn, config: dict, rec: TurnRecord, prebuffer_s: float = 0.0) -> TurnRecord:
    packets: list[Packet] = []
    t0: list[float] = []

    async def source():
        t0.append(time.monotonic())
        for p in turn.pieces:
            delay = t0[0] + p.t_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            yield p.text

    rec.calls = 1
    summary = None
    try:
        summary = await _collect(client.synthesize(source(), **config), packets)
    except BaseException as e:  # noqa: BLE001 - recorded, the run goes on
        if isinstance(e, asyncio.CancelledError):
            raise
        rec.error = _err(e)
    rec.t_start = t0[0] if t0 else time.monotonic()
    rec.t_end = time.monotonic()
    _finish(rec, [packets], [summary], prebuffer_s)
    return rec


async def run_sentence_turn(client, turn: Turn, config: dict, rec: TurnRecord, prebuffer_s: float = 0.0) -> TurnRecord:
    t0 = time.monotonic()
    rec.t_start = t0
    done_at = turn.sentence_complete_s()
    calls: list[list[Packet]] = []
    summaries: list[Any] = []
    try:
        for i, sentence in enumerate(turn.sentences):
            delay = t0 + done_at[i] - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            packets: list[Packet] = []
            calls.append(packets)
            rec.calls += 1
            summaries.append(await _collect(client.synthesize(sentence, **config), packets))
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, asyncio.CancelledError):
            raise
        rec.error = _err(e)
    rec.t_end = time.monotonic()
    _finish(rec, calls, summaries, prebuffer_s)
    return rec


def _finish(rec: TurnRecord, calls: list[list[Packet]], summaries: list[Any], prebuffer_s: float) -> None:
    packets = concat_timelines(calls)
    pb = simulate_playback(packets, prebuffer_s=prebuffer_s)
    rec.packets = pb.packets
    rec.underruns = pb.underruns
    rec.starved_s = pb.starved_s
    rec.max_stall_s = pb.max_stall_s
    rec.late_fixed_clock = pb.late_fixed_clock
    rec.stalls = [(round(at, 3), round(late, 4)) for at, late in pb.stalls[:10]]
    rec.min_slack_s, rec.min_slack_at_s = pb.min_slack_s, pb.min_slack_at_s
    rec.timeline_gaps_s = pb.gaps_s
    if pb.first_arrival_s is not None:
        rec.ttfa_user_s = pb.first_arrival_s - rec.t_start
    first = summaries[0] if summaries else None
    if first is not None:
        rec.ttfa_server_s = first.ttfa_s
        rec.lookahead_wait_s = first.lookahead_wait_s
        rec.compute_fpl_s = first.compute_fpl_s
    rec.audio_s = sum(s.audio_s for s in summaries if s is not None)
    rec.frames = sum(s.frames for s in summaries if s is not None)
    rec.spoken_words = sum(len(s.spoken_text.split()) for s in summaries if s is not None)
    if rec.error is None and (not summaries or any(s is None for s in summaries)):
        rec.error = "NO_SUMMARY"
    rec.completed = rec.error is None


async def _loop_lag(stop: asyncio.Event, out: list[float], period: float = 0.01) -> None:
    while not stop.is_set():
        t = time.monotonic()
        await asyncio.sleep(period)
        out.append(max(0.0, time.monotonic() - t - period))


async def run_level(client, spec: LevelSpec) -> dict:
    """N workers, each speaking turns back to back until the window or the session budget
    runs out; returns the records and the client-side aggregate."""
    records: list[TurnRecord] = []
    budget = [spec.max_sessions]
    start = time.monotonic()
    deadline = start + spec.duration_s
    run_turn = run_streaming_turn if spec.mode == STREAMING else run_sentence_turn
    cfg = spec.config if spec.mode == STREAMING else spec.baseline_config

    async def worker(w: int) -> None:
        await asyncio.sleep(w * spec.ramp_s / max(1, spec.n))
        j = 0
        while time.monotonic() < deadline and budget[0] > 0:
            budget[0] -= 1
            seed = _seed(spec.seed, w, j)
            turn = make_turn(spec.corpus, spec.sentences_per_turn, spec.pacing, seed)
            rec = TurnRecord(spec.mode, w, j, seed, len(turn.sentences), turn.words, len(turn.text),
                             turn.pieces[-1].t_s if turn.pieces else 0.0)
            call_cfg = dict(cfg)
            if call_cfg.get("seed") is None:
                call_cfg["seed"] = seed
            try:
                await asyncio.wait_for(run_turn(client, turn, call_cfg, rec, spec.prebuffer_s),
                                       spec.session_timeout_s * max(1, len(turn.sentences)))
            except asyncio.TimeoutError:
                rec.error = rec.error or "CLIENT_TIMEOUT"
                rec.completed = False
                rec.t_end = time.monotonic()
            records.append(rec)
            j += 1

    stop = asyncio.Event()
    lags: list[float] = []
    lag_task = asyncio.create_task(_loop_lag(stop, lags))
    try:
        await asyncio.gather(*(worker(w) for w in range(spec.n)))
    finally:
        stop.set()
        await lag_task
    end = time.monotonic()
    return {
        "n": spec.n,
        "mode": spec.mode,
        "wall_s": end - start,
        "records": [r.as_dict() for r in records],
        "client": aggregate(records),
        "client_loop_lag_s": describe(lags),
    }


def aggregate(records: list[TurnRecord]) -> dict:
    done = [r for r in records if r.completed]
    codes: dict[str, int] = {}
    for r in records:
        if r.error:
            codes[r.error] = codes.get(r.error, 0) + 1
    return {
        "sessions": len(records),
        "completed": len(done),
        "errors": len(records) - len(done),
        "error_codes": codes,
        "ttfa_user_s": describe([r.ttfa_user_s for r in done]),
        "ttfa_server_s": describe([r.ttfa_server_s for r in done]),
        "lookahead_wait_s": describe([r.lookahead_wait_s for r in done]),
        "compute_fpl_s": describe([r.compute_fpl_s for r in done]),
        "underruns": sum(r.underruns for r in records),
        "sessions_with_underruns": sum(1 for r in records if r.underruns),
        "starved_s": sum(r.starved_s for r in records),
        "starved_s_per_session": describe([r.starved_s for r in done]),
        "late_fixed_clock": sum(r.late_fixed_clock for r in records),
        # per session, the least audio its listener held as a packet arrived: its low
        # percentiles show how near the load came to underruns when it had none
        "min_slack_s": {f"p{q}": percentile([r.min_slack_s for r in done], q) for q in (1, 5, 10, 50)},
        "audio_s": sum(r.audio_s for r in records),
        "audio_s_per_session": describe([r.audio_s for r in done]),
        # how long the client spent per audio second (> 1: text or compute was slower than speech)
        "wall_per_audio_s": describe([(r.t_end - r.t_start) / r.audio_s for r in done if r.audio_s > 0]),
        "upstream_s": describe([r.upstream_s for r in records]),
        "words_per_session": describe([float(r.words) for r in records]),
        # fraction of the text's words the server reports as spoken (1.0: the whole text)
        "spoken_fraction": describe([r.spoken_words / r.words for r in done if r.words]),
    }


async def ensure_voice(client, voice: Optional[str]) -> tuple[str, bool]:
    """(voice id to use, whether we registered it). With no --voice: the server's
    'default' voice if it has one, else a noise voice registered for the run."""
    if voice:
        return voice, False
    voices = await client.list_voices()
    if any(v.voice_id == "default" for v in voices):
        return "default", False
    import numpy as np

    noise = (np.random.default_rng(0).standard_normal(24000) * 0.1 * 32767).astype("<i2").tobytes()
    vid = f"loadtest-{os.getpid()}"
    await client.register_voice(vid, pcm16=noise, sample_rate=24000, overwrite=True)
    return vid, True


def session_overrides(*, voice_id: str, packet_ms: int, n_past: int, n_future: int, guidance_lambda: Optional[float],
                      top_k: Optional[int], seed: Optional[int], min_packet_ms: Optional[int] = None,
                      start_future_chunks: Optional[int] = None) -> dict:
    cfg: dict = {"voice_id": voice_id, "packet_ms": packet_ms, "n_past_chunks": n_past, "n_future_chunks": n_future}
    if min_packet_ms is not None:
        cfg["min_packet_ms"] = min_packet_ms
    if start_future_chunks is not None:
        cfg["start_future_chunks"] = start_future_chunks
    if guidance_lambda is not None:
        cfg["guidance_lambda"] = float(guidance_lambda)
    if top_k is not None:
        cfg["top_k"] = top_k
    cfg["seed"] = seed
    return cfg


def jsonable(x: Any) -> Any:
    """Replace non-finite floats (inf lambda) for strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x
