"""livespeech.training.letter_phones: a front end trained on the smoke corpus loads with
the model directory, matches the codec's phone table, and drives diagnose's timed modes."""
import os

import numpy as np
import torch

from livespeech.models import graphemes as G
from livespeech.models.front_end import WINDOW, FrontEnd, contexts, load_front_end
from livespeech.training import letter_phones as LP


def test_contexts_window_the_letters_and_count_frames_into_each():
    letters = G.text_to_ids("ab c")
    ctx, off = contexts(letters, [0, 0, 1, -1, 3, 3, 3])
    assert ctx.shape == (7, 2 * WINDOW + 1)
    assert list(ctx[2, WINDOW - 1:WINDOW + 2]) == letters[:3]
    assert ctx[0, WINDOW - 1] == G.VOCAB_SIZE and (ctx[3] == G.VOCAB_SIZE).all()  # PAD outside the letters
    assert list(off) == [0, 1, 0, 0, 0, 1, 2]


def test_trained_on_the_smoke_corpus_it_drives_the_timed_modes(tmp_path):
    from livespeech.models.loading import load_bundle
    from livespeech.server.runner import ModelRunner
    from livespeech.training.dataset import phone_letter_positions, read_manifest
    from livespeech.training.eval import diagnose
    from livespeech.training.eval.evaluate import SR, read_audio, select_utterances
    from livespeech.training.dataset import codes_path
    from livespeech.training.phones import PhoneTable, first_codebook
    from livespeech.training.smoke import make_smoke_corpus

    torch.set_num_threads(1)
    corpus, _ = make_smoke_corpus(str(tmp_path), n_utts=6, with_codes=False)
    bundle = load_bundle(random_init=True)
    bundle.codec.save(tmp_path / "codec.pt")
    assert LP.main(["--corpus", corpus, "--codec", str(tmp_path / "codec.pt"), "--out",
                    str(tmp_path / "front_end.pt"), "--epochs", "1", "--batch", "32", "--phone-min-count", "1"]) == 0
    front_end = load_front_end(tmp_path)
    rows = read_manifest(corpus)
    table = PhoneTable.fit(bundle.codec, corpus, rows, min_count=1)
    assert front_end.phone_names == table.vocab.names
    assert torch.equal(front_end.code_phones, table.code_phones(bundle.model.cfg.codebook_size))
    assert torch.equal(front_end.phone_given_code, table.phone_given_code(bundle.model.cfg.codebook_size))
    # the same table from the corpus encoded beforehand (encode_corpus's layout)
    train = [r for r in rows if r["split"] == "train" and r.get("phones")]
    for r, codes in zip(train, first_codebook(bundle.codec, corpus, train)):
        path = codes_path(str(tmp_path / "codes"), r["id"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.save(path, codes[None])
    assert table.pairs and PhoneTable.fit(bundle.codec, corpus, rows, n=0, min_count=1,
                                          codes_dir=str(tmp_path / "codes")).pairs == table.pairs
    # the context table added to that front end from those codes: the rest of it unchanged
    assert front_end.contexts is not None  # the default strength fits it with the rest
    assert LP.main(["--corpus", corpus, "--codec", str(tmp_path / "codec.pt"), "--codes", str(tmp_path / "codes"),
                    "--out", str(tmp_path / "ctx.pt"), "--phone-min-count", "1",
                    "--add-contexts", str(tmp_path / "front_end.pt")]) == 0
    with_ctx = FrontEnd.load(tmp_path / "ctx.pt")
    assert torch.equal(with_ctx.first_code_bias()[:len(table.vocab)], front_end.first_code_bias()[:len(table.vocab)])
    assert with_ctx.contexts["keys"].tolist() == [list(c) for c in sorted({ctx for ctx, _ in table.context_pairs})]
    # the phone classifier fitted again on a corpus of phone timelines alone: the rest kept
    assert LP.main(["--corpus", corpus, "--out", str(tmp_path / "refit.pt"), "--epochs", "1", "--batch", "32",
                    "--refit-phones", str(tmp_path / "ctx.pt")]) == 0
    refit = FrontEnd.load(tmp_path / "refit.pt")
    assert refit.phone_names == with_ctx.phone_names and torch.equal(refit.first_code_bias(), with_ctx.first_code_bias())
    assert all(torch.equal(a, b) for a, b in zip(refit.durations.state_dict().values(),
                                                 with_ctx.durations.state_dict().values()))
    assert not all(torch.equal(a, b) for a, b in zip(refit.phones.state_dict().values(),
                                                     with_ctx.phones.state_dict().values()))
    assert front_end.duration_scale > 0
    utt = select_utterances(rows, tmp_path / "corpus", 1, split="dev")[0]
    p = diagnose.prepare(bundle, rows, [utt], str(tmp_path / "codes"))[0]
    rec = next(r for r in rows if r["id"] == utt.id)
    schedule = diagnose.letter_schedule(front_end, rec, engine=0)
    assert schedule.n_frames >= len(phone_letter_positions(rec)[0])  # a frame a letter at least
    runner = ModelRunner(bundle, capacity=1)
    voice = runner.make_voice("v", read_audio(utt.enroll_audio), SR)
    size = bundle.model.cfg.codebook_size
    rule = diagnose.cb1_rule("timed+letter-phone", table, rec, p, size, front_end, schedule)
    s = diagnose.synthesize(runner, voice, p, "timed+letter-phone", seed=1, cb1_rule=rule,
                            row_forced=schedule.graphemes)
    assert s.frames[:, 0].tolist() == schedule.graphemes  # the row, then EOS
    held = 0
    for f, code in enumerate(s.frames[:, 1]):  # a frame whose phone has codes takes one of them
        allowed = rule(f, [], torch.zeros(1, size))
        if allowed is not None and allowed.any():
            held += 1
            assert allowed[code]
    assert held
