"""The native CPU sampler (models/cpu_sampler.py) against the definition of a top-k
inverse-CDF draw, and the step's sampler with it against the TorchScript one."""
import math

import pytest
import torch

from livespeech.models import cpu_sampler, guidance
from livespeech.models.guidance import SamplingSettings, SlotSampling, Temperatures

EPS = 1e-5  # float32 rounding of a CDF of up to ~1,000 terms, with room


def _check_draws(tokens, scores, k, u):
    """Each token is the inverse-CDF draw at u from its row's top k (the row sorted
    stably, descending, in float64), to within EPS of a CDF step: float32 sums in another
    order may put a u that close to a step on its other side."""
    n, v = scores.shape
    vals, idx = scores.double().sort(dim=-1, descending=True, stable=True)
    for r in range(n):
        t, kr = int(tokens[r]), min(max(int(k[r]), 1), v)
        assert 0 <= t < v
        top = vals[r, :kr]
        if math.isinf(top[0]) and top[0] < 0:  # an all -inf row: its first candidate
            assert t == int(idx[r, 0])
            continue
        w = torch.exp(top - top[0])
        cdf = torch.cat((w.new_zeros(1), w.cumsum(0) / w.sum()))
        j = (idx[r, :kr] == t).nonzero()
        if len(j) == 0:  # a tie at the k-th score: the same value, another index
            assert scores[r, t] == vals[r, kr - 1]
            continue
        j = int(j[0])
        assert cdf[j] - EPS <= float(u[r]) <= cdf[j + 1] + EPS, (r, t, j, float(u[r]), cdf[j : j + 2].tolist())


def _rows(n, v, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale, torch.rand(n, generator=g)


@pytest.mark.parametrize("v", [1024, 1000, 37])
def test_the_kernel_draws_the_inverse_cdf_of_each_rows_top_k(v):
    n = 600
    scores, u = _rows(n, v, v)
    scores[: n // 2] *= 3  # peaked rows as well as flat ones
    k = torch.randint(1, cpu_sampler.max_k(v) + 1, (n,), generator=torch.Generator().manual_seed(1))
    got = cpu_sampler.draw(scores, k, u)
    _check_draws(got, scores, k, u)
    # and the TorchScript sampler's token, row for row, but for u within rounding of a step
    want = guidance._sample_rows(scores, k, int(k.max()), u)
    assert (got != want).sum() <= 1


@pytest.mark.parametrize("k", [33, 200, 1024])
def test_a_k_past_the_kernels_bound_is_drawn_alike(k):
    scores, u = _rows(64, 1024, k)
    assert not cpu_sampler.applies(scores, k) and cpu_sampler.applies(scores, 32)
    _check_draws(cpu_sampler.draw(scores, torch.full((64,), k), u), scores, torch.full((64,), k), u)


def test_ties_infinities_and_nans():
    """Ties go in index order; -inf scores are never drawn while a finite one is in the
    top k; an all -inf row gets its first index; a row with NaN or +inf (a failing row)
    gets a token in the vocabulary, and the other rows are drawn as without it."""
    v, n = 1024, 16
    scores, u = _rows(n, v, 5)
    scores[0] = torch.round(scores[0])  # many ties, across the k-th score too
    scores[1, 7:] = -math.inf  # fewer finite scores than k
    scores[2] = -math.inf
    scores[3, [5, 700]] = 9.0  # an exact tie at the top
    k = torch.full((n,), 20)
    clean = cpu_sampler.draw(scores, k, u)
    _check_draws(clean, scores, k, u)
    assert int(clean[1]) < 7 and int(clean[2]) == 0
    for bad in (math.nan, math.inf):
        broken = scores.clone()
        broken[4, 10:40] = bad
        got = cpu_sampler.draw(broken, k, u)
        assert 0 <= int(got[4]) < v
        assert torch.equal(got[torch.arange(n) != 4], clean[torch.arange(n) != 4])


def _sampling_rows(b, g, v, settings):
    table = SlotSampling(b, g, v, "cpu")
    for r, s in enumerate(settings):
        table.set(r, s)
    idx = torch.arange(b)
    sets = guidance.GuidingSets(torch.zeros(b, g, dtype=torch.bool), torch.zeros(b, dtype=torch.bool))
    return table.rows(idx, table.guide(idx, sets)), table.kmax(list(range(b)))


def test_the_steps_sampler_draws_natively_on_the_cpu():
    """`SamplingRows.sample` on the CPU (one native call) against the TorchScript sampler a
    GPU runs: the same bad rows, the same graphemes and codes but for a u within rounding
    of a CDF step, and codes that are the inverse-CDF draws of their (temperature-scaled)
    rows; greedy rows take the top code."""
    b, q, g, v = 12, 8, 40, 1024
    gen = torch.Generator().manual_seed(3)
    g_logits, a_logits = torch.randn(b, g, generator=gen) * 2, torch.randn(b, q, v, generator=gen) * 3
    a_logits[5, 2, 0] = math.nan
    u = torch.rand(b, 1 + q, generator=gen)
    settings = [SamplingSettings(0.0, 20)] * 6 + [SamplingSettings(0.0, 5 + r, temperatures=Temperatures(1.0, 0.7, 1.3))
                                                  for r in range(5)]
    settings.append(SamplingSettings(0.0, 20, temperatures=Temperatures(1.0, 0.0, 0.0)))  # greedy codes
    rows, (kg, ka) = _sampling_rows(b, g, v, settings)
    assert cpu_sampler.applies(a_logits, ka)
    got, bad = rows.sample(g_logits, a_logits, u, kg, ka, scaled=True)
    g_tok, scores, k_rows, want_bad = guidance._scripted_step_scores()(
        g_logits, a_logits, rows.eos_barred, rows.guide, rows.bonus, rows.hard, rows.k_g, kg, rows.k_a, u,
        guidance.EOS, rows.inv_t, rows.greedy, True)
    want = guidance._scripted_sample_rows()(scores, k_rows, ka, u[:, 1:].reshape(-1)).view(b, q)
    assert torch.equal(bad, want_bad) and bad.tolist() == [r == 5 for r in range(b)]
    assert (got[:, 0] != g_tok).sum() <= 1
    assert (got[:, 1:] != want).sum() <= 1
    scale = torch.ones(b, q)
    for r, s in enumerate(settings):
        scale[r, 0] = 1.0 / s.temperatures.first_codebook if s.temperatures.first_codebook else 1.0
        scale[r, 1:] = 1.0 / s.temperatures.acoustic if s.temperatures.acoustic else 1.0
    k = torch.tensor([1 if s.temperatures.acoustic == 0 else s.top_k for s in settings]).repeat_interleave(q)
    ok = torch.arange(b).repeat_interleave(q) != 5
    scaled = (a_logits * scale[:, :, None]).reshape(b * q, v)
    _check_draws(got[:, 1:].reshape(-1)[ok], scaled[ok], k[ok], u[:, 1:].reshape(-1)[ok])
    assert torch.equal(got[-1, 1:], a_logits[-1].argmax(-1))


def test_without_the_native_build_the_step_draws_with_torchs_top_k(monkeypatch):
    """Where the native extension cannot be had, `applies` says no and the step's sampler
    draws every token with the TorchScript sampler: the same tokens as the native one, but
    for a u within rounding of a CDF step."""
    b, q, g, v = 6, 8, 40, 1024
    gen = torch.Generator().manual_seed(9)
    g_logits, a_logits = torch.randn(b, g, generator=gen), torch.randn(b, q, v, generator=gen) * 3
    u = torch.rand(b, 1 + q, generator=gen)
    rows, (kg, ka) = _sampling_rows(b, g, v, [SamplingSettings(0.0, 20)] * b)
    with_kernel, bad = rows.sample(g_logits, a_logits, u, kg, ka, scaled=False)
    monkeypatch.setattr(cpu_sampler, "native_module", lambda: None)
    assert not cpu_sampler.applies(a_logits, ka)
    without, bad_without = rows.sample(g_logits, a_logits, u, kg, ka, scaled=False)
    assert torch.equal(bad, bad_without) and (with_kernel[:, 0] != without[:, 0]).sum() <= 1
    assert (with_kernel[:, 1:] != without[:, 1:]).sum() <= 1
    _check_draws(without[:, 1:].reshape(-1), a_logits.reshape(b * q, v), torch.full((b * q,), 20),
                 u[:, 1:].reshape(-1))


def test_the_native_step_guides_the_grapheme_as_torch_does(monkeypatch):
    """Guided rows (lambda 1 and 4: a bonus on the guiding graphemes; inf: only them),
    EOS barred or not, a hard row whose only guiding grapheme is a barred EOS (it keeps
    the others), temperatures and a greedy grapheme: the native step's graphemes are the
    TorchScript sampler's, but for a u within rounding of a CDF step, and each is the
    inverse-CDF draw of its row's guided scores."""
    b, q, g, v = 24, 8, 40, 1024
    gen = torch.Generator().manual_seed(11)
    g_logits, a_logits = torch.randn(b, g, generator=gen) * 2, torch.randn(b, q, v, generator=gen)
    u = torch.rand(b, 1 + q, generator=gen)
    lambdas = [0.0, 1.0, 4.0, math.inf]
    settings = [SamplingSettings(lambdas[r % 4], 20, grapheme_top_k=1 + r % 7,
                                 temperatures=Temperatures(0.8 if r % 5 else 0.0, 1.0, 1.0)) for r in range(b)]
    table = SlotSampling(b, g, v, "cpu")
    for r, s in enumerate(settings):
        table.set(r, s)
    idx = torch.arange(b)
    mask = torch.rand(b, g, generator=gen) < 0.2
    barred = torch.arange(b) % 3 == 0
    mask[3] = False
    mask[3, guidance.EOS] = True  # row 3's only guiding grapheme, barred
    rows = table.rows(idx, table.guide(idx, guidance.GuidingSets(mask, barred)))
    kg, ka = table.kmax(list(range(b)))
    got, bad = rows.sample(g_logits, a_logits, u, kg, ka, scaled=True)
    monkeypatch.setattr(cpu_sampler, "native_module", lambda: None)
    want, want_bad = rows.sample(g_logits, a_logits, u, kg, ka, scaled=True)
    assert torch.equal(bad, want_bad) and not bad.any()
    assert (got[:, 0] != want[:, 0]).sum() <= 1 and (got[:, 1:] != want[:, 1:]).sum() <= 1
    # the guided scores, written out
    scores = g_logits * rows.inv_t[:, :1]
    scores[:, guidance.EOS] = scores[:, guidance.EOS].masked_fill(barred, -math.inf)
    hard = rows.hard & (rows.guide & ~torch.isneginf(scores)).any(-1)
    scores = torch.where(rows.guide, scores + rows.bonus[:, None], scores.masked_fill(hard[:, None], -math.inf))
    k = torch.where(rows.greedy[:, 0], 1, rows.k_g)
    _check_draws(got[:, 0], scores, k, u[:, 0])
    assert not hard[3] and rows.hard[3]
    assert all(int(got[r, 0]) != guidance.EOS for r in range(b) if barred[r])


def test_the_native_step_adds_the_first_codes_bias(monkeypatch):
    """The front end's bias of codebook 1 (`FirstCodeBias`: a table row a sampled row, -1
    none) is added before the temperature, natively as by torch: the same codes but for
    a u within rounding of a CDF step, each the draw of its biased, scaled row."""
    b, q, g, v = 16, 8, 40, 1024
    gen = torch.Generator().manual_seed(21)
    g_logits, a_logits = torch.randn(b, g, generator=gen), torch.randn(b, q, v, generator=gen)
    u = torch.rand(b, 1 + q, generator=gen)
    table = torch.randn(5, v, generator=gen) * 4
    bias_rows = torch.tensor([-1, 0, 4, 2] * 4)
    settings = [SamplingSettings(0.0, 10, temperatures=Temperatures(1.0, 0.5 + 0.1 * (r % 4), 1.0)) for r in range(b)]
    rows, (kg, ka) = _sampling_rows(b, g, v, settings)
    bias = guidance.FirstCodeBias(table, bias_rows)
    got, _ = rows.sample(g_logits, a_logits, u, kg, ka, True, bias)
    monkeypatch.setattr(cpu_sampler, "native_module", lambda: None)
    want, _ = rows.sample(g_logits, a_logits.clone(), u, kg, ka, True, bias)
    assert (got[:, 1] != want[:, 1]).sum() <= 1 and (got != want).sum() <= 2
    first = (a_logits[:, 0] + table[bias_rows.clamp_min(0)] * (bias_rows >= 0)[:, None]) * rows.inv_t[:, 1:2]
    _check_draws(got[:, 1], first, rows.k_a, u[:, 1])
    # the bias moves the draws: without it they differ
    plain, _ = rows.sample(g_logits, a_logits, u, kg, ka, True)
    assert (plain[:, 1] != got[:, 1]).sum() >= 4
