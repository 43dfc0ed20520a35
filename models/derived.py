"""Tensors derived from parameters for the decode step, built once and rebuilt only
when a source changes.

A decode step on CPU is dispatch- and lookup-bound (docs/loadtest.md): re-deriving a
constant (exp(A_log), a stacked head matrix) or walking nn.Module attributes each step
costs a measurable share of it. A training step changes a parameter in place (its
`_version` moves) and `.to()` gives it new storage (its `data_ptr` moves); either one
rebuilds the derived value, so a cached value is never stale.

Weights are kept transposed ([in, out], contiguous) for the step: a one-row matmul
against a weight that streams from memory ran up to 3x faster in that layout than
`F.linear` on the [out, in] original (2-core EPYC, wide outputs; docs/loadtest.md).
A derived weight may also be kept in bfloat16 for the step's widest matmuls, where the
CPU has bf16 dot products: 1.2-3x faster than float32 from 4 rows (the 4,166-wide heads
1.9x from 2), slower at 1 (AMD EPYC with AVX512-BF16, one thread; docs/loadtest.md,
"Measured choices"); and on a GPU, at any batch (half the bytes, tensor cores). Or, on
an x86 CPU, in int8 (`INT8`: a quarter of float32's bytes, fbgemm's kernels).

A packed int8 weight is a TorchScript object, which the tracer takes only from a module
attribute: `derived` also sets each one as an attribute of its owner."""
from __future__ import annotations

import functools
import os
import re
import warnings
from typing import Callable, Optional, Sequence, TypeVar

import torch
from torch import nn

T = TypeVar("T")

# the matmul dtype of int8 weights (`transposed`, `matmul_t`): a CPU's, through fbgemm
INT8 = torch.qint8


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU has bfloat16 dot products (AVX512-BF16 or AMX); elsewhere oneDNN
    emulates them, 3-30x slower than float32 on an older EPYC."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def cpu_has_int8_matmuls() -> bool:
    """Whether fbgemm's int8 matmuls (`packed_int8`, `matmul_t`) run here: an x86 CPU with
    AVX2 and a torch with fbgemm whose quantised tensors still exist (torch marks them
    deprecated), tried once on a small weight."""
    return ("fbgemm" in torch.backends.quantized.supported_engines and torch.cpu._is_avx2_supported()
            and _int8_matmul_runs())


@functools.cache
def _int8_matmul_runs() -> bool:
    try:
        matmul_t(torch.ones(1, 8), packed_int8(torch.ones(4, 8)))
    except Exception:  # noqa: BLE001 - any failure means: not here
        return False
    return True


def derived(owner: nn.Module, name: str, sources: Sequence[torch.Tensor], build: Callable[[], T]) -> T:
    """`build()` cached on `owner` under `name`, keyed by the identity and version of
    `sources` (every tensor the derived value is computed from). Under `torch.compile`
    the value built by an eager call before it is read as it is (the key's data pointers
    cannot be traced): a compiled step is made for weights that no longer change."""
    if torch.compiler.is_compiling():
        return owner.__dict__[name][1]
    key = tuple((t.data_ptr(), t._version) for t in sources)
    hit = owner.__dict__.get(name)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = (key, build())
        owner.__dict__[name] = hit
        # the tracer takes a packed int8 weight (a TorchScript object) only from a module
        # attribute: each is one too
        values = hit[1] if isinstance(hit[1], tuple) else (hit[1],)
        for i, v in enumerate(values):
            if isinstance(v, torch.ScriptObject):
                setattr(owner, re.sub(r"\W", "_", f"{name}_{i}"), v)
    return hit[1]


def transposed(w: torch.Tensor, dtype: Optional[torch.dtype] = None):
    """A weight [out, in] as a contiguous [in, out] copy, for `matmul_t`; in `dtype`
    when given (bfloat16: see the module's docstring); INT8: `packed_int8(w)`."""
    if dtype == INT8:
        return packed_int8(w)
    return w.detach().t().to(dtype or w.dtype).contiguous()


def packed_int8(w: torch.Tensor) -> torch.ScriptObject:
    """A weight [out, in] quantised to int8 with a scale per output row and packed for
    fbgemm's dynamically quantised linear (`matmul_t`)."""
    w = w.detach().float().cpu()
    scale = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny).double()
    with warnings.catch_warnings():  # deprecated in torch; `cpu_has_int8_matmuls` checks it is there
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scale, torch.zeros(len(w), dtype=torch.long), 0, torch.qint8)
    engine = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        return torch.ops.quantized.linear_prepack(q, None)
    finally:
        torch.backends.quantized.engine = engine


def _fbgemm_has_vnni() -> bool:
    """Whether fbgemm multiplies int8 with AVX512-VNNI here (its ISA may be capped by
    FBGEMM_ENABLE_INSTRUCTIONS, as to measure an AVX2-only CPU on this one)."""
    capped = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", "").upper() in ("AVX2", "AVX512", "AVX512_256")
    return torch.cpu._is_vnni_supported() and not capped


# Without VNNI fbgemm sums pairs of uint8 x int8 products in saturating int16, so the
# activations are quantised to 7 bits there, where no pair can overflow; with VNNI to 8
# bits, which moved the default model's acoustic distributions about half as far
# (docs/loadtest.md, "int8 matmul weights on x86 CPUs")
INT8_REDUCE_RANGE = not _fbgemm_has_vnni()


def matmul_t(x: torch.Tensor, w_t: torch.Tensor, bias=None) -> torch.Tensor:
    """`F.linear(x, w, bias)` for x [B, in] with the transposed weight w_t [in, out]. A
    weight in another dtype than x's (bfloat16) multiplies x rounded to it, accumulating
    in float32, and the product comes back in x's dtype; a packed int8 weight multiplies
    x quantised to int8 with a scale per row (fbgemm, accumulating in int32)."""
    if isinstance(w_t, torch.ScriptObject):  # packed int8 (`packed_int8`)
        # fbgemm quantises the whole x with one scale, which would tie the rows (sessions)
        # together: one row's NaN or outlier would spoil every row. Each row is scaled to
        # a largest magnitude of 1 first and back after, so each gets the whole int8 range
        # and a non-finite row (zeros in the call, its scale non-finite) stays its own
        s = x.abs().amax(1, keepdim=True)
        y = torch.ops.quantized.linear_dynamic(torch.nan_to_num(x / s, 0.0, 0.0, 0.0), w_t, INT8_REDUCE_RANGE) * s
        return y if bias is None else y + bias
    if w_t.dtype != x.dtype:
        y = torch.mm(x.to(w_t.dtype), w_t).to(x.dtype)
        return y if bias is None else y + bias
    return torch.mm(x, w_t) if bias is None else torch.addmm(bias, x, w_t)
