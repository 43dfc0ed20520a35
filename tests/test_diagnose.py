"""livespeech.training.eval.diagnose on a random tiny model and the smoke corpus: forced codebooks come
out where the delay pattern puts them, and the free mode steps the model exactly as the
server's ModelRunner does."""
import numpy as np
import pytest
import torch

from livespeech.models import graphemes as G
from livespeech.models.guidance import GuidanceState, SamplingSettings
from livespeech.models.loading import load_bundle
from livespeech.server.runner import ModelRunner
from livespeech.training.eval import diagnose
from livespeech.training.dataset import read_manifest
from livespeech.training.eval.evaluate import SR, read_audio, select_utterances
from livespeech.training.phones import PhoneTable
from livespeech.training.smoke import make_smoke_corpus


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("diag")
    corpus, _ = make_smoke_corpus(str(root), n_utts=4, with_codes=False)
    rows = read_manifest(corpus)
    utts = select_utterances(rows, root / "corpus", 1, split="dev")
    bundle = load_bundle(random_init=True)
    preps = diagnose.prepare(bundle, rows, utts, str(root / "codes"))
    runner = ModelRunner(bundle, capacity=1)
    voice = runner.make_voice("v", read_audio(utts[0].enroll_audio), SR)
    return bundle, preps[0], runner, voice, corpus, rows


def test_oracle_modes_emit_the_forced_codes_in_their_frames(setup):
    bundle, p, runner, voice, corpus, rows = setup
    T = p.n_frames
    gt = p.example.codes
    assert gt[0, T] == G.EOS and p.chunk_tau[-1] == T and p.example.text_pos[-1] == T
    s = diagnose.synthesize(runner, voice, p, "oracle-g+cb1", seed=3)
    assert s.frames.shape == (T, bundle.model.cfg.n_codebooks)  # ends exactly at the forced EOS
    np.testing.assert_array_equal(s.frames[:, 0], gt[0, :T])
    np.testing.assert_array_equal(s.frames[:, 1], gt[1, :T])  # frame t - delay_1, not step t
    assert s.steps == T + bundle.model.cfg.max_delay  # the last frame completes at T - 1 + max delay
    g = diagnose.synthesize(runner, voice, p, "oracle-g", seed=3)
    np.testing.assert_array_equal(g.frames[:, 0], gt[0, :T])
    assert not np.array_equal(g.frames[:, 1], gt[1, :T])  # sampled (random model: never all right)
    ac = diagnose.synthesize(runner, voice, p, "oracle-acoustic", seed=3)
    n = min(T, len(ac.frames))
    np.testing.assert_array_equal(ac.frames[:n, 1:].T, gt[1:, :n])  # every codebook at its own delay
    rec = next(r for r in rows if r["id"] == p.utt.id)
    table = PhoneTable.fit(bundle.codec, corpus, rows, min_count=1)
    m = diagnose.stream_metrics(p, s.frames, rec, table)
    assert m["frame_match"][0] == m["frame_match"][1] == 1.0 and m["graph_stream_errors"] == 0
    # codebook 1 forced to the ground truth's codes names the phones those codes name
    own = diagnose.phone_hits(table, rec, gt[1, :T])
    assert (m["cb1_phone_hits"], m["cb1_phone_frames"]) == (own["cb1_phone_hits"], own["cb1_phone_frames"])
    assert own["cb1_phone_frames"] > 0
    tf = diagnose.teacher_forced(bundle.model, p, 4, 2)
    assert tf["full"]["n"][0] == T + 1 and tf["full"]["n"][1] == T  # grapheme EOS frame is a target
    assert all(np.isfinite(tf[k]["ce"]).all() for k in ("full", "window"))
    # the true history is teacher forcing's own forward; every history scores the same frames
    hist = diagnose.history_reliance(bundle.model, p, table, rec, seed=0)
    assert [h[0] for h in diagnose.HISTORIES] == list(hist)
    assert hist["true"]["cb1_hits"] / hist["true"]["cb1_n"] == pytest.approx(tf["full"]["acc"][1], abs=1e-6)
    for h in hist.values():
        assert h["cb1_n"] == T and h["phone_n"] == own["cb1_phone_frames"]
    rows_, tf_sum = diagnose.summarize([], [{"teacher_forced": tf, "history": hist}])
    assert tf_sum["history"]["none"]["cb1_acc"] == hist["none"]["cb1_hits"] / T


def test_free_mode_steps_like_the_server_runner(setup):
    bundle, p, runner, voice, _, _ = setup
    free = diagnose.synthesize(runner, voice, p, "free", seed=7)
    runner.admit(0, voice, 7, sampling=SamplingSettings(0.0, 20))
    for c in range(len(p.chunk_tau)):
        js = [j for j, cj in enumerate(p.token_chunk) if cj == c]
        runner.add_chunk(0, [p.example.text_ids[j] for j in js], p.example.text_pos[js[0]], c)
    frames, guide = [], GuidanceState(input_complete=True)
    for t in range(free.steps):
        r = runner.step([0], [diagnose.window(p.chunk_tau, t, 4, 2)], [guide], [t > p.n_frames + 225])[0]
        if r.frame is not None:
            frames.append(r.frame)
        if r.done:
            break
    assert t + 1 == free.steps
    np.testing.assert_array_equal(free.frames[:, 1:], np.array(frames).reshape(-1, free.frames.shape[1] - 1))


def test_phone_modes_hold_codebook_1_to_the_codes_they_allow(setup):
    bundle, p, runner, voice, corpus, rows = setup
    rec = next(r for r in rows if r["id"] == p.utt.id)
    table = PhoneTable.fit(bundle.codec, corpus, rows, min_count=1)
    size, T = bundle.model.cfg.codebook_size, p.n_frames
    allowed = table.allowed_codes(rec, T, size)
    held = [f for f in range(T) if allowed[f].any()]
    assert held
    truth = diagnose.synthesize(runner, voice, p, "oracle-g+phone", seed=3,
                                cb1_rule=diagnose.cb1_rule("oracle-g+phone", table, rec, p, size))
    assert all(allowed[f, truth.frames[f, 1]] for f in held)
    plain = diagnose.synthesize(runner, voice, p, "oracle-g", seed=3)
    assert not all(allowed[f, plain.frames[f, 1]] for f in held)  # the rule is what holds it
    named = table.code_phones(size)
    argmax = diagnose.synthesize(runner, voice, p, "oracle-g+phone-argmax", seed=3,
                                 cb1_rule=diagnose.cb1_rule("oracle-g+phone-argmax", table, rec, p, size))
    assert (named[torch.from_numpy(argmax.frames[:, 1])] >= 0).all()
    assert not (named[torch.from_numpy(plain.frames[:, 1])] >= 0).all()


def test_follow_text_moves_along_the_letters_the_row_spells():
    h, e, l, o = (G.text_to_ids(c)[0] for c in "helo")
    letters = G.text_to_ids("hello")
    assert diagnose.follow_text(letters, [h, h, e, l, l, o, G.BLANK, o]) == [0, 0, 1, 2, 2, 4, -1, 4]
    assert diagnose.follow_text(letters, [G.BLANK, e, o], ahead=1) == [-1, 1, 1]  # too far ahead: stays
