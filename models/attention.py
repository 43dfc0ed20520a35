"""Cross-attention over [enrollment ; text window] with rotary text positions (Eq. 1).

The query at frame t is rotated by t, text keys by their assigned speech-timeline
positions tau_i, tau_i + 1, ...; enrollment keys are not rotated. Keys and values are
projected once (per voice / per chunk) and cached unrotated; rotation happens at
attention time so the server can re-place future chunks without re-projecting.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .derived import derived, matmul_t, transposed


_INV_FREQ: dict[tuple, torch.Tensor] = {}


def _inv_freq(head_dim: int, base: float, device: torch.device) -> torch.Tensor:
    """RoPE's frequencies, made once per (head_dim, base, device): a decode step asks for
    them at every step and at every re-rotation (four ops each time otherwise)."""
    key = (head_dim, float(base), device)
    freq = _INV_FREQ.get(key)
    if freq is None:
        # a plain tensor even when first asked for under inference_mode, so training can use it
        with torch.inference_mode(False), torch.no_grad():
            freq = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
        _INV_FREQ[key] = freq
    return freq


def rope_angles(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape positions.shape + (head_dim // 2,)."""
    ang = positions.to(torch.float32).unsqueeze(-1) * _inv_freq(head_dim, base, positions.device)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the last dim; cos/sin broadcast over heads."""
    if x.dtype != cos.dtype:
        return apply_rope(x.to(cos.dtype), cos, sin).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def rope_query_matrix(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[..., hd/2] cos/sin of the query's angles -> [..., hd, 2 hd], the matrix R with
    q @ R = [q ; apply_rope(q)] (`CrossAttention.attend_step`'s query). Made once a step
    for every layer and head: one matmul a layer in place of the rotation's eight ops."""
    half = cos.shape[-1]
    rot = (torch.diag_embed(torch.cat((cos, cos), dim=-1))
           + torch.diag_embed(sin, offset=half) - torch.diag_embed(sin, offset=-half))
    eye = torch.eye(2 * half, dtype=rot.dtype, device=rot.device).expand_as(rot)
    return torch.cat((eye, rot), dim=-1)


class CrossAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, rope_base: float = 10_000.0):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.rope_base = rope_base
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.kv_proj = nn.Linear(d_model, 2 * d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)

    def project_memory(self, mem: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, L, D] -> unrotated K, V of shape [B, H, L, hd] (the cached form)."""
        b, l, _ = mem.shape
        kv = self.kv_proj(mem).view(b, l, 2, self.n_heads, self.head_dim)
        return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)

    def attend(
        self,
        x: torch.Tensor,  # [B, T, D] queries
        query_pos: torch.Tensor,  # [B, T] frame index t
        enr_k: torch.Tensor, enr_v: torch.Tensor,  # [B, H, N, hd], unrotated
        txt_k: torch.Tensor, txt_v: torch.Tensor,  # [B, H, L, hd], unrotated
        txt_pos: torch.Tensor,  # [B, L] assigned positions
        txt_mask: torch.Tensor,  # [B, L] or [B, T, L] bool: key visible
        text_weights: Optional[list] = None,
    ) -> torch.Tensor:
        """``text_weights``: a list the text keys' attention weights [B, H, T, L] are
        appended to (training's reading loss; out of the softmax over all keys)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        qc, qs = rope_angles(query_pos, self.head_dim, self.rope_base)
        kc, ks = rope_angles(txt_pos, self.head_dim, self.rope_base)
        q_rot = apply_rope(q, qc.unsqueeze(1), qs.unsqueeze(1))
        k_rot = apply_rope(txt_k, kc.unsqueeze(1), ks.unsqueeze(1))
        scale = 1.0 / math.sqrt(self.head_dim)
        # Eq. 1: one softmax over [unrotated enrollment scores ; rotated text scores]
        s_enr = torch.matmul(q, enr_k.transpose(-1, -2)) * scale
        s_txt = torch.matmul(q_rot, k_rot.transpose(-1, -2)) * scale
        mask = txt_mask if txt_mask.dim() == 3 else txt_mask.unsqueeze(1)
        s_txt = s_txt.masked_fill(~mask.unsqueeze(1), float("-inf"))
        w = torch.softmax(torch.cat((s_enr, s_txt), dim=-1), dim=-1)
        n = enr_k.shape[2]
        if text_weights is not None:
            text_weights.append(w[..., n:])
        out = torch.matmul(w[..., :n], enr_v) + torch.matmul(w[..., n:], txt_v)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))

    def step_weights(self, matmul_dtype: Optional[torch.dtype] = None) -> tuple:
        """The q and out projections' weights as a step multiplies them (`matmul_t`),
        derived once (models/derived.py)."""
        return derived(self, f"_step_weights_{matmul_dtype}", (self.q_proj.weight, self.out_proj.weight),
                       lambda: (transposed(self.q_proj.weight, matmul_dtype),
                                transposed(self.out_proj.weight, matmul_dtype)))

    def attend_step(self, x: torch.Tensor, q_rope: torch.Tensor, mem_k: torch.Tensor, mem_v: torch.Tensor,
                    bias: torch.Tensor, matmul_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Eq. 1 for one query per session, in one fused attention call.

        x [B, D]; q_rope [B, hd, 2*hd] (`rope_query_matrix` of the query's frame);
        mem_k [B, H, N+L, 2*hd] holds enrollment keys in the first half of the last dim
        and *rotated* text keys in the second half (zeros elsewhere), so [q ; RoPE(q, t)]
        . k gives the unrotated enrollment scores and the rotated text scores at once;
        mem_v [B, H, N+L, hd]; bias [B, 1, 1, N+L] (0 or -inf: the np/nf window), in the
        memory's dtype, which the attention runs in (float32, or bfloat16 on a GPU);
        matmul_dtype: the q and out projections' weights in it (models/derived.py).
        """
        b = x.shape[0]
        w_q, w_out = self.step_weights(matmul_dtype)
        q = matmul_t(x, w_q).view(b, self.n_heads, self.head_dim)
        if torch.compiler.is_compiling():  # a product summed, which Inductor fuses: no matmul call
            q2 = (q.unsqueeze(-1) * q_rope.unsqueeze(1)).sum(-2)
        else:
            q2 = torch.bmm(q, q_rope)
        q2 = q2.unsqueeze(2).to(mem_k.dtype)  # [B, H, 1, 2*hd]: [q ; RoPE(q, t)]
        scale = 1.0 / math.sqrt(self.head_dim)
        if x.device.type == "cpu":
            # one query per head: on CPU, SDPA takes its unfused math path here, which
            # measured ~1.7x slower than these three ops (docs/loadtest.md). The scores as
            # keys @ query (a matrix-vector product over the keys' rows, [B, H, N+L, 1]),
            # not query @ keys^T: with the memory out of cache, as in a step, ~2x faster
            s = torch.matmul(mem_k, q2.transpose(-1, -2)).transpose(-1, -2).mul_(scale).add_(bias)
            out = torch.matmul(torch.softmax(s, dim=-1), mem_v)
        else:
            out = F.scaled_dot_product_attention(q2, mem_k, mem_v, attn_mask=bias, scale=scale)
        return matmul_t(out.view(b, -1).to(x.dtype), w_out)


def window_chunk_range(c: int, n_past: Optional[int], n_future: int, n_chunks: int) -> tuple[int, int]:
    """Chunks visible at a frame whose current chunk is c: c-np .. c+nf, clipped to the
    chunks that exist (n_past None or negative = unbounded, the paper's offline mode
    np=inf)."""
    lo = 0 if n_past is None or n_past < 0 else max(0, c - n_past)
    hi = min(n_chunks - 1, c + n_future)
    return lo, hi


def current_chunk(t: int, taus: Iterable[int]) -> int:
    """c(t): index of the last chunk whose start tau_i <= t (0 before the first)."""
    c = 0
    for i, tau in enumerate(taus):
        if tau <= t:
            c = i
        else:
            break
    return c


def streaming_dropout_mask(
    query_pos: torch.Tensor,  # [B, T]
    key_pos: torch.Tensor,  # [B, L]
    key_valid: torch.Tensor,  # [B, L] bool
    r1: int, r2: int,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Appendix A.5, Algorithm 2: per query a visible text window around the closest
    key, with randomly extended start/end, so training sees streaming-like context."""
    b, t = query_pos.shape
    l = key_pos.shape[1]
    kv_len = key_valid.sum(-1, keepdim=True)  # [B, 1]
    dist = (query_pos.unsqueeze(-1).float() - key_pos.unsqueeze(1).float()).abs()
    dist = dist.masked_fill(~key_valid.unsqueeze(1), float("inf"))
    closest = dist.argmin(-1)  # [B, T]
    u1 = torch.rand(b, t, generator=generator, device=query_pos.device)
    u2 = torch.rand(b, t, generator=generator, device=query_pos.device)
    start = torch.floor(u1 * (closest - r1).float()).clamp(min=0).long()
    end = closest + r2 + torch.floor(u2 * (kv_len - closest - r2).float().clamp(min=0)).long()
    end = torch.minimum(end, kv_len - 1)
    idx = torch.arange(l, device=query_pos.device)
    mask = (idx >= start.unsqueeze(-1)) & (idx <= end.unsqueeze(-1))
    return mask & key_valid.unsqueeze(1)
