"""Phone timelines from synthesiser events, frame labels, and the codebook-1 probe's counts."""
from collections import Counter

import numpy as np
import pytest
import torch

from livespeech.models.codec import CodecModel, preset
from livespeech.training.corpus.align import espeak_phones, phone_timeline
from livespeech.training.corpus.espeak import Event
from livespeech.training.phones import IGNORE, PhoneVocab, _conditional_entropy, _table_accuracy, probe_codec
from livespeech.training.smoke import make_smoke_corpus
from livespeech.training.dataset import read_manifest


def test_phone_timeline_fills_gaps_with_pauses_and_cuts_overlaps():
    phones = [("h", 10, 20), ("e", 18, 30), ("x", 30, 30), ("l", 40, 50)]
    assert phone_timeline(phones, 60) == [("_", 0, 10), ("h", 10, 20), ("e", 20, 30), ("_", 30, 40),
                                          ("l", 40, 50), ("_", 50, 60)]
    assert phone_timeline([], 5) == [("_", 0, 5)]


def test_espeak_phones_last_until_the_next_event_without_pauses_or_stress():
    events = [Event("word", 0, 2, 100), Event("phoneme", 0, 0, 100, "h"), Event("phoneme", 0, 0, 150, "'a"),
              Event("phoneme", 0, 0, 220, "_:"), Event("word", 3, 2, 260), Event("phoneme", 3, 0, 260, ",I"),
              Event("end", 5, 0, 300)]
    assert espeak_phones(events, 400) == [("h", 100, 150), ("a", 150, 220), ("I", 260, 300)]


def test_frame_labels_take_the_phone_at_each_frame_centre():
    rec = {"engine": "espeak", "phones": [["_", 0.0, 0.1], ["a", 0.1, 0.2], ["zz", 0.2, 0.3]]}
    vocab = PhoneVocab(("_", "espeak:a"))  # "zz" is rare: unlabelled
    # 100 samples a frame at 1 kHz: centres 0.05, 0.15, 0.25, 0.35 s
    labels = vocab.frame_labels(rec, 0, 4, hop=100, sample_rate=1000)
    assert labels.tolist() == [0, 1, IGNORE, IGNORE]
    # a crop starting at 0.1 s
    assert vocab.frame_labels(rec, 100, 2, 100, 1000).tolist() == [1, IGNORE]
    assert (vocab.frame_labels({"engine": "espeak"}, 0, 3, 100, 1000) == IGNORE).all()


def test_vocab_keeps_common_phones_per_synthesiser():
    recs = [{"engine": "espeak", "phones": [["_", 0, 1], ["a", 1, 2]] * 3},
            {"engine": "flite", "phones": [["a", 0, 1], ["b", 1, 2]]}]
    assert PhoneVocab.from_records(recs, min_count=1).names == ("_", "espeak:a", "flite:a", "flite:b")
    assert PhoneVocab.from_records(recs, min_count=2).names == ("_", "espeak:a")


def test_probe_counts():
    # code 7 always with label 1, code 8 split between labels 1 and 2
    pairs = Counter({(1, 7): 4, (1, 8): 2, (2, 8): 2})
    h = _conditional_entropy(pairs)  # H(code | label): label 1 -> {7: 4, 8: 2}; label 2 -> {8}
    expected = 6 / 8 * -(4 / 6 * np.log(4 / 6) + 2 / 6 * np.log(2 / 6))
    assert h == pytest.approx(expected)
    assert _table_accuracy(pairs, Counter({(1, 7): 1, (2, 7): 1, (1, 9): 1})) == pytest.approx(2 / 3)


def test_probe_codec_runs_on_a_corpus(tmp_path):
    corpus, _ = make_smoke_corpus(str(tmp_path), n_utts=4, with_codes=False)
    records = read_manifest(corpus)
    torch.manual_seed(0)
    codec = CodecModel(preset("small", kmeans_init=False)).eval()
    out = probe_codec(codec, corpus, records, PhoneVocab.from_records(records, 1), n=10)
    assert out["n_fit"] == 3 and out["n_score"] == 1
    assert 0 <= out["cb1_repeat"] <= 1 and out["cb1_codes_used"] >= 1
    assert 0 <= out["cb1_given_phone"] <= out["cb1_entropy"] + 1e-9


def test_a_phone_table_fitted_on_a_given_inventory_names_its_frames_with_it(tmp_path):
    """A table fitted with another corpus's (a front end's) phones indexes them as that
    inventory does, whatever phones this corpus has."""
    from livespeech.training.phones import PhoneTable

    corpus, _ = make_smoke_corpus(str(tmp_path), n_utts=4, with_codes=False)
    records = read_manifest(corpus)
    own = PhoneVocab.from_records(records, 1)
    wider = PhoneVocab((own.names[0], "espeak:zz-not-here", *own.names[1:]))
    torch.manual_seed(0)
    codec = CodecModel(preset("small", kmeans_init=False)).eval()
    table = PhoneTable.fit(codec, corpus, records, n=0, vocab=wider)
    assert table.vocab == wider and table.pairs
    assert {p for p, _ in table.pairs} <= set(range(len(wider))) - {1}  # no frame is the absent phone
    assert {own.names[p] for p, _ in PhoneTable.fit(codec, corpus, records, n=0, min_count=1).pairs} == \
        {wider.names[p] for p, _ in table.pairs}


def test_phone_table_counts_frames_whose_code_names_the_timeline_phone():
    from livespeech.training.phones import PhoneTable

    vocab = PhoneVocab(("_", "espeak:a", "espeak:b"))
    rec = {"engine": "espeak", "phones": [["_", 0.0, 0.04], ["a", 0.04, 0.08], ["b", 0.08, 0.12]]}
    # 75 Hz frames at 24 kHz: 3 frames per phone; code 7 stands for "a", 9 for "b", others for the pause
    table = PhoneTable(vocab, {7: 1, 9: 2}, 0, 320, 24000)
    codes = np.array([1, 1, 7, 7, 7, 7, 9, 9, 9])  # frame 2 says "a" during the pause: a miss
    hit, n = table.hits(rec, codes)
    assert n == 9 and hit == 2 + 3 + 3


def test_phone_given_code_is_each_codes_share_of_frames_per_phone():
    from collections import Counter

    from livespeech.training.phones import PhoneTable

    vocab = PhoneVocab(("_", "espeak:a", "espeak:b"))
    table = PhoneTable(vocab, {7: 1}, 0, 320, 24000, Counter({(1, 7): 3, (2, 7): 1, (0, 5): 2}))
    logp = table.phone_given_code(10, smoothing=0.0)
    assert logp.shape == (3, 10)
    assert torch.allclose(logp[:, 7].exp(), torch.tensor([0.0, 0.75, 0.25]))
    assert torch.allclose(logp[:, 5].exp(), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.isinf(logp[:, 3]).all()  # a code never seen sounds no phone
    smoothed = table.phone_given_code(10, smoothing=0.1)
    assert torch.isfinite(smoothed[:, 7]).all() and torch.allclose(smoothed[:, 7].exp().sum(), torch.tensor(1.0))


def test_a_context_refines_its_phones_code_distribution_by_its_own_counts():
    """log p(code | context) - log p(code | phone), up to a constant: codes a context
    sounds more often than its phone does gain; a rare context stays near its phone."""
    from collections import Counter

    from livespeech.training.phones import PhoneTable

    vocab = PhoneVocab(("_", "espeak:a", "espeak:b"))
    ctx_b, ctx_rare = (1, 0, 2), (1, 1, 0)
    table = PhoneTable(vocab, {7: 1}, 0, 320, 24000, Counter({(1, 7): 60, (1, 8): 40}),
                       Counter({(ctx_b, 7): 50, (ctx_rare, 8): 1}))
    out = table.contexts(10, strength=10.0, smoothing=0.0)
    assert out["keys"].tolist() == [list(ctx_b), list(ctx_rare)]
    row = {ctx_b: 0, ctx_rare: 1}
    got = {(int(r), int(c)): float(v) for (r, c), v in zip(out["pairs"].tolist(), out["values"])}
    # p(7 | a) = 0.6: 50 frames against 10 x 0.6 of prior
    assert abs(got[(row[ctx_b], 7)] - np.log1p(50 / 6)) < 1e-5
    assert abs(got[(row[ctx_rare], 8)] - np.log1p(1 / 4)) < 1e-5
    assert len(got) == 2  # codes a context never sounds: its row's constant, 0
