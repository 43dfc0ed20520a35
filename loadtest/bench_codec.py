"""Streaming codec decode cost per packet (1 thread by default: the CPU boxes are shared).

    python -m livespeech.loadtest.bench_codec [--threads 1] [--repeats 20]
    python -m livespeech.loadtest.bench_codec --codec models/weights/default/codec.pt --native --repeats 100

Random presets by default; `--codec` times a trained codec instead, and `--native` its
decoder step as the server's native call (`NativeCodecStep`) rather than torch's
`decode_step`. Each case is (sessions, frames a packet), random codes.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import torch

from livespeech.models.codec import CodecModel, preset

CASES = ((1, 1), (1, 5), (1, 15), (16, 6), (16, 15))  # (batch, frames per packet)


def bench(name: str, repeats: int, path: Optional[str] = None, native: bool = False) -> None:
    torch.manual_seed(0)
    if path is None:
        model = CodecModel(preset(name)).eval()
    else:
        from livespeech.models.loading import load_codec

        model = load_codec(path, 8)
    cfg = model.config
    step = model.decode_step
    if native:
        from livespeech.models.step_graph import NativeCodecStep

        step = NativeCodecStep(model, cfg.n_q)
    for batch, frames in CASES:
        state = model.streaming_state(batch)
        codes = torch.randint(0, cfg.codebook_size, (batch, cfg.n_q, max(frames, model.min_first_frames)))
        with torch.inference_mode():
            step(codes, state)  # warm-up; also passes the first-packet minimum
            codes = codes[..., :frames]
            wall, cpu = [], []
            for _ in range(repeats):
                t0, c0 = time.perf_counter(), time.thread_time()
                step(codes, state)
                wall.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
        # On a shared box the wall clock includes time other processes held the core;
        # the thread's CPU time (meaningful with 1 thread) does not.
        cpu_ms, wall_ms = statistics.median(cpu) * 1e3, statistics.median(wall) * 1e3
        audio_ms = frames * 1e3 / cfg.frame_rate * batch
        print(f"{name:14s} n_q={cfg.n_q:2d} batch {batch:2d} x {frames:2d} frames: cpu {cpu_ms:7.2f} ms, "
              f"wall {wall_ms:7.2f} ms (medians of {repeats}; {audio_ms / cpu_ms:5.1f}x real time per core)")


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--presets", nargs="+", default=["small", "encodec_24khz"])
    ap.add_argument("--codec", help="a trained codec checkpoint to time instead of the random presets")
    ap.add_argument("--native", action="store_true", help="time the native decoder step (NativeCodecStep)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.codec:
        bench("codec", args.repeats, args.codec, args.native)
    else:
        for name in args.presets:
            bench(name, args.repeats, native=args.native)


if __name__ == "__main__":
    main()
