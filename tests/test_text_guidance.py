"""Classifier-free guidance on the text: the arithmetic (`text_guided`), the runner that
steps the decoder without text beside every session, and the training option that
teaches the decoder to predict without its text."""
import numpy as np
import pytest
import torch

from livespeech.models import graphemes
from livespeech.models.guidance import GuidanceState, SamplingRows, SamplingSettings, Temperatures
from livespeech.models.livespeech import StepLogits, text_guided
from livespeech.models.loading import load_bundle
from livespeech.server.runner import ModelRunner
from livespeech.training.train import drop_text


def test_guided_logits_move_away_from_the_prediction_without_text():
    cond = StepLogits(torch.tensor([[1.0, 2.0]]), torch.tensor([[[0.0, 1.0]]]))
    uncond = StepLogits(torch.tensor([[1.0, 0.0]]), torch.tensor([[[1.0, 1.0]]]))
    guided = text_guided(cond, uncond, 2.0)
    assert guided.graphemes.tolist() == [[1.0, 6.0]]
    assert guided.acoustic.tolist() == [[[-2.0, 1.0]]]
    same = text_guided(cond, uncond, 0.0)
    assert torch.equal(same.graphemes, cond.graphemes) and torch.equal(same.acoustic, cond.acoustic)


def _run(runner, voice, slots, with_text, steps, monkeypatch, tokens=None):
    """Step `runner` on `slots`; returns each step's logits (graphemes, acoustic) as given
    to the sampler, and the tokens sampled (or `tokens`, replayed, when given)."""
    seen, sampled = [], []
    real = SamplingRows.sample

    def sample(rows, g, a, *args, **kw):
        seen.append((g.clone(), a.clone()))
        if tokens is None:
            out = real(rows, g, a, *args, **kw)
            sampled.append(out[0].clone())
            return out
        t = tokens[len(seen) - 1].clone()
        return t, torch.zeros(t.shape[0], dtype=torch.bool, device=t.device)

    monkeypatch.setattr(SamplingRows, "sample", sample)
    guides = []
    for k, s in enumerate(slots):
        guides.append(runner.admit(s, voice, seed=5 + k, guidance=GuidanceState(graphemes.text_to_ids("some text")),
                                   sampling=SamplingSettings(0.0, 20, 3, Temperatures(1.0, 0.5, 1.0))))
        if with_text:
            runner.add_chunk(s, [300 + 7 * k, 301, 302 + k], 0, 0)
    n = len(slots)
    for _ in range(steps):
        runner.step(slots, [(0, 0)] * n, guides, [False] * n)
    monkeypatch.setattr(SamplingRows, "sample", real)
    return seen, sampled


@pytest.mark.parametrize("frozen", [False, True])
def test_a_runner_with_text_cfg_samples_from_guided_logits(monkeypatch, frozen):
    """Each step's logits are `text_guided` of what a plain runner with the text and one
    without any text give for the same history: the decoder without text keeps its own
    recurrent state per session, slot by slot (slots not contiguous: gathered and
    scattered back)."""
    torch.set_num_threads(1)
    bundle = load_bundle(random_init=True)
    scale, slots, steps = 1.5, [3, 0], 12
    guided_runner = ModelRunner(bundle, 4, frozen_step=frozen, text_cfg_scale=scale)
    voice = guided_runner.make_voice("v", (np.random.default_rng(1).standard_normal(24000) * 0.1).astype(np.float32),
                                     24000)
    guided, tokens = _run(guided_runner, voice, slots, True, steps, monkeypatch)
    cond, _ = _run(ModelRunner(bundle, 4, frozen_step=frozen), voice, slots, True, steps, monkeypatch, tokens)
    uncond, _ = _run(ModelRunner(bundle, 4, frozen_step=frozen), voice, slots, False, steps, monkeypatch, tokens)
    for (g, a), (cg, ca), (ug, ua) in zip(guided, cond, uncond):
        want = text_guided(StepLogits(cg, ca), StepLogits(ug, ua), scale)
        torch.testing.assert_close(g, want.graphemes, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a, want.acoustic, atol=1e-4, rtol=1e-4)
    # the text matters to this model, so the comparison means something
    assert not torch.allclose(cond[-1][1], uncond[-1][1], atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_text_cfg_replayed_from_cuda_graphs_equals_the_eager_steps(monkeypatch):
    """With --cuda-graphs the decoder without text is a recorded graph of its own."""
    bundle = load_bundle(random_init=True, device="cuda")
    scale, slots, steps = 1.5, [3, 0], 12
    eager = ModelRunner(bundle, 4, text_cfg_scale=scale)
    voice = eager.make_voice("v", (np.random.default_rng(1).standard_normal(24000) * 0.1).astype(np.float32), 24000)
    want, tokens = _run(eager, voice, slots, True, steps, monkeypatch)
    graphs = ModelRunner(bundle, 4, cuda_graphs=True, text_cfg_scale=scale)
    assert graphs.captured_unconditioned is not None
    got, _ = _run(graphs, voice, slots, True, steps, monkeypatch, tokens)
    for (g, a), (wg, wa) in zip(got, want):
        torch.testing.assert_close(g, wg, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(a, wa, atol=1e-3, rtol=1e-3)


def test_a_runner_without_text_cfg_keeps_no_state_for_it():
    runner = ModelRunner(load_bundle(random_init=True), 2)
    assert runner.unconditioned is None and runner.captured_unconditioned is None


def test_text_dropout_hides_all_text_from_a_share_of_the_rows():
    mask = torch.ones(400, 3, 5, dtype=torch.bool)
    mask[:, :, 4] = False
    out = drop_text(mask, 0.25, torch.Generator().manual_seed(0))
    hidden = ~out.any(-1).any(-1)
    assert 60 < int(hidden.sum()) < 140  # about a quarter of 400
    assert torch.equal(out[~hidden], mask[~hidden])  # the others keep their mask as it was
    assert torch.equal(drop_text(mask[:, 0], 0.0, torch.Generator()), mask[:, 0])
