"""Plain tensor functions as TorchScript, compiled on first use.

A scripted function runs its ops from TorchScript's interpreter, with no Python between
them (the decode step's sampler, ~40 small ops: 0.57 ms against 0.85 ms eager at batch
1 on the CPU, docs/loadtest.md), and a trace that calls one keeps its control flow
(loops over a runtime length) instead of unrolling it.
"""
from __future__ import annotations

import functools
import logging
import warnings
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)
log = logging.getLogger("livespeech.models")


def scripted(fn: F) -> Callable[[], F]:
    """A getter for `fn` as TorchScript, compiled by its first call and kept; `fn` itself
    where this torch cannot script it (the same function, run by Python)."""
    @functools.cache
    def get() -> F:
        with warnings.catch_warnings():  # torch.jit's deprecation notice
            warnings.simplefilter("ignore")
            try:
                return torch.jit.script(fn)
            except Exception as exc:  # noqa: BLE001 - a torch without TorchScript
                log.warning("%s runs eagerly: TorchScript failed (%s)", fn.__qualname__, str(exc).splitlines()[0])
                return fn
    return get


def kernel_fusion(on: bool) -> None:
    """Whether TorchScript generates fused kernels for scripted functions (process-wide).
    On CUDA its fuser compiles a kernel for each new input shape, and a server's batch
    takes new sizes as sessions come and go: steps of ~2 s at new batch sizes on an H100
    (docs/loadtest.md, "GPU over gRPC"); the runner turns it off there. On the CPU it
    fuses nothing unless told to."""
    torch._C._jit_set_texpr_fuser_enabled(on)
