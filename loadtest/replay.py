"""In-process replay of LLM-paced turns: where a session's listener starves, and why.

    python -m livespeech.loadtest.replay --sessions 2 --turns 3
    python -m livespeech.loadtest.replay --sessions 2 --turns 3 --eager-step --json replay.json

The real engine (server/engine.py), no gRPC: `--sessions` workers, started
`--stagger-s` apart, each speak `--turns` turns one after another, fed like the load
test's LLM upstream (livespeech.loadtest.workload). Each session's packets are played by the load
test's simulated listener (livespeech.loadtest.playback), so its stalls are the load test's
underruns, less whatever gRPC adds. Per turn it prints the stalls (timeline position,
ms), the first packets (frames, ms after the first) and the session's *text waits*: the
steps at which it stopped for text (`Engine._wait_for_text`: the start policy false
after it had started) with the audio its listener held then. A stall with a text wait
just before it is the start policy's, not the engine's speed. A measurement, not a test:
timings vary.

`--max-delay N` is a what-if for latency only: it caps the decoder's codebook delays at
N (0..8 -> 0,1,..,N,N,..), so the first frame is complete N + 1 steps after the start
instead of 9. The weights were trained with their own delays, so the speech is not
meaningful; the step count and the step's cost are the same as a model trained so.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

from livespeech.server.runner import codec_runtime, matmul_weights

from .playback import Packet, describe, simulate_playback
from .profile_step import Patches, add_path_arguments, noise_reference
from .workload import Pacing, load_sentences, make_turn


def replay(bundle, sessions: int, turns: int, stagger_s: float = 0.5, pacing: Pacing = Pacing(),
           sentences_per_turn: int = 2, text_file: Optional[str] = None, frozen_step: bool = True,
           seed: int = 0, timeout_s: float = 120.0, start_future_chunks: Optional[int] = None,
           release_when_waiting: Optional[bool] = None, weights: str = "float32", codec: str = "torch",
           chunk_words: Optional[tuple[int, int]] = None, cuda_graphs: bool = False,
           first_chunk_words: Optional[int] = None, device_guidance: bool = False) -> dict[str, Any]:
    from livespeech.server.engine import Engine, EngineConfig
    from livespeech.server.session import EngineSession
    from livespeech.api.session import AudioPacket, ChunkingConfig, Failed, Finished, SessionConfig

    corpus = load_sentences(text_file)
    options: dict[str, Any] = {} if start_future_chunks is None else {"start_future_chunks": start_future_chunks}
    chunking: dict[str, Any] = {} if chunk_words is None else {"min_words": chunk_words[0], "max_words": chunk_words[1]}
    if release_when_waiting is not None:
        chunking["release_when_waiting"] = release_when_waiting
    if first_chunk_words is not None:
        chunking["first_max_words"] = first_chunk_words
    if chunking:
        options["chunking"] = ChunkingConfig(**chunking)
    engine = Engine(bundle, EngineConfig(max_sessions=sessions, frozen_step=frozen_step, matmul_weights=weights,
                                         codec_runtime=codec, cuda_graphs=cuda_graphs,
                                         device_guidance=device_guidance))
    voice = engine.make_voice("replay", noise_reference(seed), 24000)
    waits: dict[int, list[dict]] = {}  # id(EngineSession) -> its text waits
    wait_for_text = Engine._wait_for_text

    def watched_wait(eng: Engine, s: EngineSession) -> None:
        waits.setdefault(id(s), []).append({"step": s.step_count, "frames_sent": s.frames_done,
                                            "audio_ahead_ms": 1000 * s.audio_ahead_s(time.monotonic())})
        wait_for_text(eng, s)

    results: list[dict] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        time.sleep(i * stagger_s)
        for t in range(turns):
            turn = make_turn(corpus, sentences_per_turn, pacing, seed=seed + 1000 * i + t)
            packets: list[Packet] = []
            summary: list = []
            done = threading.Event()

            def sink(ev) -> None:
                if isinstance(ev, AudioPacket):
                    packets.append(Packet(time.monotonic(), ev.start_s, ev.duration_s))
                elif isinstance(ev, (Finished, Failed)):
                    summary.append(getattr(ev, "summary", None))
                    done.set()

            t0 = time.monotonic()
            session = engine.open_session(SessionConfig(seed=seed + 100 * i + t, guidance_lambda=math.inf, **options),
                                          voice, sink)
            for piece in turn.pieces:
                delay = t0 + piece.t_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                session.push_text(piece.text)
            session.end_input()
            finished = done.wait(timeout_s)
            pb = simulate_playback(packets)
            first = packets[0].arrival_s if packets else 0.0
            with lock:
                results.append({
                    "worker": i, "turn": t, "finished": finished, "underruns": pb.underruns,
                    "starved_ms": 1000 * pb.starved_s,
                    "stalls": [(round(pos, 3), round(1000 * ms, 1)) for pos, ms in pb.stalls],
                    "first_packets": [(round(p.duration_s * 75), round(1000 * (p.arrival_s - first)))
                                      for p in packets[:8]],
                    "text_waits": waits.get(id(session), []),
                    **{f"{name}_ms": None if value is None else 1000 * value
                       for name, value in _latencies(summary[0] if summary else None).items()},
                })

    # the slowest engine steps and codec calls (a stall's cause when one call is long)
    timed: dict[str, list[tuple[float, int, int]]] = {"steps": [], "codec_calls": []}
    t_start = time.monotonic()

    def timing(kind: str, fn, size):
        def call(*args, **kw):
            t = time.perf_counter()
            out = fn(*args, **kw)
            with lock:
                at = round(time.monotonic() - t_start, 2)
                timed[kind].append((1000 * (time.perf_counter() - t), *size(*args), at))
            return out
        return call

    engine._step = timing("steps", engine._step, lambda batch: (len(batch), 0))
    engine.runner.decode = timing("codec_calls", engine.runner.decode,
                                  lambda slots, frames: (len(slots), len(frames[0])))
    patches = Patches()
    patches.set(Engine, "_wait_for_text", watched_wait)  # for this run only
    engine.start()
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(sessions)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        engine.stop()
        patches.undo()
    results.sort(key=lambda r: (r["worker"], r["turn"]))
    return {"sessions": sessions, "turns": turns, "stagger_s": stagger_s, "llm_rate": pacing.llm_rate,
            "frozen_step": frozen_step, "matmul_weights": weights, "device_guidance": device_guidance,
            "underruns": sum(r["underruns"] for r in results),
            # (ms, batch, frames (codec calls), seconds into the run): the five slowest of each
            **{f"slowest_{kind}": sorted(calls, reverse=True)[:5] for kind, calls in timed.items()},
            "starved_ms": sum(r["starved_ms"] for r in results), "text_waits": sum(len(r["text_waits"]) for r in results),
            "turn_results": results}


def _latencies(summary) -> dict[str, Optional[float]]:
    """The engine's own TTFA, lookahead wait and compute FPL of one turn (seconds)."""
    return {name: getattr(summary, f"{name}_s", None) for name in ("ttfa", "lookahead_wait", "compute_fpl")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m livespeech.loadtest.replay", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="default", help="model directory or random:<preset>[/<codec>]")
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--turns", type=int, default=3, help="turns per session, one after another")
    ap.add_argument("--stagger-s", type=float, default=0.5, help="worker i starts i * this late")
    ap.add_argument("--llm-rate", type=float, default=40.0, help="LLM pieces per second")
    ap.add_argument("--sentences-per-turn", type=int, default=2)
    ap.add_argument("--text-file", default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--eager-step", action="store_true", help="the eager model step and codec (default: frozen)")
    ap.add_argument("--start-future-chunks", type=int, default=None, help="the sessions' start policy (default: the server's)")
    ap.add_argument("--release-when-waiting", choices=("on", "off"), default=None,
                    help="chunking: release min_words at once while the speech waits for text (default: the server's)")
    ap.add_argument("--chunk-words", default=None, metavar="MIN,MAX",
                    help="chunking: words a chunk, e.g. 2,4 (default: the server's)")
    ap.add_argument("--first-chunk-words", type=int, default=None, metavar="N",
                    help="chunking: the first chunk's most words (default: the server's)")
    ap.add_argument("--max-delay", type=int, default=None,
                    help="cap the decoder's codebook delays (latency what-if; the speech is not meaningful)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="the step and the codec's steady packets from CUDA graphs")
    ap.add_argument("--device-guidance", action="store_true",
                    help="every session's guidance as tensors on the device (the server's --device-guidance)")
    add_path_arguments(ap)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.sessions < 1 or args.turns < 1:
        ap.error("--sessions and --turns must be >= 1")
    if args.max_delay is not None and args.max_delay < 0:
        ap.error("--max-delay must be >= 0")
    torch.set_num_threads(args.threads)
    from livespeech.models.loading import load_bundle

    bundle = load_bundle(None if args.model_path in ("", "default") else args.model_path, device=args.device)
    if args.max_delay is not None:
        cfg = bundle.model.cfg
        bundle.model.cfg = dataclasses.replace(cfg, delays=tuple(min(d, args.max_delay) for d in cfg.delays))
    res = replay(bundle, args.sessions, args.turns, args.stagger_s, Pacing(llm_rate=args.llm_rate).validate(),
                 args.sentences_per_turn, args.text_file, frozen_step=not args.eager_step, seed=args.seed,
                 start_future_chunks=args.start_future_chunks,
                 release_when_waiting=None if args.release_when_waiting is None else args.release_when_waiting == "on",
                 weights=matmul_weights(args.matmul_weights, args.device),
                 codec=codec_runtime(args.codec_runtime, args.device),
                 chunk_words=None if args.chunk_words is None else tuple(int(x) for x in args.chunk_words.split(",")),
                 cuda_graphs=args.cuda_graphs, first_chunk_words=args.first_chunk_words,
                 device_guidance=args.device_guidance)
    res["delays"] = list(bundle.model.cfg.delays)
    print(f"codebook delays {res['delays']}")
    print(f"{res['sessions']} sessions x {res['turns']} turns: {res['underruns']} underruns, "
          f"{res['starved_ms']:.0f} ms starved, {res['text_waits']} text waits")
    for kind in ("steps", "codec_calls"):
        print(f"  slowest {kind.replace('_', ' ')} (ms, batch, frames, s into the run): "
              + ", ".join(f"({ms:.0f}, {b}, {f}, {at})" for ms, b, f, at in res[f"slowest_{kind}"]))
    for key in ("ttfa_ms", "lookahead_wait_ms", "compute_fpl_ms"):
        if (q := describe([r[key] for r in res["turn_results"]]))["n"]:
            print(f"  {key[:-3]} p50 / p95: {q['p50']:.1f} / {q['p95']:.1f} ms")
    for r in res["turn_results"]:
        print(f"  worker {r['worker']} turn {r['turn']}: stalls {r['stalls']} first packets {r['first_packets']} "
              f"text waits {[(w['step'], w['frames_sent'], round(w['audio_ahead_ms'])) for w in r['text_waits']]}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
