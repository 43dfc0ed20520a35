"""The delay (shift) pattern between codebooks (MusicGen / LiveSpeech).

Codebook k (grapheme k=0, acoustic k>=1) at decode step s carries frame s - d_k.
The grapheme row has one extra frame: EOS at frame T (the end of speech). A position
whose frame is outside [0, last_k] holds the codebook's "none" id, both as a training
target (ignored by the loss) and as the next step's input; inference uses the same
rule (`frame_is_valid`), so training and decoding see identical inputs.
"""
from __future__ import annotations

from typing import Sequence

import torch


def build_delayed(
    codes: torch.Tensor,  # [B, K, F] frame-aligned ids; grapheme row includes the EOS frame
    last_frame: torch.Tensor,  # [B, K] index of the last valid frame per row
    delays: Sequence[int],
    none_ids: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (inputs, targets, valid), each [B, K, S] with S = F + max(delays)."""
    b, k_count, f = codes.shape
    s_len = f + max(delays)
    device = codes.device
    steps = torch.arange(s_len, device=device)
    targets = torch.empty(b, k_count, s_len, dtype=torch.long, device=device)
    valid = torch.empty(b, k_count, s_len, dtype=torch.bool, device=device)
    for k, d in enumerate(delays):
        frame = steps - d  # [S]
        ok = (frame >= 0).unsqueeze(0) & (frame.unsqueeze(0) <= last_frame[:, k : k + 1])
        src = codes[:, k].gather(1, frame.clamp(0, f - 1).unsqueeze(0).expand(b, -1))
        targets[:, k] = torch.where(ok, src, torch.full_like(src, none_ids[k]))
        valid[:, k] = ok
    none = torch.tensor(list(none_ids), device=device).view(1, k_count, 1).expand(b, -1, 1)
    inputs = torch.cat((none, targets[:, :, :-1]), dim=2)
    return inputs, targets, valid


def undelay(tokens: torch.Tensor, delays: Sequence[int], n_frames: int) -> torch.Tensor:
    """Inverse of the pattern for one sequence: tokens [K, S] -> frames [K, n_frames]."""
    return torch.stack([tokens[k, d : d + n_frames] for k, d in enumerate(delays)])


def frame_is_valid(step: torch.Tensor, delay: int, last_frame: torch.Tensor) -> torch.Tensor:
    """Whether codebook with `delay` at decode `step` carries a real frame (<= last_frame)."""
    frame = step - delay
    return (frame >= 0) & (frame <= last_frame)
