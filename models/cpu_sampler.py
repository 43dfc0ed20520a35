"""A decode step's sampling on the CPU as one native call (models/native/sampler.cpp).

As tensor ops (guidance.py `_step_scores` in TorchScript, then the codes' top-k draws) a
16-session step's sampling ran ~20 small ops on [16, 40] and [128, 1,024] tensors, 0.9
ms of the step on the 2-core VM, most of it dispatch and torch's scalar top-k. The
native call makes the same draws row by row: `sample_step` the grapheme's guided draw
and the codes' draws of every session (`guidance.SamplingRows.sample`'s), `draw` top-k
inverse-CDF draws of any rows (`guidance.draw_rows`'). A row's k-th largest score is
bounded from below by the k-th largest maximum of its 32-score groups, so only the few
scores at or above that bound (~30 of 1,024 on the default model's logits) are ever
sorted, and only 8-score blocks whose maximum reaches it are read a second time.

`applies` says where it runs: CPU tensors, the native extension built
(models/native_step.py), k at most the number of groups a row has (32 for 1,024 codes).
Elsewhere (a GPU, a larger k, no build) the TorchScript sampler runs; the two agree token
for token up to float rounding of the CDF (tests/test_cpu_sampler.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from .native_step import native_module

BLOCK = 8  # scores a block (models/native/sampler.cpp's kBlock)
GROUP = 4  # blocks a group (kGroup)


def max_k(vocab: int) -> int:
    """The largest k the native draw takes from a row of `vocab` scores (its groups);
    past it every score of a row is a candidate, and sorting them is slow."""
    return -(-vocab // (BLOCK * GROUP))


def applies(scores: torch.Tensor, kmax: int) -> bool:
    return scores.device.type == "cpu" and kmax <= max_k(scores.shape[-1]) and native_module() is not None


def draw(scores: torch.Tensor, k: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N] tokens: row r's draw from its top k[r] scores (scores [N, V] float32, k [N]
    long, u [N] uniforms in [0, 1)), as `guidance._sample_rows` draws it: the top k sorted
    (ties in index order), token j of them for the first j whose CDF reaches u times the
    total. A row whose scores are all -inf gets its first candidate; a row with a NaN a
    token inside the vocabulary. A k past `max_k` is drawn alike, slowly: `applies`
    leaves those to torch."""
    return native_module().draw_rows(scores, k, u)


def sample_step(g_logits: torch.Tensor, a_logits: torch.Tensor, eos_barred: torch.Tensor, guide: torch.Tensor,
                bonus: torch.Tensor, hard: torch.Tensor, k_g: torch.Tensor, k_a: torch.Tensor, u: torch.Tensor,
                eos: int, inv_t: torch.Tensor, greedy: torch.Tensor, scaled: bool,
                first_code_table: Optional[torch.Tensor] = None,
                first_code_rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, 1 + Q], bad [B]): `guidance._step_scores` and the draws of its
    grapheme and codes, with its arguments, after `guidance.FirstCodeBias` (its table and
    rows; None: none) added to codebook 1's logits."""
    tokens, bad = native_module().sample_step(g_logits, a_logits, eos_barred, guide, bonus, hard, k_g, k_a, u, eos,
                                              inv_t, greedy, scaled, first_code_table, first_code_rows)
    return tokens, bad
