"""A decode step's cross-attention over the text memory on the CPU, as one compiled loop
(numba), which reads the memory in float32 or bfloat16.

One query per session and head against its own few dozen keys: torch runs that as
batched products of B x H tiny matrices, reading every key whole (half of it zeros:
`CrossAttention.attend_step`'s layout) and, in bfloat16, slower than in float32. This
loop takes a (session, head) at a time: each key's score from the half of it that is
not zeros (an enrollment key's first half, a text key's second), the softmax, and the
weighted values, in float32 whatever the memory's dtype; keys the window masks (-inf
bias) are not read at all. So the memory can be kept in bfloat16, half the bytes a step
reads, as on a GPU (server/runner.py).

`applies` says where it runs: CPU tensors in float32 or bfloat16, numba importable. The
loop is a registered torch op (`torch.ops.livespeech.memory_attention`), so the traced,
frozen step (models/step_graph.py) calls it as it calls any other; elsewhere (a GPU, or
no numba) the attention runs as torch's ops. The two agree to float rounding
(tests/test_cpu_attention.py).
"""
from __future__ import annotations

import numpy as np
import torch

from . import compiled


READS = (torch.float32, torch.bfloat16)  # the memory dtypes the loop reads


def runs_on(device: torch.device) -> bool:
    """Whether the loop runs on `device` (for a memory in one of `READS`)."""
    return compiled.available() and device.type == "cpu"


def applies(mem_k: torch.Tensor, mem_v: torch.Tensor) -> bool:
    return (runs_on(mem_k.device) and mem_k.dtype in READS and mem_v.dtype == mem_k.dtype
            and mem_k.stride(-1) == 1 and mem_v.stride(-1) == 1)


def _flat(t: torch.Tensor) -> np.ndarray:
    """The span of storage a 4-d tensor with a unit last stride covers, as one contiguous
    numpy array: the loop indexes it with the tensor's strides, so a view that slices the
    memory's key axis (the step reads a prefix of its slots) is read in place."""
    (b, h, m, w), (sb, sh, sm, _) = t.shape, t.stride()
    flat = torch.as_strided(t, ((b - 1) * sb + (h - 1) * sh + (m - 1) * sm + w,), (1,))
    return (flat.view(torch.int16) if t.dtype == torch.bfloat16 else flat).numpy()  # bf16: its bits


def memory_attention(q2: torch.Tensor, mem_k: torch.Tensor, mem_v: torch.Tensor, bias: torch.Tensor,
                     n_enroll: int, scale: float) -> torch.Tensor:
    """[B, H * hd] float32: softmax(scale q2 . k + bias) v for each session and head. q2
    [B, H, 2 hd] float32 ([q ; RoPE(q)]); mem_k [B, H, M, 2 hd] (the first n_enroll keys in
    the first half, the others in the second, zeros elsewhere); mem_v [B, H, M, hd]; both
    in float32 or both in bfloat16, any strides but a unit last one; bias [B, 1, 1, M]
    float32 (0 or -inf)."""
    b, h, hd = q2.shape[0], q2.shape[1], q2.shape[2] // 2
    out = torch.empty(b, h, hd, dtype=torch.float32)
    # numpy views of the CPU tensors, shared in place: no device to wait for, so not the
    # host reads loadtest/host_reads.py counts for a GPU's step (torch function modes off)
    with torch._C.DisableTorchFunction():
        _attend(q2.contiguous().numpy(), _flat(mem_k), mem_k.stride()[:3], _flat(mem_v), mem_v.stride()[:3],
                bias.reshape(b, -1).contiguous().numpy(), n_enroll, np.float32(scale), out.numpy())
    return out.view(b, h * hd)


def _register() -> torch.library.Library | None:
    """The op, once a process (a second import of this module finds it defined). A plain
    registration: torch.library.custom_op's wrapper cost ~25 us a call, five a step."""
    if hasattr(torch.ops.livespeech, "memory_attention"):
        return None
    lib = torch.library.Library("livespeech", "DEF")
    lib.define("memory_attention(Tensor q2, Tensor mem_k, Tensor mem_v, Tensor bias, int n_enroll, float scale) "
               "-> Tensor")
    lib.impl("memory_attention", memory_attention, "CPU")
    # its output's shape, for torch.compile (whose CPU step may trace this op)
    torch.library.register_fake("livespeech::memory_attention", lib=lib)(
        lambda q2, mem_k, mem_v, bias, n_enroll, scale: q2.new_empty(q2.shape[0], q2.shape[1] * (q2.shape[2] // 2)))
    return lib


_LIB = _register()


def _row_f32(src, at, n, buf):
    return src[at:at + n]  # a slice: the loops over it need not wrap negative indices


def _row_bf16(src, at, n, buf):
    bits = buf.view(np.uint32)
    part = src[at:at + n]
    for d in range(n):  # a bfloat16 is a float32's upper 16 bits
        bits[d] = np.uint32(np.uint16(part[d])) << 16
    return buf


def _row(src, at, n, buf):
    """Row `at`..`at + n` of a flat memory as float32 (`buf` holds it if converted)."""
    return _row_bf16(src, at, n, buf) if src.dtype == np.int16 else _row_f32(src, at, n, buf)


def _attend(q2s, k, ks, v, vs, bias, n_enroll, scale, out):
    nb, nh, hd = out.shape
    m = bias.shape[1]
    s = np.empty(m, np.float32)
    acc = np.empty(hd, np.float32)
    row = np.empty(hd, np.float32)
    for b in range(nb):
        for h in range(nh):
            q2 = q2s[b, h]
            kb = b * ks[0] + h * ks[1]
            top = np.float32(-np.inf)
            for j in range(m):
                x = bias[b, j]
                if x != -np.inf:
                    half = 0 if j < n_enroll else hd
                    at = kb + j * ks[2] + half
                    kj, qj = _row(k, at, hd, row), q2[half:half + hd]
                    a = np.float32(0.0)
                    for d in range(hd):
                        a += qj[d] * kj[d]
                    x += a * scale
                    top = max(top, x)
                s[j] = x
            total = np.float32(0.0)
            for j in range(m):
                e = np.exp(s[j] - top)
                s[j] = e
                total += e
            acc[:] = 0.0
            vb = b * vs[0] + h * vs[1]
            for j in range(m):
                if s[j] != 0.0:
                    w = s[j] / total
                    vj = _row(v, vb + j * vs[2], hd, row)
                    for d in range(hd):
                        acc[d] += w * vj[d]
            o = out[b, h]
            for d in range(hd):
                o[d] = acc[d]


if compiled.available():
    from numba import types
    from numba.extending import overload

    @overload(_row, inline="always")
    def _row_compiled(src, at, n, buf):  # the memory's dtype picks the reader once, at compile time
        return _row_bf16 if src.dtype == types.int16 else _row_f32

    # reassociation lets the dot products and the value sums vectorise; no other fast-math
    # flag, so the -inf of a masked key keeps its meaning
    _attend = compiled.jit(_attend, fastmath={"reassoc", "contract"})
