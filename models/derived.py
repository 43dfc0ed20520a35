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
"Measured choices"); and on a GPU, at any batch (half the bytes, tensor cores)."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, TypeVar

import torch
from torch import nn

T = TypeVar("T")


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU has bfloat16 dot products (AVX512-BF16 or AMX); elsewhere oneDNN
    emulates them, 3-30x slower than float32 on an older EPYC."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


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
    return hit[1]


def transposed(w: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A weight [out, in] as a contiguous [in, out] copy, for `matmul_t`; in `dtype`
    when given (bfloat16: see the module's docstring)."""
    return w.detach().t().to(dtype or w.dtype).contiguous()


def matmul_t(x: torch.Tensor, w_t: torch.Tensor, bias=None) -> torch.Tensor:
    """`F.linear(x, w, bias)` for x [B, in] with the transposed weight w_t [in, out]. A
    weight in another dtype than x's (bfloat16) multiplies x rounded to it, accumulating
    in float32, and the product comes back in x's dtype."""
    if w_t.dtype != x.dtype:
        y = torch.mm(x.to(w_t.dtype), w_t).to(x.dtype)
        return y if bias is None else y + bias
    return torch.mm(x, w_t) if bias is None else torch.addmm(bias, x, w_t)
