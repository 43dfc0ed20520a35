"""Streaming codec decode cost per packet (1 thread by default: the CPU boxes are shared).

    python -m livespeech.loadtest.bench_codec [--threads 1] [--repeats 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from livespeech.models.codec import CodecModel, preset

CASES = ((1, 1), (1, 5), (1, 15), (16, 15))  # (batch, frames per packet)


def bench(name: str, repeats: int) -> None:
    torch.manual_seed(0)
    model = CodecModel(preset(name)).eval()
    cfg = model.config
    for batch, frames in CASES:
        state = model.streaming_state(batch)
        codes = torch.randint(0, cfg.codebook_size, (batch, cfg.n_q, max(frames, model.min_first_frames)))
        model.decode_step(codes, state)  # warm-up; also passes the first-packet minimum
        codes = codes[..., :frames]
        wall, cpu = [], []
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.thread_time()
            model.decode_step(codes, state)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        # On a shared box the wall clock includes time other processes held the core;
        # the thread's CPU time (meaningful with 1 thread) does not.
        cpu_ms, wall_ms = statistics.median(cpu) * 1e3, statistics.median(wall) * 1e3
        audio_ms = frames * 1e3 / cfg.frame_rate * batch
        print(f"{name:14s} n_q={cfg.n_q:2d} batch {batch:2d} x {frames:2d} frames: cpu {cpu_ms:7.2f} ms, "
              f"wall {wall_ms:7.2f} ms (medians of {repeats}; {audio_ms / cpu_ms:5.1f}x real time per core)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--presets", nargs="+", default=["small", "encodec_24khz"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.presets:
        bench(name, args.repeats)


if __name__ == "__main__":
    main()
