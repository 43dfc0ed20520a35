"""Top-k inverse-CDF draws of many rows on the CPU, as one compiled loop (numba).

torch's CPU top-k selects each row in scalar code: at k = 20 over 1,024 codes ~5 us a
row on the 2-core VM, two thirds of the sampler at 16 sessions and the largest part of a
step at 256 (docs/loadtest.md, "Measured choices"). This kernel draws the token
`guidance._sample_rows` draws from the same scores, k and uniform, in a fraction of that:
a row's k-th largest score is bounded from below by the k-th largest maximum of its
32-score groups, so only the few scores at or above that bound (~30 of 1,024 on the
default model's logits) are ever sorted, and only 8-score blocks whose maximum reaches it
are read a second time.

`applies` says where it runs: CPU tensors, numba importable, k at most the number of
groups a row has (32 for 1,024 codes). Elsewhere (a GPU, a larger k) the TorchScript
sampler runs; the two agree token for token up to float rounding of the CDF
(tests/test_cpu_sampler.py).
"""
from __future__ import annotations

import numpy as np
import torch

from .compiled import compiled, numba

BLOCK = 8  # scores a block: a block is read again only if its maximum reaches the bound
GROUP = 4  # blocks a group: the bound is the k-th largest group maximum


def max_k(vocab: int) -> int:
    """The largest k the kernel draws from a row of `vocab` scores (its groups)."""
    return -(-vocab // (BLOCK * GROUP))


def applies(scores: torch.Tensor, kmax: int) -> bool:
    return numba is not None and scores.device.type == "cpu" and kmax <= max_k(scores.shape[-1])


def draw(scores: torch.Tensor, k: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N] tokens: row r's draw from its top k[r] scores (scores [N, V] float32, k [N]
    long, u [N] uniforms in [0, 1)), as `guidance._sample_rows` draws it: the top k sorted
    (ties in index order), token j of them for the first j whose CDF reaches u times the
    total. A row whose scores are all -inf gets its first candidate; a row with a NaN a
    token inside the vocabulary. A k past `max_k` is drawn alike, slowly (every score of
    its row sorted): `applies` leaves those to torch."""
    scores = scores.contiguous()
    out = torch.empty(scores.shape[0], dtype=torch.long)
    # numpy views of the CPU tensors, shared in place: no device to wait for, so not the
    # host reads loadtest/host_reads.py counts for a GPU's step (torch function modes off)
    with torch._C.DisableTorchFunction():
        _draw_rows(scores.numpy(), k.contiguous().numpy(), u.to(torch.float32).contiguous().numpy(), out.numpy())
    return out


def _block_maxima(row, bm):
    v = row.shape[0]
    full = v // BLOCK
    for b in range(full):  # a fixed trip count, which vectorises
        m = np.float32(-np.inf)
        for i in range(BLOCK):
            m = max(m, row[b * BLOCK + i])
        bm[b] = m
    if full < bm.shape[0]:  # a last, partial block
        m = np.float32(-np.inf)
        for i in range(full * BLOCK, v):
            m = max(m, row[i])
        bm[full] = m


def _collect(row, start, stop, lb, cv, ci, c):
    """row[start:stop]'s scores >= lb inserted into the c candidates cv (descending, a tie
    after the earlier index) and their indices ci; returns the new count."""
    for i in range(start, stop):
        x = row[i]
        if x >= lb:
            j = c
            while j > 0 and cv[j - 1] < x:
                cv[j] = cv[j - 1]
                ci[j] = ci[j - 1]
                j -= 1
            cv[j] = x
            ci[j] = i
            c += 1
    return c


def _draw_rows(scores, k, u, out):
    n, v = scores.shape
    nb, full = -(-v // BLOCK), v // BLOCK
    ng = -(-nb // GROUP)
    bm = np.empty(nb, np.float32)
    gm = np.empty(ng, np.float32)
    cv = np.empty(v, np.float32)  # the candidates, descending, then their CDF
    ci = np.empty(v, np.int64)
    for r in range(n):
        kr = min(max(k[r], 1), v)
        row = scores[r]
        _block_maxima(row, bm)
        for g in range(ng):
            m = bm[g * GROUP]
            for j in range(g * GROUP + 1, g * GROUP + GROUP if g < nb // GROUP else nb):
                m = max(m, bm[j])
            gm[g] = m
        # the bound: the kr-th largest group maximum, the smallest of those with
        # fewer than kr above them (at least kr scores reach it); past ng groups,
        # every score is a candidate
        lb = np.float32(-np.inf)
        if kr <= ng:
            lb = np.float32(np.inf)
            for i in range(ng):
                above = 0
                x = gm[i]
                for j in range(ng):
                    above += gm[j] > x
                if above < kr and x < lb:
                    lb = x
        c = 0
        for b in range(full):
            if bm[b] >= lb:
                c = _collect(row, b * BLOCK, b * BLOCK + BLOCK, lb, cv, ci, c)
        if full < nb and bm[full] >= lb:
            c = _collect(row, full * BLOCK, v, lb, cv, ci, c)
        kk = min(kr, c)
        if kk == 0:  # only NaNs reached the bound
            out[r] = 0
            continue
        top = cv[0]
        if top == -np.inf:
            out[r] = ci[0]
            continue
        total = np.float32(0.0)
        for j in range(kk):
            total += np.exp(cv[j] - top)
            cv[j] = total
        x = np.float32(u[r]) * total
        j = 0
        for t in range(kk):
            if cv[t] < x:
                j += 1
        out[r] = ci[min(j, kk - 1)]


if numba is not None:  # without it `applies` leaves the rows to torch's top-k
    # fast-math lets the block maxima vectorise; a NaN (a failing row) may then be taken
    # or not, which moves that row's token only within the vocabulary
    _block_maxima = compiled(_block_maxima, fastmath=True)
    _collect = compiled(_collect, inline="always")
    _draw_rows = compiled(_draw_rows)
