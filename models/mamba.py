"""Mamba (v1) selective-SSM block in pure PyTorch, state_dict-compatible with mamba-ssm.

`MambaBlock` has exactly the parameters of `mamba_ssm.Mamba` (names, shapes, init), so a
state_dict moves between the two unchanged. Training uses `forward`, whose selective scan
is a custom autograd Function (`selective_scan`) that runs fast on CPU; streaming decode
uses `step`, which updates caller-owned state tensors in place. The block itself holds
no per-session state.

Call convention (identical for `MambaBlock` and `mamba_ssm.Mamba`; use exactly this)::

    layer = make_mamba(d_model, d_state, d_conv, expand, layer_idx=i, device=dev)
    y = layer(x)                                            # x, y: [B, T, D]
    conv_state, ssm_state = layer.allocate_inference_cache(batch_size, max_seqlen)
    out, _, _ = layer.step(x_t.unsqueeze(1), conv_state, ssm_state)  # x_t [B, D] -> out [B, 1, D]

`step` returns `(out, conv_state, ssm_state)` as mamba-ssm does, the two states being the
same tensors that were passed in, already updated. `MambaBlock.step` also takes
`x_t: [B, D]` and then returns `out: [B, D]`; mamba-ssm's does not, so shared code should
pass `[B, 1, D]`. States: `conv_state [B, d_inner, d_conv]` holds the last d_conv conv
inputs, newest at index -1; `ssm_state [B, d_inner, d_state]`. Zero them (or rows of
them) to start a session; index/cat them to reshape the decode batch. Call `step` under
`torch.inference_mode()`. `forward` always starts from a zero state and fills no cache:
to decode on from a prompt, feed the prompt through `step`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .derived import derived, matmul_t, transposed

__all__ = ["MambaBlock", "make_mamba", "scan_tiling", "selective_scan"]

LOG2E = math.log2(math.e)
# Scan tiling per device type: (floats of one step's state per batch tile, floats of a
# time chunk's scratch buffer, most steps per chunk). CPU: measured on a 2-core AMD EPYC
# (1 MiB L2): tiles of <= 64K floats, chunks of ~512K floats (4 to 32 steps). CUDA: one
# kernel per time step whatever the tile, so the whole batch is one tile (CPU-sized
# tiles of 8 rows made GPU training launch-bound: 1.9-2.9 s a step, docs/training.md)
# and chunks of up to 64 steps within 2^27 floats (512 MiB) per buffer.
_TILING = {"cpu": (1 << 16, 1 << 19, 32), "cuda": (1 << 27, 1 << 27, 64)}


def _f32(t: Tensor) -> Tensor:
    """t in float32 unless it is already float32 or float64 (A and D, as mamba-ssm)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _tm(x: Tensor, s: int, e: int, dim: int) -> Tensor:
    """Time-major view [L, b, ...] of x[:, s:e] ([b, T, k]) with a size-1 axis at `dim`."""
    return x[:, s:e].transpose(0, 1).unsqueeze(dim)


def _chunk_states(u: Tensor, delta: Tensor, A2: Tensor, B: Tensor, h0: Tensor,
                  dA: Tensor, H: Tensor) -> None:
    """States of one time chunk: dA[t] = exp(delta_t A), H[t] = dA[t] H[t-1] + delta_t u_t B_t.

    u, delta: [L, b, 1, d]; A2 = A * log2(e): [n, d]; B: [L, b, n, 1]; h0: [b, n, d], the
    state before the chunk; dA, H: [L, b, n, d] outputs. All but the recurrence is one
    op over the whole chunk, so the Python loop runs one fused op per time step.
    """
    # exp2 of a pre-scaled A (as mamba-ssm's kernel does) is ~3x faster than exp on CPU
    torch.exp2(torch.mul(delta, A2, out=dA), out=dA)
    torch.mul(delta * u, B, out=H)
    Hs, dAs = H.unbind(0), dA.unbind(0)
    Hs[0].addcmul_(dAs[0], h0)
    for t in range(1, len(Hs)):
        Hs[t].addcmul_(dAs[t], Hs[t - 1])


class _SelectiveScan(torch.autograd.Function):
    """Selective scan with a hand-written backward (see `selective_scan`).

    Work runs over batch tiles of `bt` rows and time chunks of `L` steps on [L, bt, n, d]
    buffers: d innermost so the contractions over n and d are cheap; ~2 MiB buffers were
    the fastest size measured. Forward keeps only the state entering each chunk; backward
    recomputes a chunk's states from it and runs the adjoint recurrence
    G[t] = dy_t C_t + dA[t+1] G[t+1] in reverse. Memory: O(T/L * b*n*d) saved,
    O(L * bt*n*d) scratch, instead of O(T * b*n*d).
    """

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, L, bt):
        ctx.in_dtypes = [x.dtype if x is not None else None for x in (u, delta, A, B, C, D, z)]
        b, T, d = u.shape
        n = A.shape[1]
        dtype = torch.promote_types(u.dtype, torch.float32)
        u, delta, B, C = (x.to(dtype) for x in (u, delta, B, C))
        At = A.t().to(dtype)
        A2 = At * LOG2E
        dA = u.new_empty(L, bt, n, d)
        H = u.new_empty(L, bt, n, d)
        h0s = u.new_empty((T + L - 1) // L, b, n, d)  # state entering each chunk
        h0s[0].zero_()
        y = u.new_empty(T, b, 1, d)
        for b0 in range(0, b, bt):
            rows = slice(b0, min(b0 + bt, b))
            k = rows.stop - b0
            ub, deltab, Bb, Cb = u[rows], delta[rows], B[rows], C[rows]
            for c, s in enumerate(range(0, T, L)):
                e = min(s + L, T)
                dA_, H_ = dA[:e - s, :k], H[:e - s, :k]
                _chunk_states(_tm(ub, s, e, 2), _tm(deltab, s, e, 2), A2, _tm(Bb, s, e, 3),
                              h0s[c, rows], dA_, H_)
                torch.matmul(_tm(Cb, s, e, 2), H_, out=y[s:e, rows])
                if c + 1 < len(h0s):
                    h0s[c + 1, rows] = H_[-1]
        y_tm, y = y.squeeze(2).transpose(0, 1), u.new_empty(b, T, d)
        if D is not None:
            torch.addcmul(y_tm, u, D.to(dtype), out=y)
        else:
            y.copy_(y_tm)
        y_pre = None
        if z is not None:
            z = z.to(dtype)
            y_pre, y = y, y * F.silu(z)
        ctx.save_for_backward(u, delta, At, B, C, D, z, y_pre, h0s)
        ctx.tiles = L, bt
        return y.to(ctx.in_dtypes[0])

    @staticmethod
    def backward(ctx, dout):
        u, delta, At, B, C, D, z, y_pre, h0s = ctx.saved_tensors
        L, bt = ctx.tiles
        b, T, d = u.shape
        n = At.shape[0]
        dout = dout.to(u.dtype)
        dz = None
        if z is not None:
            dz = torch.ops.aten.silu_backward(dout * y_pre, z)
            dy = dout * F.silu(z)
        else:
            dy = dout
        dD = None
        if D is not None:
            dD = (dy * u).sum((0, 1))
            du = dy * D.to(u.dtype)
        else:
            du = torch.zeros_like(u)
        ddelta = torch.empty_like(u)
        dB = torch.empty_like(B)
        dC = torch.empty_like(C)
        dAt = At.new_zeros(n, d)
        A2 = At * LOG2E
        dA = u.new_empty(L, bt, n, d)
        H = u.new_empty(L, bt, n, d)
        G = u.new_empty(L, bt, n, d)
        for b0 in range(0, b, bt):
            rows = slice(b0, min(b0 + bt, b))
            k = rows.stop - b0
            ub, deltab, Bb, Cb, dyb = u[rows], delta[rows], B[rows], C[rows], dy[rows]
            carry = None  # dA[t+1] * G[t+1] flowing into a chunk's last step from the next chunk
            for c in reversed(range(len(h0s))):
                s = c * L
                e = min(s + L, T)
                dA_, H_, G_ = dA[:e - s, :k], H[:e - s, :k], G[:e - s, :k]
                h0 = h0s[c, rows]
                ul, dl, dyl = _tm(ub, s, e, 2), _tm(deltab, s, e, 2), _tm(dyb, s, e, 2)
                _chunk_states(ul, dl, A2, _tm(Bb, s, e, 3), h0, dA_, H_)
                torch.mul(dyl, _tm(Cb, s, e, 3), out=G_)
                Gs, dAs = G_.unbind(0), dA_.unbind(0)
                if carry is not None:
                    Gs[-1].add_(carry)
                for t in range(len(Gs) - 2, -1, -1):
                    Gs[t].addcmul_(dAs[t + 1], Gs[t + 1])
                carry = dAs[0] * Gs[0]
                # contractions as [1, d] @ [d, n] and [1, n] @ [n, d] per (step, row)
                dCt = torch.matmul(dyl, H_.transpose(-1, -2))
                dC[rows, s:e] = dCt.squeeze(2).transpose(0, 1)
                dBt = torch.matmul(dl * ul, G_.transpose(-1, -2))
                dB[rows, s:e] = dBt.squeeze(2).transpose(0, 1)
                GB = torch.matmul(_tm(Bb, s, e, 2), G_).squeeze(2).transpose(0, 1)  # [k, l, d]
                # Q = d loss / d(delta_t A) = G[t] * dA[t] * h[t-1], built in dA's buffer
                Q = dA_.mul_(G_)
                Q[1:].mul_(H_[:-1])
                Q[0].mul_(h0)
                dAt += torch.mul(Q, dl, out=G_).sum((0, 1))
                dQ = Q.mul_(At).sum(2).transpose(0, 1)  # [k, l, d]
                du[rows, s:e].addcmul_(deltab[:, s:e], GB)
                torch.addcmul(dQ, ub[:, s:e], GB, out=ddelta[rows, s:e])
        grads = (du, ddelta, dAt.t(), dB, dC, dD, dz)
        return (*(g.to(dt) if g is not None and dt is not None else None
                  for g, dt in zip(grads, ctx.in_dtypes)), None, None)


def selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor,
                   D: Optional[Tensor] = None, z: Optional[Tensor] = None,
                   chunk_size: Optional[int] = None) -> Tensor:
    """Mamba v1 selective scan from a zero state, batch-first layout.

    u, delta, z: [b, T, d]; A: [d, n] (already negative); B, C: [b, T, n]; D: [d].
        h_t = exp(delta_t A) * h_{t-1} + delta_t u_t B_t
        y_t = <h_t, C_t> + D u_t;  out_t = y_t * silu(z_t)
    Same math as mamba-ssm's `selective_scan_fn` with delta_bias/softplus applied by the
    caller. Computed in at least float32. `chunk_size` (time steps per block) only
    changes speed; by default it is picked from the batch tile size.
    """
    b, T, d = u.shape
    L, bt = scan_tiling(b, A.shape[1] * d, u.device, chunk_size)
    return _SelectiveScan.apply(u, delta, A, B, C, D, z, min(L, T), bt)


def scan_tiling(b: int, state: int, device: torch.device, chunk_size: Optional[int] = None) -> tuple[int, int]:
    """(time steps per chunk, batch rows per tile) of `selective_scan` for a batch of b
    rows whose state has `state` = n*d floats (see `_TILING`)."""
    tile_elems, chunk_elems, max_chunk = _TILING.get(device.type, _TILING["cpu"])
    bt = max(1, min(b, tile_elems // state))
    return chunk_size or max(4, min(max_chunk, chunk_elems // (bt * state))), bt


def _causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """Depthwise causal conv over time of x: [B, T, C] with weight [C, 1, K] -> [B, T, C].

    Same result as nn.Conv1d(padding=K-1) cut to T, done as K shifted multiply-adds in
    [B, T, C] layout: on CPU ~2x faster than the MKL-DNN conv plus its transposes.
    """
    K, T = weight.shape[-1], x.shape[1]
    xp = F.pad(x, (0, 0, K - 1, 0))
    w = weight.squeeze(1).t()
    y = xp[:, :T] * w[0] if bias is None else torch.addcmul(bias, xp[:, :T], w[0])
    for k in range(1, K):
        y = torch.addcmul(y, xp[:, k:k + T], w[k])
    return y


class MambaBlock(nn.Module):
    """Pure-PyTorch equivalent of `mamba_ssm.Mamba`: same constructor, state_dict and step."""

    def __init__(self, d_model: int, d_state: int = 16, d_conv: int = 4, expand: int = 2,
                 dt_rank="auto", dt_min: float = 0.001, dt_max: float = 0.1,
                 dt_init: str = "random", dt_scale: float = 1.0, dt_init_floor: float = 1e-4,
                 conv_bias: bool = True, bias: bool = False, layer_idx: Optional[int] = None,
                 device=None, dtype=None, chunk_size: Optional[int] = None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.d_model = d_model
        self.d_state = d_state
        self.d_conv = d_conv
        self.expand = expand
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else dt_rank
        self.layer_idx = layer_idx
        self.chunk_size = chunk_size
        # forward's scan: selective_scan's contract (livespeech.models.mamba_triton's kernels on CUDA)
        self.scan = selective_scan

        self.in_proj = nn.Linear(d_model, self.d_inner * 2, bias=bias, **factory)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, kernel_size=d_conv, groups=self.d_inner,
                                padding=d_conv - 1, bias=conv_bias, **factory)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False, **factory)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True, **factory)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **factory)

        # mamba-ssm init: keeps the variance of dt_proj's output at initialisation
        dt_init_std = self.dt_rank ** -0.5 * dt_scale
        if dt_init == "constant":
            nn.init.constant_(self.dt_proj.weight, dt_init_std)
        elif dt_init == "random":
            nn.init.uniform_(self.dt_proj.weight, -dt_init_std, dt_init_std)
        else:
            raise NotImplementedError(f"dt_init={dt_init!r}")
        # dt_proj.bias = softplus^-1(dt), dt log-uniform in [dt_min, dt_max]
        dt = torch.exp(torch.rand(self.d_inner, **factory) * (math.log(dt_max) - math.log(dt_min))
                       + math.log(dt_min)).clamp(min=dt_init_floor)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.dt_proj.bias._no_reinit = True
        # S4D-real init; A_log and D stay float32 like mamba-ssm's
        A = torch.arange(1, d_state + 1, dtype=torch.float32, device=device).repeat(self.d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_inner, device=device))
        self.D._no_weight_decay = True

    def forward(self, hidden_states: Tensor) -> Tensor:
        """[B, T, D] -> [B, T, D], from a zero state (training / full-sequence path)."""
        xz = F.linear(hidden_states, self.in_proj.weight, self.in_proj.bias)
        x, z = xz.chunk(2, dim=-1)
        x = F.silu(_causal_conv1d(x, self.conv1d.weight, self.conv1d.bias))
        dt, B, C = F.linear(x, self.x_proj.weight).split([self.dt_rank, self.d_state, self.d_state], -1)
        delta = F.softplus(self.dt_proj(dt))
        A = -torch.exp(_f32(self.A_log))
        y = self.scan(x, delta, A, B, C, _f32(self.D), z, self.chunk_size)
        return F.linear(y, self.out_proj.weight, self.out_proj.bias)

    def step_tensors(self, matmul_dtype: Optional[torch.dtype]) -> tuple:
        """What `step` reads, derived once (models/derived.py): A * log2(e), the conv
        weight as [d_inner, d_conv], the projections transposed (the in and out ones in
        `matmul_dtype`), and the biases and D themselves (in-place updates show through)."""
        def build():
            w = self.conv1d.weight.detach().squeeze(1)
            return (torch.exp(_f32(self.A_log.detach())) * -LOG2E, w, w.new_ones(self.d_conv), self.conv1d.bias,
                    transposed(self.in_proj.weight, matmul_dtype), self.in_proj.bias, transposed(self.x_proj.weight),
                    transposed(self.dt_proj.weight), self.dt_proj.bias, self.D,
                    transposed(self.out_proj.weight, matmul_dtype), self.out_proj.bias)
        sources = (self.A_log, self.conv1d.weight, self.in_proj.weight, self.x_proj.weight,
                   self.dt_proj.weight, self.out_proj.weight)
        return derived(self, f"_step_tensors_{matmul_dtype}", sources, build)

    def step(self, hidden_states: Tensor, conv_state: Tensor, ssm_state: Tensor,
             matmul_dtype: Optional[torch.dtype] = None):
        """One decode step; updates conv_state and ssm_state in place.

        hidden_states: [B, 1, D] (mamba-ssm's layout) or [B, D]. Returns
        (out, conv_state, ssm_state) with out shaped like hidden_states. `matmul_dtype`
        (not in mamba-ssm's signature): the in and out projections' weights in this
        dtype (bfloat16; models/derived.py), None = the block's own.
        """
        squeeze = hidden_states.dim() == 3
        A2, conv_w, ones, conv_b, w_in, b_in, w_x, w_dt, b_dt, D, w_out, b_out = self.step_tensors(matmul_dtype)
        x, z = matmul_t(hidden_states.squeeze(1) if squeeze else hidden_states, w_in, b_in).chunk(2, dim=-1)
        # shift the conv window left by one and append x; a contiguous state shifts as one
        # flat copy (the element wrapping into each row's last slot is overwritten by x)
        if conv_state.is_contiguous():
            flat = conv_state.view(-1)
            flat[:-1].copy_(flat[1:].clone())
        else:
            conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
        conv_state[:, :, -1] = x
        # sum over the window as a matrix-vector product: faster than .sum(-1) from batch 8
        x = torch.mv((conv_state * conv_w).reshape(-1, self.d_conv), ones).view(-1, self.d_inner)
        x = F.silu(x if conv_b is None else x + conv_b)
        dt, B, C = torch.mm(x, w_x).split([self.dt_rank, self.d_state, self.d_state], -1)
        dt = F.softplus(matmul_t(dt, w_dt, b_dt))
        ssm_state.mul_(torch.exp2(dt.unsqueeze(-1) * A2))
        ssm_state.addcmul_((dt * x).unsqueeze(-1), B.unsqueeze(1))
        # y = <ssm_state, C> + D x. Under torch.compile as a product summed over the states,
        # which Inductor fuses with the update above (one kernel a layer fewer, and the state
        # read once); otherwise as [1, n] @ [n, d_inner] per row, MKL's fast orientation,
        # which the CPU's frozen graph runs faster than the sum
        if torch.compiler.is_compiling():
            y = (ssm_state.to(x.dtype) * C.unsqueeze(1)).sum(-1) + x * D.to(x.dtype)
        else:
            y = torch.baddbmm((x * D.to(x.dtype)).unsqueeze(1), C.unsqueeze(1),
                              ssm_state.to(x.dtype).transpose(1, 2)).squeeze(1)
        out = matmul_t(y * F.silu(z), w_out, b_out)
        return (out.unsqueeze(1) if squeeze else out), conv_state, ssm_state

    def allocate_inference_cache(self, batch_size: int, max_seqlen: Optional[int] = None,
                                 dtype=None, device=None, **kwargs):
        """Zero (conv_state, ssm_state); max_seqlen is unused, kept for mamba-ssm's signature."""
        device = self.out_proj.weight.device if device is None else device
        conv_state = torch.zeros(batch_size, self.d_inner, self.d_conv, device=device,
                                 dtype=self.conv1d.weight.dtype if dtype is None else dtype)
        ssm_state = torch.zeros(batch_size, self.d_inner, self.d_state, device=device,
                                dtype=self.dt_proj.weight.dtype if dtype is None else dtype)
        return conv_state, ssm_state


def _mamba_ssm_class():
    try:
        from mamba_ssm import Mamba
    except Exception:  # not installed, or its CUDA extensions fail to load
        return None
    return Mamba


def make_mamba(d_model: int, d_state: int = 16, d_conv: int = 4, expand: int = 2, *,
               layer_idx: Optional[int] = None, device=None, dtype=None,
               prefer_cuda_kernels: bool = True, **kwargs) -> nn.Module:
    """`mamba_ssm.Mamba` when it can run (CUDA device, package importable), else `MambaBlock`.

    The choice is made from `device`, so build the module on its final device. Both
    classes take the same state_dict and the call convention in the module docstring.
    `kwargs` must be options both constructors take (dt_rank, dt_min, dt_max, dt_init,
    dt_scale, dt_init_floor, conv_bias, bias); `chunk_size` is MambaBlock's alone.
    """
    args = dict(d_state=d_state, d_conv=d_conv, expand=expand, layer_idx=layer_idx,
                device=device, dtype=dtype, **kwargs)
    if prefer_cuda_kernels and torch.cuda.is_available() and device is not None \
            and torch.device(device).type == "cuda":
        cls = _mamba_ssm_class()
        if cls is not None:
            return cls(d_model, **args)
    return MambaBlock(d_model, **args)
