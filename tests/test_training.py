"""Training pipeline smoke tests on a tiny synthetic corpus (sine tones, fake words): codec
steps + resume, corpus encoding, decoder steps + exact resume, example layout, and that
the decoder loss goes down on one repeated batch. No eSpeak, no GPU; well under a minute."""
import argparse
import json
import math
import os
import random

import numpy as np
import pytest
import torch

from livespeech.models import graphemes as G
from livespeech.models.codec import CodecModel
from livespeech.models.tokenizer import get_tokenizer
from livespeech.training import codec_train, encode_corpus, train
from livespeech.training.schedule import Schedule, setup_device
from livespeech.training.dataset import (AudioCrops, DecoderData, codes_path, collate, jittered_end, read_manifest,
                                         read_wav_segment, text_tokens)
from livespeech.training.smoke import make_smoke_corpus

SMALL = "d_model=64,n_shared_layers=1,n_group_layers=1,n_heads=2,enc_d_model=64,enc_layers=1,enc_heads=2,n_enroll=8"


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _tiny_model_and_batch(corpus: str, codes: str):
    """(config, a tiny decoder, a training batch of the first two utterances)."""
    cfg = train.preset("tiny", **train.parse_overrides(SMALL))
    model = train.build_model(cfg, "cpu")
    data = DecoderData(corpus, codes, cfg, "train")
    return cfg, model, collate([data.example(i, random.Random(i)) for i in range(2)], model)


def _log(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Corpus -> 2 codec steps (+1 resumed) -> encoded codes."""
    root = tmp_path_factory.mktemp("train")
    corpus, _ = make_smoke_corpus(str(root), n_utts=6, with_codes=False)
    codec_dir = str(root / "codec")
    common = ["--corpus", corpus, "--out", codec_dir, "--batch", "2", "--crop-s", "0.5", "--eval-every", "2",
              "--dev-n", "2", "--dev-seconds", "0.5", "--kmeans-iters", "1", "--log-every", "1", "--ckpt-every", "1"]
    assert codec_train.main(common + ["--steps", "2"]) == 0
    assert codec_train.main(common + ["--steps", "3", "--resume"]) == 0
    codes_dir = str(root / "codes")
    assert encode_corpus.main(["--corpus", corpus, "--codec", os.path.join(codec_dir, "best.pt"), "--out", codes_dir]) == 0
    return root, corpus, codec_dir, codes_dir


def test_codec_train_resumes_and_saves_loadable_checkpoints(pipeline):
    _, _, codec_dir, _ = pipeline
    rows = [r for r in _log(os.path.join(codec_dir, "log.jsonl")) if not r.get("eval")]
    assert [r["step"] for r in rows] == [1, 2, 3]  # the resumed run continued at step 3
    assert all(math.isfinite(r["total"]) for r in rows)
    evals = [r for r in _log(os.path.join(codec_dir, "log.jsonl")) if r.get("eval")]
    assert evals and all(math.isfinite(r["dev_mel"]) for r in evals)
    for name in ("best.pt", "last.pt"):
        m = CodecModel.from_checkpoint(os.path.join(codec_dir, name))
        assert m.config.n_q == 8


def test_adversarial_decoder_only_fine_tune_keeps_the_codes(pipeline, tmp_path):
    root, corpus, codec_dir, _ = pipeline
    out = str(tmp_path / "ft")
    common = ["--corpus", corpus, "--out", out, "--init", os.path.join(codec_dir, "best.pt"), "--decoder-only",
              "--adversarial", "--batch", "2", "--crop-s", "0.5", "--eval-every", "2", "--dev-n", "2",
              "--dev-seconds", "0.5", "--log-every", "1", "--ckpt-every", "1", "--lr", "1e-3"]
    assert codec_train.main(common + ["--steps", "2"]) == 0
    assert codec_train.main(common + ["--steps", "3", "--resume"]) == 0
    rows = [r for r in _log(os.path.join(out, "log.jsonl")) if not r.get("eval")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r[k]) for r in rows for k in ("total", "adv", "feat", "disc"))
    assert all(r["commit"] == 0 for r in rows)
    st = torch.load(os.path.join(out, "last_state.pt"), map_location="cpu", weights_only=False)
    assert "disc" in st and "d_opt" in st  # the discriminator resumes with the codec
    before = CodecModel.from_checkpoint(os.path.join(codec_dir, "best.pt"))
    after = CodecModel.from_checkpoint(os.path.join(out, "last.pt"))
    b, a = before.state_dict(), after.state_dict()
    frozen = [k for k in b if k.startswith(("encoder.", "quantizer."))]
    assert frozen and all(torch.equal(b[k], a[k]) for k in frozen)  # codebooks' EMA buffers too
    assert any(not torch.equal(b[k], a[k]) for k in b if k.startswith("decoder."))
    wav = torch.from_numpy(read_wav_segment(os.path.join(corpus, read_manifest(corpus)[0]["audio"]), 0, 12000))
    with torch.no_grad():
        assert torch.equal(before.encode(wav.view(1, 1, -1)), after.encode(wav.view(1, 1, -1)))


def test_a_small_batch_fine_tune_keeps_the_codebooks_in_use(pipeline, tmp_path):
    # every code in use at ~1,000 vectors a step (EMA count 1, under the config's threshold
    # of 2, which holds for 4,800 vectors a step): at 76 vectors a step (batch 2 of 0.5 s) the
    # threshold scales down with the batch, so no code counts as dead and none is re-seeded
    from livespeech.models.codec import preset

    _, corpus, _, _ = pipeline
    torch.manual_seed(0)
    init = CodecModel(preset("small", kmeans_init=False))
    for layer in init.quantizer.vq.layers:
        cb = layer._codebook
        cb.embed.normal_()
        cb.embed_avg.copy_(cb.embed)
        cb.cluster_size.fill_(1.0)
    init_path = str(tmp_path / "init.pt")
    init.save(init_path)
    out = str(tmp_path / "ft")
    assert codec_train.main(["--corpus", corpus, "--out", out, "--init", init_path, "--batch", "2", "--crop-s", "0.5",
                             "--steps", "2", "--eval-every", "100", "--dev-n", "2", "--dev-seconds", "0.5",
                             "--probe-n", "0", "--log-every", "1"]) == 0
    after = CodecModel.from_checkpoint(os.path.join(out, "last.pt"))
    seen = 2 * 2 * 38  # the vectors of two steps: an EMA step moves only the codes they reach
    for b, a in zip(init.quantizer.vq.layers, after.quantizer.vq.layers):
        moved = (a._codebook.embed - b._codebook.embed).norm(dim=1) / b._codebook.embed.norm(dim=1)
        assert int((moved > 0.05).sum()) <= seen  # re-seeding would replace all 1,024


def test_engine_weights_set_how_often_each_engine_is_cropped(pipeline):
    _, corpus, _, _ = pipeline
    recs = [dict(r, engine="flite" if i % 3 == 0 else "espeak") for i, r in enumerate(read_manifest(corpus))]
    n_flite = sum(r["engine"] == "flite" for r in recs)
    assert 0 < n_flite < len(recs)

    def flite_share(weights) -> float:
        crops = AudioCrops(corpus, recs, 2400, seed=0, engine_weights=weights)
        drawn = [r["engine"] for _ in range(50) for r, _ in crops.sample(8)[1]]
        return drawn.count("flite") / len(drawn)

    even = n_flite / len(recs)
    weighted = 4 * n_flite / (4 * n_flite + len(recs) - n_flite)
    assert abs(flite_share(None) - even) < 0.07
    assert abs(flite_share({"flite": 4}) - weighted) < 0.07
    assert flite_share({"espeak": 0}) == 1.0
    with pytest.raises(ValueError, match="piper"):
        AudioCrops(corpus, recs, 2400, engine_weights={"piper": 2})
    with pytest.raises(SystemExit):  # the command line refuses a weight it cannot use
        codec_train.main(["--corpus", corpus, "--out", "unused", "--engine-weight", "flite=-1"])


def test_codec_discriminator_scores_every_scale():
    from livespeech.models.codec.discriminator import MultiScaleSTFTDiscriminator, discriminator_loss, generator_losses

    disc = MultiScaleSTFTDiscriminator()
    real, fake = torch.randn(2, 1, 6000), torch.randn(2, 1, 6000, requires_grad=True)
    r, f = disc(real), disc(fake)
    assert len(r) == len(disc.config.n_ffts) and all(len(feats) == 5 for _, feats in r)
    g = generator_losses(r, f)
    (g["adv"] + g["feat"]).backward()
    assert fake.grad is not None and fake.grad.abs().sum() > 0  # the generator's gradient reaches the audio
    # hinge: logits past the margin on the right side cost nothing, on the wrong side 1 + |logit| each
    feats = [torch.ones(2, 3)]
    sure, wrong = [(torch.full((2, 1, 4, 4), 2.0), feats)], [(torch.full((2, 1, 4, 4), -2.0), feats)]
    assert float(discriminator_loss(sure, wrong)) == 0.0
    assert float(discriminator_loss(wrong, sure)) == pytest.approx(6.0)
    assert float(generator_losses(wrong, sure)["adv"]) == 0.0  # the generator fooled it


def test_encode_corpus_writes_codes_for_every_utterance(pipeline):
    _, corpus, codec_dir, codes_dir = pipeline
    recs = read_manifest(corpus)
    for r in recs:
        c = np.load(codes_path(codes_dir, r["id"]))
        assert c.dtype == np.int16 and c.shape[0] == 8
        assert abs(c.shape[1] - len(r["graphemes"])) <= 1
        assert c.min() >= 0 and c.max() < 1024
    # resumable: a second run encodes nothing new
    mtimes = {r["id"]: os.path.getmtime(codes_path(codes_dir, r["id"])) for r in recs}
    assert encode_corpus.main(["--corpus", corpus, "--codec", os.path.join(codec_dir, "best.pt"), "--out", codes_dir]) == 0
    assert mtimes == {r["id"]: os.path.getmtime(codes_path(codes_dir, r["id"])) for r in recs}


def test_sharded_encoding_covers_the_corpus_once(pipeline, tmp_path):
    _, corpus, codec_dir, codes_dir = pipeline
    recs = read_manifest(corpus)
    out = str(tmp_path / "codes")
    args = ["--corpus", corpus, "--codec", os.path.join(codec_dir, "best.pt"), "--out", out]
    assert encode_corpus.main(args + ["--shard", "0/2"]) == 0
    first = {r["id"] for r in recs if os.path.exists(codes_path(out, r["id"]))}
    assert 0 < len(first) < len(recs)
    assert encode_corpus.main(args + ["--shard", "1/2"]) == 0
    for r in recs:  # the two shards together: every utterance, the same codes as one process
        np.testing.assert_array_equal(np.load(codes_path(out, r["id"])), np.load(codes_path(codes_dir, r["id"])))
    assert not [f for _, _, fs in os.walk(out) for f in fs if ".tmp" in f]
    with pytest.raises(SystemExit):
        encode_corpus.main(args + ["--shard", "2/2"])


def test_batched_encoding_gives_each_utterance_its_own_codes(pipeline, tmp_path):
    from livespeech.models.loading import load_codec

    _, corpus, codec_dir, codes_dir = pipeline
    recs = read_manifest(corpus)
    assert len({r["duration_s"] for r in recs}) > 1  # the batch pads some of them
    # the padding a batch adds never reaches an utterance's own latents (noise to the end,
    # lengths in partial frames: a last frame padded differently would show)
    codec = load_codec(os.path.join(codec_dir, "best.pt"), 8)
    hop = codec.hop_length
    wavs = [np.random.default_rng(n).standard_normal(n).astype(np.float32) * 0.1 for n in (3 * hop + 17, 700, 5 * hop)]
    with torch.no_grad():
        together = codec.encoder(torch.from_numpy(encode_corpus.padded_batch(wavs, hop)))
        for i, w in enumerate(wavs):
            alone = codec.encoder(torch.from_numpy(encode_corpus.padded_batch([w], hop)))[0]
            assert alone.shape[-1] == -(-len(w) // hop)
            torch.testing.assert_close(together[i, :, :alone.shape[-1]], alone, rtol=1e-4, atol=1e-5)
    out = str(tmp_path / "codes")
    args = ["--corpus", corpus, "--codec", os.path.join(codec_dir, "best.pt"), "--out", out]
    assert encode_corpus.main(args + ["--batch", "4"]) == 0
    for r in recs:  # the codes too, but where rounding flips a nearest-codeword tie
        a, b = np.load(codes_path(out, r["id"])), np.load(codes_path(codes_dir, r["id"]))
        assert a.shape == b.shape
        wav = read_wav_segment(os.path.join(corpus, r["audio"]))
        with torch.no_grad():
            _assert_first_differences_are_ties(codec, wav, a, b)


def _assert_first_differences_are_ties(codec, wav: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """Residual VQ codes a and b [n_q, T] of `wav` may differ only where, at the first
    level that differs in a frame, the residual is as near to one codeword as to the other
    (a flipped near-tie; every later level of that frame follows from it)."""
    residual = codec.encoder(torch.from_numpy(encode_corpus.padded_batch([wav], codec.hop_length)))[0].T
    open_ = torch.ones(a.shape[1], dtype=torch.bool)  # frames that agree on every level so far
    for level, layer in enumerate(codec.quantizer.vq.layers[:a.shape[0]]):
        embed = layer._codebook.embed
        ca, cb = torch.from_numpy(a[level]).long(), torch.from_numpy(b[level]).long()
        first = open_ & (ca != cb)
        if first.any():
            da = (residual[first] - embed[ca[first]]).pow(2).sum(-1)
            db = (residual[first] - embed[cb[first]]).pow(2).sum(-1)
            torch.testing.assert_close(da, db, rtol=1e-3, atol=1e-5)
        open_ &= ~first
        residual = residual - embed[ca]


def test_batched_encoding_refuses_a_codec_that_sees_the_padding():
    from types import SimpleNamespace

    assert encode_corpus.batchable(SimpleNamespace(config=SimpleNamespace(causal=True, pad_mode="constant")))
    assert not encode_corpus.batchable(SimpleNamespace(config=SimpleNamespace(causal=True, pad_mode="reflect")))
    assert not encode_corpus.batchable(SimpleNamespace(config=SimpleNamespace(causal=False, pad_mode="constant")))


def exported_smoke_decoder(run: str, path: str) -> dict:
    """Two smoke steps in `run`, the decoder exported to `path`; the run's last checkpoint."""
    from livespeech.models.loading import save_decoder

    assert train.main(["--smoke", "--out", run, "--steps", "2", "--threads", "1"]) == 0
    st = torch.load(os.path.join(run, "last.pt"), map_location="cpu", weights_only=False)
    src = train.build_model(train.ModelConfig.from_dict(st["config"]), "cpu")
    src.load_state_dict(st["model"])
    save_decoder(src, path)
    return st


def test_decoder_init_from_exported_weights_or_a_run_checkpoint(tmp_path):
    from livespeech.models.loading import load_decoder

    first = str(tmp_path / "a")
    st = exported_smoke_decoder(first, str(tmp_path / "decoder.pt"))
    # one step at a negligible learning rate: the weights stay those given (not the seed's
    # fresh initialisation, which differs from them by the first run's two updates)
    second = str(tmp_path / "b")
    assert train.main(["--smoke", "--out", second, "--steps", "1", "--threads", "1", "--lr", "1e-12",
                       "--init", str(tmp_path / "decoder.pt")]) == 0
    got = torch.load(os.path.join(second, "last.pt"), map_location="cpu", weights_only=False)["model"]
    want = load_decoder(str(tmp_path / "decoder.pt")).state_dict()
    assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)
    # a continued decoder's log opens with its starting point's dev figures (a fresh run's
    # does not): here the one step moved nothing, so its last evaluation says the same
    evals = [r for r in map(json.loads, open(os.path.join(second, "log.jsonl"))) if r.get("eval")]
    assert evals[0]["step"] == 0 and evals[0]["start"] and not evals[-1].get("start")
    assert abs(evals[0]["dev_loss"] - evals[-1]["dev_loss"]) < 1e-4
    assert not any(r.get("start") for r in map(json.loads, open(os.path.join(first, "log.jsonl"))))
    # a run's own checkpoint (optimizer state and all) is a starting point too
    third = str(tmp_path / "c")
    assert train.main(["--smoke", "--out", third, "--steps", "1", "--threads", "1", "--lr", "1e-12",
                       "--init", os.path.join(first, "last.pt")]) == 0
    got = torch.load(os.path.join(third, "last.pt"), map_location="cpu", weights_only=False)["model"]
    assert all(torch.allclose(got[k], st["model"][k], atol=1e-6) for k in st["model"])


def test_training_builds_its_mamba_layers_for_the_training_device(monkeypatch):
    """make_mamba chooses mamba-ssm's kernels from the device it is given: a model built
    without one trains on the pure-PyTorch scan on a GPU too (the third GPU run did)."""
    import livespeech.models.livespeech as livespeech

    seen = []
    real = livespeech.make_mamba

    def recording(*args, **kwargs):
        seen.append(kwargs.get("device"))
        return real(*args, **kwargs)

    monkeypatch.setattr(livespeech, "make_mamba", recording)
    train.build_model(train.preset("tiny"), torch.device("cpu"))
    assert seen and all(d == torch.device("cpu") for d in seen)


def test_time_budget_schedule():
    s = Schedule(1e-3, warmup=10, steps=1, minutes=2.0)
    assert s.lr(0, 0.0) == pytest.approx(1e-4)  # warmup counts steps
    assert s.lr(10, 0.0) == pytest.approx(1e-3)  # decay counts training time
    assert s.lr(10, 60.0) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert s.lr(10_000, 120.0) == pytest.approx(1e-4)
    assert not s.finished(10_000, 119.9) and s.finished(1, 120.0)
    steps = Schedule(1e-3, warmup=10, steps=110)
    assert steps.lr(60) == pytest.approx(1e-3 * 0.55)  # half way through the cosine
    assert not steps.finished(109, 1e9) and steps.finished(110, 0.0)


def test_decoder_data_counts_utterances_still_without_codes(pipeline, tmp_path):
    """What the trainer's rescans go by: none once every usable utterance has its codes."""
    _, corpus, _, codes_dir = pipeline
    from livespeech.models.config import preset

    cfg = preset("tiny", **train.parse_overrides(SMALL))
    full = DecoderData(corpus, codes_dir, cfg, "train")
    assert full.missing == 0 and len(full) > 1
    empty = DecoderData(corpus, str(tmp_path / "none"), cfg, "train")
    assert len(empty) == 0 and empty.missing == len(full) + full.skipped - empty.skipped
    path = codes_path(codes_dir, full.items[0]["rec"]["id"])
    kept = np.load(path)
    os.remove(path)
    try:
        assert DecoderData(corpus, codes_dir, cfg, "train").missing == 1
    finally:
        np.save(path, kept)


def test_batches_made_ahead_are_those_made_in_turn_and_a_failure_reaches_the_loop(pipeline):
    """`BatchPrefetch`: batch s from the sampler and a generator seeded by s, each with the
    sampler's state after it (what a checkpoint saves); a failure on the batches' thread
    (a re-read of the data, here) is raised where the next batch is taken; closing stops a
    thread blocked on a full queue."""
    _, corpus, _, codes_dir = pipeline
    cfg = train.preset("tiny", **train.parse_overrides(SMALL))
    model = train.build_model(cfg, "cpu")
    data = DecoderData(corpus, codes_dir, cfg, "train")
    data.index = {it["rec"]["id"]: i for i, it in enumerate(data.items)}
    inline = train.Sampler(0, 300, 2)
    made = train.BatchPrefetch(None, data, train.Sampler(0, 300, 2), model, seed=5, first_step=0, rescan_every=1)
    try:
        for s in range(3):
            batch, state, n = made.next()
            rng = random.Random(5 * 1_000_039 + s)
            want = collate([data.example(i, rng) for i in inline.next(data)], model)
            for f in want.__dataclass_fields__:
                assert torch.equal(getattr(batch, f), getattr(want, f)), f
            assert state == inline.state() and n == len(data)
    finally:
        made.close()

    def broken():
        raise OSError("the codes directory went away")

    data.missing = 1  # an encoder still filling it: the data is re-read at step 1
    failing = train.BatchPrefetch(broken, data, train.Sampler(0, 300, 2), model, seed=5, first_step=0, rescan_every=1)
    try:
        failing.next()
        with pytest.raises(OSError, match="went away"):
            failing.next()
    finally:
        failing.close()


def test_end_key_jitter_moves_only_the_end_key(pipeline):
    _, corpus, _, codes_dir = pipeline
    from livespeech.models.config import preset

    cfg = preset("tiny", **train.parse_overrides(SMALL))
    exact = DecoderData(corpus, codes_dir, cfg, "train")
    jittered = DecoderData(corpus, codes_dir, cfg, "train", eos_jitter=0.3)
    T = exact.items[0]["T"]
    ends = []
    for seed in range(30):
        a, b = exact.example(0, random.Random(seed)), jittered.example(0, random.Random(seed))
        assert a.text_pos[-1] == T  # the paper's layout by default
        assert a.text_ids == b.text_ids and a.text_pos[:-1] == b.text_pos[:-1]
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_array_equal(a.enroll, b.enroll)  # the same draws before the jitter
        assert b.text_pos[-1] > b.text_pos[-2]  # after the last text token
        ends.append(b.text_pos[-1])
    assert len(set(ends)) > 5 and min(ends) < T < max(ends)
    # centred on T in log scale: the median factor on the last chunk's span is ~1
    rng = random.Random(0)
    draws = sorted(jittered_end(100, 101, 300, 0.3, rng) for _ in range(2001))
    assert abs(draws[1000] - 300) <= 6 and draws[0] >= 101


def test_example_layout_matches_the_server(pipeline):
    _, corpus, _, codes_dir = pipeline
    from livespeech.models.config import preset
    from livespeech.models.livespeech import LiveSpeech2

    cfg = preset("tiny", **train.parse_overrides(SMALL))
    data = DecoderData(corpus, codes_dir, cfg, "train")
    tok = get_tokenizer()
    ex = data.example(0, random.Random(0))
    rec = data.items[0]["rec"]
    t = len(rec["graphemes"])
    assert ex.codes.shape == (9, t + 1)
    assert list(ex.codes[0, :t]) == rec["graphemes"] and ex.codes[0, t] == G.EOS
    assert list(ex.last_frame) == [t] + [t - 1] * 8
    # text: chunk by chunk, first chunk without a leading space, positions from tau; EOS at T
    words = [w[0] for w in rec["words"]]
    want_ids, want_pos = [], []
    for i, (first, n, tau) in enumerate(rec["chunks"]):
        ids = tok.encode_words(words[first:first + n], first_in_text=(i == 0))
        want_ids += ids
        want_pos += list(range(tau, tau + len(ids)))
    assert ex.text_ids == want_ids + [tok.eos_id] and ex.text_pos == want_pos + [t]
    # enrollment: another utterance of the same voice
    assert 1 <= ex.enroll.shape[1] <= 4 * 75 and ex.enroll.shape[0] == 8
    assert text_tokens(rec, tok, 2, tok.eos_id) is None  # too long for a 2-token memory
    b = collate([data.example(i) for i in range(2)], LiveSpeech2(cfg))
    assert b.inputs.shape[1] == 9 and b.text_valid.any(1).all()


def _decoder_args(corpus, codes, out, *extra):
    return ["--corpus", corpus, "--codes", codes, "--out", out, "--model-overrides", SMALL, "--batch-frames", "300",
            "--max-batch", "2", "--warmup", "2", "--eval-every", "100", "--dev-batches", "1", "--log-every", "1",
            "--max-seconds", "30", *extra]


def test_decoder_train_resumes_exactly(pipeline):
    root, corpus, _, codes = pipeline
    straight, split = str(root / "dec_straight"), str(root / "dec_split")
    assert train.main(_decoder_args(corpus, codes, straight, "--steps", "4")) == 0
    assert train.main(_decoder_args(corpus, codes, split, "--steps", "4", "--stop-at", "2")) == 0
    assert torch.load(os.path.join(split, "last.pt"), weights_only=False)["step"] == 2
    assert train.main(_decoder_args(corpus, codes, split, "--steps", "4", "--resume")) == 0
    a = torch.load(os.path.join(straight, "last.pt"), weights_only=False)
    b = torch.load(os.path.join(split, "last.pt"), weights_only=False)
    assert a["step"] == b["step"] == 4
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a["loss_acc"], b["loss_acc"])
    rows = [r for r in _log(os.path.join(split, "log.jsonl")) if not r.get("eval")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    from livespeech.training import plot

    png = plot.plot(split)
    assert os.path.getsize(png) > 1000


def test_decoder_loss_decreases_on_a_repeated_batch(pipeline):
    _, corpus, _, codes = pipeline
    from livespeech.models.livespeech import CodebookLossWeights

    torch.manual_seed(0)
    cfg, model, batch = _tiny_model_and_batch(corpus, codes)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    lw = CodebookLossWeights(cfg.n_codebooks, cfg.cb_loss_lambda)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for step in range(20):
        mask = train.text_mask_for(batch, step % 2 == 1, gen, 1, 2)
        total, per_cb, accs, _ = train.forward_loss(model, batch, mask, lw.weights())
        opt.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lw.update(accs)
        losses.append(float(per_cb.detach().sum()))
    assert losses[-1] < 0.7 * losses[0], losses


def test_smoke_mode_runs(tmp_path):
    assert train.main(["--smoke", "--out", str(tmp_path / "smoke"), "--steps", "3", "--codebook-boost", "1:3",
                       "--text-dropout", "0.3"]) == 0
    assert os.path.exists(tmp_path / "smoke" / "last.pt")


@pytest.mark.parametrize("share", ["0", "1.5"])
def test_a_memory_share_outside_zero_to_one_is_refused(tmp_path, share):
    with pytest.raises(SystemExit, match="--cuda-memory-share"):
        train.main(["--smoke", "--out", str(tmp_path / "smoke"), "--steps", "1", "--cuda-memory-share", share])
    assert not os.path.exists(tmp_path / "smoke")


@pytest.mark.parametrize("share", ["-0.1", "1"])
def test_a_text_dropout_outside_zero_to_one_is_refused(tmp_path, share):
    with pytest.raises(SystemExit, match="--text-dropout"):
        train.main(["--smoke", "--out", str(tmp_path / "smoke"), "--steps", "1", "--text-dropout", share])


@pytest.mark.parametrize("name, index", [("cuda", 0), ("cuda:1", 1)])
def test_a_memory_share_caps_the_named_cuda_device(monkeypatch, name, index):
    # torch's cap wants a device index; a bare "cuda" is the current device
    capped = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda share, device: capped.append((share, device)))
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        assert setup_device(name, torch.get_num_threads(), 0.475) == torch.device(name)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert capped == [(0.475, index)]


def test_codebook_boost_option():
    assert train.parse_boost("1:3") == {1: 3.0}
    assert train.parse_boost("1:3,0:1.5") == {1: 3.0, 0: 1.5}
    for bad in ("1", "a:2", "1:x"):
        with pytest.raises(argparse.ArgumentTypeError):
            train.parse_boost(bad)


def test_codec_phone_classifier_trains_on_the_first_level_and_resumes(tmp_path):
    """--phone-weight: a phone loss (on labelled frames of the first quantiser level) joins
    the total, the codebook-1 probe is logged at each evaluation, and a resumed run keeps
    the classifier."""
    corpus, _ = make_smoke_corpus(str(tmp_path), n_utts=6, with_codes=False)
    out = str(tmp_path / "codec")
    common = ["--corpus", corpus, "--out", out, "--batch", "2", "--crop-s", "0.5", "--eval-every", "2",
              "--dev-n", "2", "--dev-seconds", "0.5", "--kmeans-iters", "1", "--log-every", "1", "--ckpt-every", "1",
              "--phone-weight", "1", "--phone-min-count", "1", "--probe-n", "3"]
    assert codec_train.main(common + ["--steps", "2"]) == 0
    assert codec_train.main(common + ["--steps", "3", "--resume"]) == 0
    rows = _log(os.path.join(out, "log.jsonl"))
    steps = [r for r in rows if not r.get("eval")]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(math.isfinite(r["phone"]) and r["phone"] > 0 and 0 <= r["phone_acc"] <= 1 for r in steps)
    assert all(r["total"] > r["phone"] for r in steps)  # the phone loss is part of the total
    evals = [r for r in rows if r.get("eval")]
    assert evals and all(0 <= r["phone_probe_acc"] <= 1 and r["cb1_codes_used"] >= 1 for r in evals)
    state = torch.load(os.path.join(out, "last_state.pt"), weights_only=False)
    assert state["phones"][0] == "_" and "phone_head" in state
    # a corpus without phone timelines cannot train the classifier: a clear refusal
    with open(os.path.join(corpus, "manifest.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    with open(os.path.join(corpus, "manifest.jsonl"), "w") as f:
        for r in recs:
            r.pop("phones")
            f.write(json.dumps(r) + "\n")
    assert codec_train.main(common + ["--steps", "1", "--out", str(tmp_path / "nophones")]) == 2


def test_streaming_mask_only_in_the_late_phase(tmp_path):
    """--stream-after: the A.5 streaming mask is drawn only once the schedule's progress
    reaches it (smoke: warmup 2, so progress is 0, 0, 0, 0.5 over 4 steps)."""
    out = str(tmp_path / "late")
    assert train.main(["--smoke", "--out", out, "--steps", "4", "--stream-p", "1", "--stream-after", "0.5"]) == 0
    rows = [r for r in _log(os.path.join(out, "log.jsonl")) if not r.get("eval")]
    assert [r["stream"] for r in rows] == [0.0, 0.0, 0.0, 1.0]
    evals = [r for r in _log(os.path.join(out, "log.jsonl")) if r.get("eval")]
    assert evals and all(0 <= r["dev_read_acc"] <= 1 for r in evals)  # reading, measured at each evaluation


def test_reading_is_scored_at_letter_changes_with_the_true_and_another_text(pipeline):
    from livespeech.training.train import _rotate_texts, grapheme_logits, letter_change_hits

    _, corpus, _, codes_dir = pipeline
    torch.manual_seed(0)
    model = train.build_model(train.preset("tiny", d_model=64, n_heads=2, n_shared_layers=1, n_group_layers=1,
                                           enc_d_model=64, enc_heads=2, enc_layers=1, n_enroll=8), "cpu").eval()
    data = DecoderData(corpus, codes_dir, model.cfg, "train")
    b = collate([data.example(i, random.Random(i)) for i in range(3)], model)
    other = _rotate_texts(b)
    assert torch.equal(other.text_ids[1], b.text_ids[0]) and torch.equal(other.inputs, b.inputs)
    with torch.no_grad():
        right, total = letter_change_hits(grapheme_logits(model, b, b), b)
    # one change per letter boundary of each utterance's grapheme row (previous letter != letter)
    expected = sum(int(((b.targets[i, 0] != b.inputs[i, 0]) & b.valid[i, 0]).sum()) for i in range(3))
    assert total == expected > 0 and 0 <= right <= total


def test_new_decoders_read_spellings_and_init_keeps_the_exported_embedding(tmp_path):
    out = str(tmp_path / "spell")
    assert train.main(["--smoke", "--out", out, "--steps", "1"]) == 0
    st = torch.load(os.path.join(out, "last.pt"), weights_only=False)
    assert st["config"]["text_embedding"] == "spelling"
    out2 = str(tmp_path / "table")
    assert train.main(["--smoke", "--out", out2, "--steps", "1", "--text-embedding", "table"]) == 0
    st2 = torch.load(os.path.join(out2, "last.pt"), weights_only=False)
    assert st2["config"]["text_embedding"] == "table"
    assert "text_emb.weight" in st2["model"] and "text_emb.spellings" in st["model"]


def test_phone_letters_follow_the_phones_with_pauses_as_space(pipeline):
    from livespeech.training.dataset import phone_letters

    _, corpus, _, _ = pipeline
    for rec in read_manifest(corpus):
        letters = phone_letters(rec)
        assert len(letters) == len(rec["graphemes"])
        # the same letters in the same order as the manifest's row; pauses between words are spaces
        assert G.ctc_collapse(letters) == G.ctc_collapse(rec["graphemes"])
        for (_, _, end), (_, start, _) in zip(rec["words"], rec["words"][1:]):
            a, b = round(end * 75) + 1, round(start * 75) - 1
            assert all(x == G.SPACE for x in letters[a:b])


def test_bf16_autocast_trains(tmp_path):
    """--autocast bf16 (what auto picks on a CPU with bf16 dot products) runs the forward
    in bfloat16 and still gives finite losses and float32 weights."""
    out = str(tmp_path / "bf16")
    assert train.main(["--smoke", "--out", out, "--steps", "2", "--autocast", "bf16"]) == 0
    rows = [r for r in _log(os.path.join(out, "log.jsonl")) if not r.get("eval")]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    st = torch.load(os.path.join(out, "last.pt"), weights_only=False)
    assert all(v.dtype == torch.float32 for v in st["model"].values() if v.is_floating_point())


def test_an_extra_corpus_trains_from_its_own_codes(tmp_path):
    """--extra-corpus: another corpus's train split (same utterance ids, other codes) joins
    the training data under prefixed ids, each example reading its own corpus's codes;
    dev stays the main corpus's."""
    cfg = train.preset("tiny")
    main_corpus, main_codes = make_smoke_corpus(str(tmp_path / "a"), n_utts=4, seed=0)
    extra_corpus, extra_codes = make_smoke_corpus(str(tmp_path / "b"), n_utts=4, seed=1)
    for r in read_manifest(extra_corpus):  # codes unlike the main corpus's, whatever the lengths
        np.save(codes_path(extra_codes, r["id"]), (np.load(codes_path(extra_codes, r["id"])) + 1) % 1024)
    data = DecoderData(main_corpus, main_codes, cfg, "train")
    n_main = len(data)
    data.merge(DecoderData(extra_corpus, extra_codes, cfg, "train", id_prefix="x0-"))
    assert len(data) == 2 * n_main
    ids = [it["rec"]["id"] for it in data.items]
    assert len(set(ids)) == len(ids) and ids[n_main] == "x0-" + ids[0]
    for i in (0, n_main):
        utt, codes_dir = data.items[i]["codes"][1], data.items[i]["codes"][0]
        want = np.load(codes_path(codes_dir, utt))[:, :data.items[i]["T"]]
        assert np.array_equal(data.example(i, random.Random(0)).codes[1:, :want.shape[1]], want)
    assert not np.array_equal(data.load_codes(0), data.load_codes(n_main))
    out = str(tmp_path / "run")
    assert train.main(["--corpus", main_corpus, "--codes", main_codes, "--extra-corpus", f"{extra_corpus}:{extra_codes}",
                       "--out", out, "--steps", "1", "--model-overrides", "d_model=64,n_heads=2,n_shared_layers=1,"
                       "n_group_layers=1,enc_d_model=64,enc_heads=2,enc_layers=1,n_enroll=8",
                       "--batch-frames", "400", "--max-batch", "4", "--dev-batches", "1"]) == 0
    st = torch.load(os.path.join(out, "last.pt"), weights_only=False)
    assert st["n_train"] == 2 * n_main


def test_the_phone_head_learns_the_phone_of_the_frame_codebook_1_predicts(tmp_path):
    from livespeech.training.dataset import DecoderData, collate
    from livespeech.training.phones import IGNORE

    out = str(tmp_path / "run")
    assert train.main(["--smoke", "--out", out, "--steps", "3", "--threads", "1", "--phone-weight", "1"]) == 0
    rows = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
    assert all("ce_phone" in r for r in rows if not r.get("eval"))
    assert all(0 <= r["dev_phone_acc"] <= 1 for r in rows if r.get("eval"))
    st = torch.load(os.path.join(out, "last.pt"), map_location="cpu", weights_only=False)
    assert st["phone_head"]["proj.weight"].shape[0] == len(st["phone_vocab"]) > 1
    assert not any(k.startswith("proj") for k in st["model"])  # the decoder itself has no such head
    # resumed with its head and vocabulary
    assert train.main(["--smoke", "--out", out, "--steps", "4", "--threads", "1", "--phone-weight", "1",
                       "--resume"]) == 0
    # the targets: each frame's phone, at the step where codebook 1 predicts that frame
    model = train.build_model(train.ModelConfig.from_dict(st["config"]), "cpu")
    vocab = train.phone_vocab_for([], st["phone_vocab"])
    corpus, codes = os.path.join(out, "smoke_data", "corpus"), os.path.join(out, "smoke_data", "codes")
    data = DecoderData(corpus, codes, model.cfg, "train", phone_vocab=vocab)
    ex = [data.example(i) for i in range(2)]
    b = collate(ex, model)
    d1 = model.cfg.delays[1]
    for i, e in enumerate(ex):
        rec = data.items[i]["rec"]
        want = vocab.frame_labels(rec, 0, e.n_frames - 1, 320, 24000)
        assert (want != IGNORE).any()
        assert b.phones[i, d1:d1 + len(want)].tolist() == want.tolist()
        assert (b.phones[i, :d1] == IGNORE).all()
        # codebook 1's target at those steps is the same frame's code
        assert b.targets[i, 1, d1:d1 + len(want)].tolist() == e.codes[1, :len(want)].tolist()


def _resumes_exactly_and_trains_otherwise(root, corpus, codes, *flag) -> None:
    """A run with `flag` stopped at step 2 and resumed ends where a straight one does, and
    elsewhere than the same run without it (the flag is seeded by step, and it matters)."""
    name = flag[0].strip("-")
    straight, split, plain = (str(root / f"{name}_{k}") for k in ("straight", "split", "off"))
    assert train.main(_decoder_args(corpus, codes, straight, "--steps", "4", *flag)) == 0
    assert train.main(_decoder_args(corpus, codes, split, "--steps", "4", "--stop-at", "2", *flag)) == 0
    assert train.main(_decoder_args(corpus, codes, split, "--steps", "4", "--resume", *flag)) == 0
    assert train.main(_decoder_args(corpus, codes, plain, "--steps", "4")) == 0
    a, b, clean = (torch.load(os.path.join(d, "last.pt"), weights_only=False)["model"] for d in (straight, split, plain))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(a[k], clean[k]) for k in a)


def test_history_noise_replaces_only_acoustic_history_at_the_chosen_steps(pipeline):
    """corrupt_history: at about a share p of the steps every acoustic input code becomes a
    random code; graphemes, "none" ids and the targets stay; p 0 changes nothing; and a
    resumed run with --history-noise trains what a straight one does (noise seeded by step)."""
    root, corpus, _, codes = pipeline
    cfg, model, batch = _tiny_model_and_batch(corpus, codes)
    none = torch.tensor(model.none_ids()).view(1, -1, 1)
    assert train.corrupt_history(batch.inputs, 0.0, model.none_ids(), cfg.codebook_size,
                                 torch.Generator().manual_seed(0)) is batch.inputs
    out = train.corrupt_history(batch.inputs, 0.5, model.none_ids(), cfg.codebook_size,
                                torch.Generator().manual_seed(0))
    assert torch.equal(out[:, 0], batch.inputs[:, 0])
    is_none = batch.inputs == none
    assert torch.equal(out[is_none], batch.inputs[is_none])
    changed = (out != batch.inputs)[:, 1:].any(1)  # [B, S] steps whose history was replaced
    real = ~is_none[:, 1:].all(1)
    share = changed[real].float().mean()
    assert 0.3 < share < 0.7, share
    # a replaced step has every real acoustic code random: almost all differ from the truth
    hit_codes = (out != batch.inputs)[:, 1:][changed.unsqueeze(1).expand(-1, cfg.n_acoustic_codebooks, -1)
                                             & ~is_none[:, 1:]]
    assert hit_codes.float().mean() > 0.9

    _resumes_exactly_and_trains_otherwise(root, corpus, codes, "--history-noise", "0.5")


def test_own_history_reads_back_the_models_own_sample_of_the_step_before(pipeline):
    """own_history: at a share p of the steps the acoustic inputs are what the model sampled
    for the step before (a model whose every prediction is certain shows which); graphemes,
    "none" ids and the first step stay; p 0 changes nothing; and a resumed run with
    --own-history trains what a straight one does."""
    root, corpus, _, codes = pipeline
    cfg, model, batch = _tiny_model_and_batch(corpus, codes)
    v = cfg.codebook_size

    def certain(inputs, *_args, **_kwargs):  # codebook j at step t: code (7 t + j) mod V, with certainty
        b, k, s = inputs.shape
        t = torch.arange(s)
        out = [torch.zeros(b, s, model.vocab_sizes[0])]
        for j in range(k - 1):
            lg = torch.full((b, s, v), -1e4)
            lg[:, t, (7 * t + j) % v] = 0.0
            out.append(lg)
        return out

    model.forward = certain
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    assert train.own_history(model, batch, batch.text_valid, 0.0, gen()) is batch.inputs
    out = train.own_history(model, batch, batch.text_valid, 1.0, gen())
    none = torch.tensor(model.none_ids()).view(1, -1, 1)
    is_none = batch.inputs == none
    assert torch.equal(out[:, 0], batch.inputs[:, 0]) and torch.equal(out[is_none], batch.inputs[is_none])
    assert torch.equal(out[:, :, 0], batch.inputs[:, :, 0])
    s = batch.inputs.shape[2]
    want = (7 * (torch.arange(1, s) - 1).view(1, 1, -1) + torch.arange(cfg.n_acoustic_codebooks).view(1, -1, 1)) % v
    real = ~is_none[:, 1:, 1:]
    assert real.sum() > 100
    assert torch.equal(out[:, 1:, 1:][real], want.expand_as(real)[real])
    half = train.own_history(model, batch, batch.text_valid, 0.5, gen())
    changed = (half != batch.inputs)[:, 1:].any(1)
    share = changed[~is_none[:, 1:].all(1)].float().mean()
    assert 0.3 < share < 0.7, share

    _resumes_exactly_and_trains_otherwise(root, corpus, codes, "--own-history", "0.5")


def test_own_history_samples_with_the_top_k_and_temperatures_it_is_given(pipeline):
    """own_history's OwnSampling: top-k 1 reads back the most likely code of the step before;
    top-k 3 only codes among that step's three most likely; temperature 0 for codebook 1
    alone makes codebook 1 greedy and leaves the others sampled; "session" is what a server
    session samples by default."""
    _, corpus, _, codes = pipeline
    cfg, model, batch = _tiny_model_and_batch(corpus, codes)
    b, k, s = batch.inputs.shape
    fixed = [torch.zeros(b, s, model.vocab_sizes[0])] + [torch.randn(b, s, cfg.codebook_size,
                                                                     generator=torch.Generator().manual_seed(j))
                                                         for j in range(k - 1)]
    model.forward = lambda *_args, **_kwargs: fixed
    best = torch.stack([lg.argmax(-1) for lg in fixed[1:]], 1)[:, :, :-1]  # what step t reads back: t - 1's
    top3 = torch.stack([lg.topk(3, -1).indices for lg in fixed[1:]], 1)[:, :, :-1]
    real = batch.inputs[:, 1:, 1:] != torch.tensor(model.none_ids()[1:]).view(1, -1, 1)
    assert real.sum() > 100

    def read_back(sampling):
        return train.own_history(model, batch, batch.text_valid, 1.0, torch.Generator().manual_seed(0), 1,
                                 sampling)[:, 1:, 1:]

    assert torch.equal(read_back(train.OwnSampling(top_k=1))[real], best[real])
    out = read_back(train.OwnSampling(top_k=3))
    assert (out.unsqueeze(-1) == top3).any(-1)[real].all()
    assert not torch.equal(out[real], best[real])
    out = read_back(train.OwnSampling(first_codebook_temperature=0.0))
    assert torch.equal(out[:, 0][real[:, 0]], best[:, 0][real[:, 0]])
    assert (out[:, 1:] != best[:, 1:])[real[:, 1:]].float().mean() > 0.5
    from livespeech.api.session import SessionConfig

    c = SessionConfig()
    assert train.OwnSampling.named("session") == (c.top_k, c.first_codebook_temperature, c.acoustic_temperature)
    assert train.OwnSampling.named("full") == train.OwnSampling()


def test_own_history_passes_compound_the_models_errors_step_by_step(pipeline):
    """own_history with passes: each pass reads back every step's sample of the pass before,
    so a model that adds 1 to the code it reads back shows, after k passes, the truth of k
    steps earlier plus k at every step whose chain of k steps holds real codes."""
    _, corpus, _, codes = pipeline
    cfg, model, batch = _tiny_model_and_batch(corpus, codes)
    v = cfg.codebook_size

    def plus_one(inputs, *_args, **_kwargs):  # codebook j at step t: its read-back code + 1, with certainty
        b, k, s = inputs.shape
        out = [torch.zeros(b, s, model.vocab_sizes[0])]
        for j in range(1, k):
            lg = torch.full((b, s, v), -1e4)
            lg.scatter_(2, ((inputs[:, j] + 1) % v).unsqueeze(-1), 0.0)
            out.append(lg)
        return out

    model.forward = plus_one
    x = batch.inputs[:, 1:]
    real = x != torch.tensor(model.none_ids()[1:]).view(1, -1, 1)
    s = x.shape[2]
    for passes in (1, 3):
        out = train.own_history(model, batch, batch.text_valid, 1.0, torch.Generator().manual_seed(0), passes)[:, 1:]
        # step t >= passes whose steps t - passes .. t all hold real codes: truth at t - passes, plus passes
        chain = torch.stack([real[:, :, passes - i:s - i] for i in range(passes + 1)]).all(0)
        want = (x[:, :, :s - passes] + passes) % v
        assert chain.sum() > 100
        assert torch.equal(out[:, :, passes:][chain], want[chain])
        assert torch.equal(out[~real], x[~real]) and torch.equal(out[:, :, 0], x[:, :, 0])


def test_reading_targets_name_the_spoken_word_the_next_in_pauses_and_the_end_key_after():
    from livespeech.training.dataset import reading_targets, word_token_ranges

    tok = get_tokenizer()
    # 2 chunks; "Hello" 0.1-0.5 s, pause, "wonderful" 0.6-1.0, "world." 1.0-1.4; 1.6 s = 120 frames
    rec = {"words": [["Hello", 0.1, 0.5], ["wonderful", 0.6, 1.0], ["world.", 1.0, 1.4]],
           "chunks": [[0, 2, 0], [2, 1, 75]], "graphemes": [0] * 120}
    ids, _pos = text_tokens(rec, tok, 75, 99)
    ranges = word_token_ranges(rec, tok)
    # each word's own tokens, in the order text_tokens lays them out
    assert ranges[0][0] == 0 and ranges[-1][1] == len(ids) - 1
    assert [tok.decode(ids[a:b]) for a, b in ranges] == ["Hello", " wonderful", " world."]
    r = reading_targets(rec, ranges, 120, len(ids) - 1)
    assert r.shape == (2, 121)
    at = lambda t: tuple(int(x) for x in r[:, t])  # noqa: E731
    assert at(0) == at(20) == ranges[0]  # the silence before the first word reads it
    assert at(40) == ranges[1]  # the pause after "Hello" reads what comes next
    assert at(60) == ranges[1] and at(80) == ranges[2]
    assert at(110) == at(120) == (len(ids) - 1, len(ids))  # after the last word: the end-of-text key


def test_reading_loss_rewards_attention_on_the_spoken_word(pipeline):
    _, corpus, _, codes = pipeline
    torch.manual_seed(0)
    cfg = train.preset("tiny", **train.parse_overrides(SMALL))
    model = train.build_model(cfg, "cpu")
    data = DecoderData(corpus, codes, cfg, "train")
    b = collate([data.example(i, random.Random(i)) for i in range(2)], model)
    assert (b.reading[:, 0] >= 0).any()
    # each layer hands its text attention out; asking for it leaves the logits as they are
    weights: list = []
    enroll = model.encode_enrollment(b.enroll_codes, b.enroll_len)
    with torch.no_grad():
        with_w = model(b.inputs, enroll, b.text_ids, b.text_pos, b.text_valid, weights)
        plain = model(b.inputs, enroll, b.text_ids, b.text_pos, b.text_valid)
    assert len(weights) == model.n_layers
    assert weights[0].shape == (2, cfg.n_heads, b.inputs.shape[2], b.text_ids.shape[1])
    for x, y in zip(with_w, plain):
        torch.testing.assert_close(x, y)
    # attention all on the target scores mass 1 and a low loss; spread over the text, more
    s, ln = b.inputs.shape[2], b.text_ids.shape[1]
    idx = torch.arange(ln)
    on = ((idx >= b.reading[:, 0, :, None]) & (idx < b.reading[:, 1, :, None])).float()
    on = on / on.sum(-1, keepdim=True).clamp(min=1)
    spread = b.text_valid[:, None, :].float().expand(2, s, ln) / b.text_valid.sum(-1)[:, None, None]
    as_heads = lambda w: [w[:, None].expand(2, cfg.n_heads, s, ln)]  # noqa: E731
    loss_on, mass_on = train.reading_loss(as_heads(on), b.reading, b.text_valid, 1)
    loss_spread, mass_spread = train.reading_loss(as_heads(spread), b.reading, b.text_valid, 1)
    assert float(mass_on) == pytest.approx(1.0) and float(mass_spread) < 0.6
    assert float(loss_on) < 1e-3 < float(loss_spread)
    # a step whose target tokens are all masked out is not scored
    hidden = b.text_valid.clone()
    hidden[:] = False
    assert float(train.reading_loss(as_heads(spread), b.reading, hidden, 1)[0]) == 0.0
    # trained on it, the reading head moves its attention onto the spoken word
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    masses = []
    for _ in range(15):
        _, _, _, (loss, mass) = train.forward_loss(model, b, b.text_valid, torch.ones(cfg.n_codebooks), read_heads=1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        masses.append(float(mass))
    assert masses[-1] > 2 * masses[0], masses


def test_the_reading_loss_trains_logs_and_resumes_exactly(pipeline):
    root, corpus, _, codes = pipeline
    straight, split = str(root / "read_straight"), str(root / "read_split")
    extra = ("--steps", "4", "--read-weight", "1", "--read-heads", "2")
    assert train.main(_decoder_args(corpus, codes, straight, *extra)) == 0
    assert train.main(_decoder_args(corpus, codes, split, *extra, "--stop-at", "2")) == 0
    assert train.main(_decoder_args(corpus, codes, split, *extra, "--resume")) == 0
    a = torch.load(os.path.join(straight, "last.pt"), weights_only=False)
    b = torch.load(os.path.join(split, "last.pt"), weights_only=False)
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-5, atol=1e-6)
    rows = _log(os.path.join(straight, "log.jsonl"))
    assert all(0 <= r["read_mass"] <= 1 and r["read_loss"] > 0 for r in rows if not r.get("eval"))
    assert all(0 <= r["dev_read_mass"] <= 1 for r in rows if r.get("eval"))


def test_the_reading_report_compares_own_and_other_text_and_attention_per_head(pipeline, capsys):
    from livespeech.training.eval import reading

    root, corpus, _, codes = pipeline
    out = str(root / "read_report")
    assert train.main(_decoder_args(corpus, codes, out, "--steps", "2")) == 0
    model = train.load_trained_decoder(os.path.join(out, "last.pt"))
    data = DecoderData(corpus, codes, model.cfg, "train", letters="phones")
    b = collate([data.example(i, random.Random(i)) for i in range(3)], model)
    s = reading.reading_stats(model, [b])
    assert s["mass"].shape == (model.n_layers, model.cfg.n_heads)
    assert ((s["mass"] >= 0) & (s["mass"] <= 1)).all()
    for name in ("true", "other"):
        ce, acc = s[name]
        assert ce > 0 and 0 <= acc <= 1
    # another utterance's text changes what the model is given, so its figures differ
    assert s["true"] != s["other"]
    assert reading.main(["--model", os.path.join(out, "last.pt"), "--corpus", corpus, "--codes", codes,
                         "--split", "train", "--batches", "1"]) == 0
    assert "another utterance's" in capsys.readouterr().out


def test_a_phone_input_trains_from_a_decoder_without_one(tmp_path):
    """--phone-input: a decoder continued with the front end's phone of each frame as an
    input (its embedding starting at zero), the examples carrying that phone at the step
    that predicts the frame's codebook 1."""
    from livespeech.models.front_end import FrontEnd, LetterDurationModel, LetterPhoneModel, contexts
    from livespeech.training.dataset import DecoderData, collate, phone_letter_positions

    torch.manual_seed(0)
    fe = FrontEnd(LetterPhoneModel(4, 2), LetterDurationModel(2), torch.arange(1024) % 4,
                  ("_", "smoke:a", "smoke:b", "other:a"), ("other", "smoke"), 1.0)
    torch.save(fe.to_dict(), tmp_path / "front_end.pt")
    first = str(tmp_path / "a")
    exported_smoke_decoder(first, str(tmp_path / "decoder.pt"))
    second = str(tmp_path / "b")
    assert train.main(["--smoke", "--out", second, "--steps", "2", "--threads", "1", "--lr", "1e-2",
                       "--init", str(tmp_path / "decoder.pt"), "--phone-input", str(tmp_path / "front_end.pt")]) == 0
    got = torch.load(os.path.join(second, "last.pt"), map_location="cpu", weights_only=False)
    assert got["config"]["n_phones"] == 4
    assert got["model"]["phone_emb.weight"].abs().sum() > 0  # learnt from zero
    start = [r for r in map(json.loads, open(os.path.join(second, "log.jsonl"))) if r.get("start")][0]
    first_evals = [r for r in map(json.loads, open(os.path.join(first, "log.jsonl"))) if r.get("eval")]
    assert abs(start["dev_loss"] - first_evals[-1]["dev_loss"]) < 1e-4  # the zero embedding changed nothing
    # the phone input: the front end's phone of each frame, at the step predicting its codebook 1
    model = train.build_model(train.ModelConfig.from_dict(got["config"]), "cpu")
    corpus, codes = os.path.join(second, "smoke_data", "corpus"), os.path.join(second, "smoke_data", "codes")
    data = DecoderData(corpus, codes, model.cfg, "train", letters="phones", front_end=fe)
    ex = [data.example(i) for i in range(2)]
    b = collate(ex, model)
    d1 = model.cfg.delays[1]
    for i, e in enumerate(ex):
        letters, positions = phone_letter_positions(data.items[i]["rec"])
        ctx, off = contexts(letters, positions)
        want = fe.phones(torch.from_numpy(ctx), torch.from_numpy(off), torch.ones(len(positions), dtype=torch.long))
        want = torch.where(torch.tensor(positions) >= 0, want.argmax(1), -1)
        assert torch.equal(b.phone_input[i, d1:d1 + len(positions)], want) and (want >= 0).any()
        assert (b.phone_input[i, :d1] == -1).all() and e.phone_input[-1] == -1  # the EOS column: none
    with pytest.raises(ValueError, match="letters 'phones'"):
        DecoderData(corpus, codes, model.cfg, "train", letters="even", front_end=fe)
