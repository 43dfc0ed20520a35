"""Learning-rate schedule and run length shared by the codec and decoder trainers.

A run is either a number of steps (the CPU default: the cosine decays over --steps) or a
wall-clock budget (--minutes, for a GPU lent for a fixed time: the cosine decays over the
training time, so the run ends at the low learning rate whatever the step speed turns
out to be). Training time is carried across --resume in the checkpoint.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Schedule:
    base_lr: float
    warmup: int
    steps: int
    minutes: Optional[float] = None
    min_ratio: float = 0.1

    def __post_init__(self):
        if self.base_lr <= 0 or self.warmup < 0 or self.steps < 1:
            raise ValueError("need lr > 0, warmup >= 0, steps >= 1")
        if self.minutes is not None and self.minutes <= 0:
            raise ValueError("minutes must be > 0")

    def progress(self, step: int, train_s: float) -> float:
        """0 at the end of warmup, 1 at the end of the run."""
        if self.minutes is not None:
            return min(1.0, train_s / (self.minutes * 60))
        return min(1.0, max(0, step - self.warmup) / max(1, self.steps - self.warmup))

    def lr(self, step: int, train_s: float = 0.0) -> float:
        if step < self.warmup:
            return self.base_lr * (step + 1) / self.warmup
        p = self.progress(step, train_s)
        return self.base_lr * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))

    def finished(self, step: int, train_s: float) -> bool:
        if self.minutes is not None:
            return train_s >= self.minutes * 60
        return step >= self.steps


def setup_device(name: str, threads: int, memory_share: float = 1.0) -> torch.device:
    """The training device; on CUDA, TF32 matmuls/convolutions (fp32 accuracy is not
    needed for training and TF32 is several times faster on Ampere and later), and at most
    `memory_share` of the GPU's memory for this process: runs side by side on one GPU each
    take their share, so a caching allocator frees its cache before it takes the memory
    another run needs (uncapped, one run's cache can starve the other)."""
    if not 0 < memory_share <= 1:
        raise SystemExit(f"--cuda-memory-share must be in (0, 1], got {memory_share}")
    torch.set_num_threads(threads)
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        if memory_share < 1:
            # the call wants an index; a bare "cuda" means the current device
            index = device.index if device.index is not None else torch.cuda.current_device()
            torch.cuda.set_per_process_memory_fraction(memory_share, index)
    return device
