"""The selective scan of `livespeech.models.mamba` as two Triton kernels, for training on CUDA.

`livespeech.models.mamba.selective_scan` runs one PyTorch op per time step over [b, n, d] states,
which on a GPU is bound by launches and by writing every state to memory and back.
mamba-ssm's CUDA kernels avoid that, but the GPU image has no build of them and
building one costs minutes of a short GPU loan. Triton is on the image: these kernels
do what mamba-ssm's do, one program per (batch row, block of channels) holding its
[channels, n] state in registers for the whole sequence:

- forward: h_t = exp(delta_t A) h_{t-1} + delta_t u_t B_t, y_t = <h_t, C_t>; it also
  writes every h_t (float32, [b, T, d, n]) for the backward;
- backward: the adjoint g_t = dy_t C_t + exp(delta_{t+1} A) g_{t+1} in reverse, with
  the gradients of u, delta, A, B, C (B and C summed over channel blocks afterwards).

D and the silu(z) gate stay PyTorch ops around the scan (autograd differentiates them).
`selective_scan_triton` is a drop-in for `livespeech.models.mamba.selective_scan` on CUDA; a test
checks both against each other under Triton's interpreter (TRITON_INTERPRET=1, no GPU),
and `check_against_torch` does the same on the device before a run trusts it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["selective_scan_triton", "check_against_torch", "time_against_torch", "use_triton_scan"]


@triton.jit
def _scan_fwd(u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, y_ptr, h_ptr, T, d,
              N: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0)
    ch = tl.program_id(1) * BD + tl.arange(0, BD)
    ns = tl.arange(0, N)
    cm = ch < d
    A = tl.load(A_ptr + ch[:, None] * N + ns[None, :], mask=cm[:, None], other=0.0)
    h = tl.zeros((BD, N), dtype=tl.float32)
    for t in range(T):
        o = (row * T + t) * d + ch
        u = tl.load(u_ptr + o, mask=cm, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + o, mask=cm, other=0.0).to(tl.float32)
        Bt = tl.load(B_ptr + (row * T + t) * N + ns).to(tl.float32)
        Ct = tl.load(C_ptr + (row * T + t) * N + ns).to(tl.float32)
        h = tl.exp(dt[:, None] * A) * h + (dt * u)[:, None] * Bt[None, :]
        tl.store(h_ptr + o[:, None] * N + ns[None, :], h, mask=cm[:, None])
        tl.store(y_ptr + o, tl.sum(h * Ct[None, :], axis=1), mask=cm)


@triton.jit
def _scan_bwd(u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, h_ptr, dy_ptr,
              du_ptr, ddt_ptr, dA_ptr, dB_ptr, dC_ptr, T, d, n_blocks,
              N: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    ch = blk * BD + tl.arange(0, BD)
    ns = tl.arange(0, N)
    cm = ch < d
    A = tl.load(A_ptr + ch[:, None] * N + ns[None, :], mask=cm[:, None], other=0.0)
    g = tl.zeros((BD, N), dtype=tl.float32)  # exp(delta_{t+1} A) g_{t+1}, carried down
    dA_acc = tl.zeros((BD, N), dtype=tl.float32)
    for i in range(T):
        t = T - 1 - i
        o = (row * T + t) * d + ch
        u = tl.load(u_ptr + o, mask=cm, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + o, mask=cm, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + o, mask=cm, other=0.0).to(tl.float32)
        Bt = tl.load(B_ptr + (row * T + t) * N + ns).to(tl.float32)
        Ct = tl.load(C_ptr + (row * T + t) * N + ns).to(tl.float32)
        h = tl.load(h_ptr + o[:, None] * N + ns[None, :], mask=cm[:, None], other=0.0)
        first = (tl.zeros((BD, N), dtype=tl.int32) + t) == 0  # h_{-1} = 0
        h_prev = tl.load(h_ptr + (o - d)[:, None] * N + ns[None, :], mask=cm[:, None] & ~first, other=0.0)
        g = g + dy[:, None] * Ct[None, :]
        e = tl.exp(dt[:, None] * A)
        q = g * e * h_prev  # d loss / d(delta_t A)
        gB = tl.sum(g * Bt[None, :], axis=1)
        tl.store(du_ptr + o, gB * dt, mask=cm)
        tl.store(ddt_ptr + o, tl.sum(q * A, axis=1) + gB * u, mask=cm)
        dA_acc += q * dt[:, None]
        # this block's share of the sums over channels: [n_blocks, b, T, N]
        p = ((blk * tl.num_programs(0) + row) * T + t) * N + ns
        tl.store(dC_ptr + p, tl.sum(dy[:, None] * h, axis=0))
        tl.store(dB_ptr + p, tl.sum(g * (dt * u)[:, None], axis=0))
        g = e * g
    tl.store(dA_ptr + (row * d + ch)[:, None] * N + ns[None, :], dA_acc, mask=cm[:, None])


def _block(d: int) -> int:
    return min(32, triton.next_power_of_2(d))


class _TritonScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, delta, A, B, C):
        b, T, d = u.shape
        N = A.shape[1]
        u, delta, B, C = (x.contiguous() for x in (u, delta, B, C))
        A32 = A.float().contiguous()
        y = torch.empty(b, T, d, device=u.device, dtype=torch.float32)
        h = torch.empty(b, T, d, N, device=u.device, dtype=torch.float32)
        BD = _block(d)
        _scan_fwd[(b, triton.cdiv(d, BD))](u, delta, A32, B, C, y, h, T, d, N=N, BD=BD)
        ctx.save_for_backward(u, delta, A32, B, C, h)
        ctx.dtypes = (u.dtype, delta.dtype, A.dtype, B.dtype, C.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        u, delta, A32, B, C, h = ctx.saved_tensors
        b, T, d = u.shape
        N = A32.shape[1]
        BD = _block(d)
        nb = triton.cdiv(d, BD)
        f32 = dict(device=u.device, dtype=torch.float32)
        du, ddt = torch.empty(b, T, d, **f32), torch.empty(b, T, d, **f32)
        dA = torch.empty(b, d, N, **f32)
        dB, dC = torch.empty(nb, b, T, N, **f32), torch.empty(nb, b, T, N, **f32)
        _scan_bwd[(b, nb)](u, delta, A32, B, C, h, dy.float().contiguous(), du, ddt, dA, dB, dC,
                           T, d, nb, N=N, BD=BD)
        grads = (du, ddt, dA.sum(0), dB.sum(0), dC.sum(0))
        return tuple(g.to(dt) for g, dt in zip(grads, ctx.dtypes))


def selective_scan_triton(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor,
                          D: Optional[Tensor] = None, z: Optional[Tensor] = None,
                          chunk_size: Optional[int] = None) -> Tensor:
    """`livespeech.models.mamba.selective_scan`'s contract (chunk_size is ignored): the output in
    u's dtype, computed in float32. A's state size must be a power of two (16 in every
    preset)."""
    if A.shape[1] & (A.shape[1] - 1):
        raise ValueError(f"state size {A.shape[1]} is not a power of two")
    y = _TritonScan.apply(u, delta, A, B, C)
    if D is not None:
        y = y + u.float() * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(u.dtype)


def check_against_torch(device: str | torch.device = "cuda", b: int = 3, T: int = 37, d: int = 80,
                        n: int = 16, seed: int = 0) -> float:
    """Largest relative difference between this scan and `livespeech.models.mamba.selective_scan`
    (output and every input's gradient) on random inputs: a run checks the kernels on its
    own device before it trains on them."""
    from .mamba import selective_scan

    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device).requires_grad_(True)

    u, z = rnd(b, T, d), rnd(b, T, d)
    delta = F.softplus(torch.randn(b, T, d, generator=g) - 1.0).to(device).requires_grad_(True)
    A = (-torch.rand(d, n, generator=g) * 4 - 0.1).to(device).requires_grad_(True)
    B, C, D = rnd(b, T, n), rnd(b, T, n), rnd(d)
    dout = torch.randn(b, T, d, generator=g).to(device)
    inputs = (u, delta, A, B, C, D, z)
    worst = 0.0
    results = []
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the PyTorch scan's contractions in full float32
    try:
        for fn in (selective_scan, selective_scan_triton):
            y = fn(*inputs)
            grads = torch.autograd.grad(y, inputs, dout)
            results.append([x.detach() for x in (y, *grads)])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    for want, got in zip(*results):
        worst = max(worst, float((got - want).norm() / want.norm().clamp_min(1e-12)))
    return worst


def time_against_torch(device: str | torch.device = "cuda", b: int = 64, T: int = 300, d: int = 512,
                       n: int = 16, reps: int = 3) -> tuple[float, float]:
    """Seconds of one forward + backward of (`livespeech.models.mamba.selective_scan`, this scan) on
    random inputs of a training batch's size, after a warm-up call of each."""
    import time

    from .mamba import selective_scan

    dev = torch.device(device)
    x = [torch.randn(b, T, d, device=dev, requires_grad=True) for _ in range(2)]
    delta = F.softplus(torch.randn(b, T, d, device=dev) - 1.0).requires_grad_(True)
    A = (-torch.rand(d, n, device=dev) * 4 - 0.1).requires_grad_(True)
    B, C = (torch.randn(b, T, n, device=dev, requires_grad=True) for _ in range(2))
    D = torch.randn(d, device=dev, requires_grad=True)
    out = []
    for fn in (selective_scan, selective_scan_triton):
        for k in range(reps + 1):
            if k == 1:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
            fn(x[0], delta, A, B, C, D, x[1]).sum().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        out.append((time.perf_counter() - t0) / reps)
    return out[0], out[1]


def use_triton_scan(model: torch.nn.Module) -> int:
    """Train `model`'s pure-PyTorch Mamba blocks on these kernels; returns how many."""
    from .mamba import MambaBlock

    blocks = [m for m in model.modules() if isinstance(m, MambaBlock)]
    for m in blocks:
        m.scan = selective_scan_triton
    return len(blocks)
