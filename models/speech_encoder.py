"""Speech encoder: enrollment speech of any length -> a fixed set of N vectors.

The input is the enrollment's codec codes (summed codebook embeddings, so a voice is
registered with the codec encoder alone); N learned "empty" features are prepended and
their outputs after the transformer are the enrollment (paper Sec. 5.2: 64 vectors).
Computed once per voice and reused by every session speaking with it.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelConfig


def sinusoid(n: int, d: int, device=None) -> torch.Tensor:
    pos = torch.arange(n, device=device, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2, device=device, dtype=torch.float32) * (-math.log(10_000.0) / d))
    pe = torch.zeros(n, d, device=device)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


class SpeechEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.enc_d_model
        self.code_emb = nn.ModuleList(nn.Embedding(cfg.codebook_size, d) for _ in range(cfg.n_acoustic_codebooks))
        self.empty = nn.Parameter(torch.randn(cfg.n_enroll, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, cfg.enc_heads, 4 * d, dropout=cfg.dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.enc_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, cfg.d_model)

    def forward(self, codes: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """codes [B, Q', T] (Q' <= n_acoustic_codebooks: fewer codebooks are fine);
        lengths [B] valid frames. Returns [B, N, d_model]."""
        b, q, t = codes.shape
        t = min(t, self.cfg.enc_max_frames)
        codes = codes[:, :, :t]
        x = sum(self.code_emb[k](codes[:, k]) for k in range(min(q, len(self.code_emb))))
        x = x + sinusoid(t, x.shape[-1], x.device).to(x.dtype)
        x = torch.cat((self.empty.expand(b, -1, -1), x), dim=1)
        pad = torch.zeros(b, self.cfg.n_enroll + t, dtype=torch.bool, device=codes.device)
        if lengths is not None:
            frame = torch.arange(t, device=codes.device)
            pad[:, self.cfg.n_enroll:] = frame.unsqueeze(0) >= lengths.clamp(max=t).unsqueeze(1)
        h = self.encoder(x, src_key_padding_mask=pad)
        return self.out(self.norm(h[:, : self.cfg.n_enroll]))
