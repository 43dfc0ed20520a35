"""A decode step's host-side inputs sent to the device in one copy.

A step's per-row settings (windows, top-k, temperatures, guiding sets, forced tokens)
are known on the host. Sent one `torch.tensor(..., device=...)` at a time, each is a copy
from pageable memory, which PyTorch makes synchronous on a GPU: the host waits for every
kernel queued before it, a dozen times a step. `Upload` gathers them into one float64
buffer (exact for flags, ids and float32 values), copied once, without blocking from
pinned memory on CUDA, and hands back each part as a tensor of its own dtype and shape.

    up = Upload()
    lo = up.add([0, 3], torch.long)
    k = up.add([20, 20], torch.long)
    sent = up.send(device)
    sent[lo], sent[k]
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch


class Upload:
    def __init__(self) -> None:
        self._values: list[float] = []
        self._parts: list[tuple[int, tuple[int, ...], torch.dtype]] = []

    def add(self, values: Iterable, dtype: torch.dtype, shape: Optional[Sequence[int]] = None) -> int:
        """Stage flat `values` (numbers or bools) as a tensor of `dtype` and `shape` (default
        1-D); returns its index in what `send` returns."""
        start = len(self._values)
        self._values.extend(values)
        n = len(self._values) - start
        shape = (n,) if shape is None else tuple(shape)
        if math.prod(shape) != n:
            raise ValueError(f"{n} values do not fill a tensor of shape {shape}")
        self._parts.append((start, shape, dtype))
        return len(self._parts) - 1

    def send(self, device: torch.device) -> list[torch.Tensor]:
        """Every staged part on `device`, in one copy."""
        buf = torch.tensor(self._values, dtype=torch.float64)
        if device.type == "cuda":
            buf = buf.pin_memory()
        buf = buf.to(device, non_blocking=True)
        return [buf[s: s + math.prod(shape)].view(shape).to(dtype) for s, shape, dtype in self._parts]
