"""livespeech.training.eval.evaluate: error rates, normalisation, report tables, corpus selection and a
tiny end-to-end run (random model, metric backends skipped) on a synthetic corpus."""
import argparse
import json
import math
import sys
import time

import numpy as np
import pytest

from livespeech.api.session import SessionConfig
from livespeech.training.eval import evaluate
from livespeech.training.eval import report
from livespeech.training.eval.backends import MOSPredictor, SpeakerEncoder, WhisperASR, cosine
from livespeech.training.eval.text import (Normalizer, corpus_rates, edit_distance, error_counts, get_normalizer,
                                load_whisper_normalizer, simple_normalize)


# --- error rates ---------------------------------------------------------------------------------
def test_edit_distance_known_cases():
    assert edit_distance([], []) == 0
    assert edit_distance("abc".split(), []) == 0 + 1  # one word "abc"
    assert edit_distance(list("kitten"), list("sitting")) == 3
    assert edit_distance("the cat sat".split(), "the cat sat".split()) == 0
    assert edit_distance("the cat sat".split(), "the bat sat down".split()) == 2  # 1 sub + 1 ins
    assert edit_distance("a b c d".split(), "a d".split()) == 2  # 2 deletions
    assert edit_distance([], "x y".split()) == 2


def test_error_counts_with_simple_normaliser():
    c = error_counts("Hello, World! It's me.", "hello world its me", simple_normalize)
    assert (c.word_errors, c.ref_words) == (0, 4)
    c = error_counts("The quick brown fox.", "the quick brown box jumps", simple_normalize)
    assert (c.word_errors, c.ref_words) == (2, 4)
    assert c.wer == pytest.approx(0.5)
    assert c.char_errors == edit_distance("the quick brown fox", "the quick brown box jumps")
    assert c.ref_chars == len("the quick brown fox")
    empty = error_counts("", "something", simple_normalize)
    assert empty.ref_words == 0 and empty.word_errors == 1


def test_corpus_rates_pool_errors_over_reference_words():
    a = error_counts("one two three four", "one two three four", simple_normalize)  # 0/4
    b = error_counts("five six", "five seven eight", simple_normalize)  # 2/2
    wer, cer = corpus_rates([a, b])
    assert wer == pytest.approx(2 / 6)  # not the mean of per-utterance rates (0.5)
    assert 0 < cer < 1


def test_simple_normaliser():
    assert simple_normalize("  Café—ROCKS!  It’s  fine.. ") == "cafe rocks its fine"


def test_punctuation_only_tokens_are_not_words():
    n = Normalizer("test", lambda s: s.lower())
    assert n("Peabody here .") == "peabody here"


def test_whisper_normaliser_when_installed():
    try:
        norm = load_whisper_normalizer()
    except ImportError as exc:
        assert "not installed" in str(exc)
        assert get_normalizer().name.startswith("simple")
        pytest.skip(f"Whisper normaliser unavailable: {exc}")
    n = Normalizer("whisper", norm)
    assert n("Mr. Smith has twenty-one colours, doesn't he?") == "mister smith has 21 colors does not he"
    assert n("Hello again, Peabody here...") == "hello again peabody here"
    assert error_counts("It's twenty five past ten.", "it is 25 past 10", n).word_errors == 0
    assert "whisper" not in sys.modules  # loaded from its files, not through whisper/__init__


# --- backends ------------------------------------------------------------------------------------
def test_missing_packages_give_na_reasons(monkeypatch):
    monkeypatch.setitem(sys.modules, "faster_whisper", None)
    monkeypatch.setitem(sys.modules, "resemblyzer", None)
    monkeypatch.setitem(sys.modules, "webrtcvad", None)
    monkeypatch.setitem(sys.modules, "xls_r_sqa", None)
    monkeypatch.setitem(sys.modules, "xls_r_sqa.config", None)
    asr, sim, mos = WhisperASR("tiny.en"), SpeakerEncoder(), MOSPredictor()
    assert not asr.available() and asr.reason == "n/a (package faster-whisper not installed)"
    assert not sim.available() and sim.reason == "n/a (package webrtcvad-wheels not installed)"
    assert not mos.available() and mos.reason == "n/a (package xls-r-sqa not installed)"
    skipped = WhisperASR("tiny.en", enabled=False)
    assert not skipped.available() and skipped.reason == "n/a (skipped)"


def test_cosine():
    assert cosine(np.array([1.0, 0.0]), np.array([2.0, 0.0])) == pytest.approx(1.0)
    assert cosine(np.array([1.0, 0.0]), np.array([0.0, 3.0])) == pytest.approx(0.0)
    assert cosine(None, np.array([1.0])) is None


# --- tables --------------------------------------------------------------------------------------
def _rec(system, heldout, we, rw, sim, mos, **kw):
    return dict(system=system, heldout_voice=heldout, word_errors=we, ref_words=rw, char_errors=we, ref_chars=5 * rw,
                sim=sim, mos=mos, audio_s=2.0, ref_duration_s=2.0, **kw)


def test_aggregate_and_table_rendering():
    gt = [_rec(report.GT, False, 1, 10, 0.9, 3.0),
          _rec(report.GT, True, 0, 10, 0.8, 2.0, id_correct=True, id_rank=1, id_margin=0.1)]
    model = [
        _rec(report.MODEL, False, 2, 10, 0.7, 2.5, compute_s=1.0, ttfa_s=0.2),
        _rec(report.MODEL, True, 4, 10, 0.5, 2.5, compute_s=0.5, ttfa_s=0.4, id_correct=False, id_rank=7, id_margin=-0.05),
        dict(system=report.MODEL, heldout_voice=True, error="timeout"),
    ]
    rows = [report.aggregate(report.GT, gt), report.aggregate("online (λ=1)", model)]
    assert rows[0].wer == pytest.approx(0.05) and rows[0].sim_train == pytest.approx(0.9)
    assert rows[0].id_acc == 1.0 and rows[0].mos == pytest.approx(2.5)
    m = rows[1]
    assert m.wer == pytest.approx(0.3) and m.n == 2 and m.n_failed == 1
    assert m.rtf == pytest.approx(1.5 / 4.0) and m.ttfa_ms == pytest.approx(300.0) and m.id_acc == 0.0
    md = report.table2(rows, {"mos": "n/a (package distillmos not installed)"})
    lines = md.splitlines()
    assert lines[0].startswith("| System | WER % | CER % | SIM train voices | SIM held-out voices")
    gt_line = next(line for line in lines if line.startswith("| ground truth"))
    assert "| 5.0 |" in gt_line and "0.900 (1)" in gt_line and "0.800 (1)" in gt_line and "| 100.0 / 100.0 / – |" in gt_line
    assert "n/a (package distillmos not installed)" in gt_line
    model_line = next(line for line in lines if line.startswith("| online"))
    assert "| 30.0 |" in model_line and "| 0.375 |" in model_line and "| 300 |" in model_line
    assert "2 (+1 failed)" in model_line
    ab = report.table3([("online", "1", m), ("online", "0", rows[0])], {})
    assert ab.splitlines()[0].startswith("| Mode | guidance λ | WER %")
    assert len(ab.splitlines()) == 4


# --- synthetic corpus ----------------------------------------------------------------------------
def _write_corpus(root):
    from livespeech.models.loading import write_wav

    rng = np.random.default_rng(0)
    rows = []

    def add(uid, split, voice, heldout, text, seconds):
        t = np.arange(int(24000 * seconds)) / 24000
        audio = (0.3 * np.sin(2 * np.pi * (120 + 40 * len(rows)) * t) + 0.02 * rng.standard_normal(t.size))
        rel = f"wav/{uid}.wav"
        (root / "wav").mkdir(parents=True, exist_ok=True)
        write_wav(root / rel, audio.astype(np.float32), 24000)
        words = text.split()
        step = seconds / (len(words) + 1)
        rows.append(dict(
            id=uid, split=split, voice=voice, heldout_voice=heldout, text=text,
            words=[[w, round(step * (i + 0.5), 3), round(step * (i + 1.5), 3)] for i, w in enumerate(words)],
            audio=rel, duration_s=seconds,
            chunks=[[0, 2, 0], [2, len(words) - 2, int(75 * step * 2.5)]],
        ))

    add("u1", "test", "voice-a", False, "Hello there, good friend.", 1.0)
    add("u2", "train", "voice-a", False, "Another sentence for enrollment.", 1.2)
    add("u3", "test", "voice-b", True, "The quick brown fox.", 0.9)
    add("u4", "dev", "voice-b", True, "Some other held out words.", 1.1)
    add("u5", "dev", "voice-c", True, "A third voice speaks.", 1.0)
    with open(root / "manifest.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return rows


def test_selection_balances_voices_and_never_enrolls_with_the_target(tmp_path):
    rows = _write_corpus(tmp_path)
    utts = evaluate.select_utterances(rows, tmp_path, limit=None)
    assert [u.id for u in utts] == ["u1", "u3"]
    assert [u.heldout for u in utts] == [False, True]
    assert utts[0].enroll_id == "u2"  # training voice: a training utterance
    assert utts[1].enroll_id == "u4"  # held-out voice: its own other dev/test utterance
    refs = evaluate.heldout_references(rows, tmp_path)
    assert set(refs) == {"voice-b", "voice-c"}
    assert evaluate.select_utterances(rows, tmp_path, limit=1)[0].id == "u1"


def test_end_to_end_random_model_without_backends(tmp_path, monkeypatch):
    _write_corpus(tmp_path / "corpus")
    out = tmp_path / "docs" / "eval.md"
    made = []

    class Recording(SessionConfig):  # the sessions get the --sampling given, the defaults otherwise
        def __init__(self, **kw):
            made.append((kw.get("top_k"), kw.get("first_codebook_temperature")))
            super().__init__(**kw)
    monkeypatch.setattr(evaluate, "SessionConfig", Recording)
    rc = evaluate.main([
        "--corpus", str(tmp_path / "corpus"), "--model", "random:tiny", "--out", str(out), "--limit", "2",
        "--modes", "online", "--lambdas", "1", "--skip", "all", "--threads", "1", "--max-overrun-s", "0.5",
        "--sampling", "top_k=3,first_codebook_temperature=0.5", "--codec-latent", "--quiet",
    ])
    assert rc == 0
    assert made[:2] == [(3, 0.5), (3, 0.5)]
    md = out.read_text()
    assert "python -m livespeech.training.eval --corpus" in md and "random:tiny" in md
    assert "sampling: top_k 3, grapheme_top_k 3, grapheme_temperature 1, first_codebook_temperature 0.5" in md
    assert "load average" in md
    for label in ("| ground truth |", "| codec resynthesis |", "| codec, unquantised latent |", "| online (λ=1) |"):
        assert label in md
    assert "## Semantic guidance ablation" in md
    assert "n/a (skipped)" in md
    data = json.loads(out.with_suffix(".json").read_text())
    recs = data["utterances"]
    assert {(r["system"], r["mode"]) for r in recs} == {
        ("ground truth", None), ("codec resynthesis", None), ("codec, unquantised latent", None), ("model", "online")}
    latent = [r for r in recs if r["system"] == "codec, unquantised latent"]
    codec = [r for r in recs if r["system"] == "codec resynthesis"]
    assert [r["audio_s"] for r in latent] == [r["audio_s"] for r in codec]
    model = [r for r in recs if r["system"] == "model"]
    assert len(model) == 2 and not any(r.get("error") for r in model)
    assert all(r["audio_s"] > 0 and r["compute_s"] > 0 and r["ttfa_s"] is not None for r in model)
    assert data["meta"]["n_heldout"] == 1


def test_one_voice_enrolls_every_clip(tmp_path):
    rows = _write_corpus(tmp_path / "corpus")
    ref = tmp_path / "corpus" / [r for r in rows if r["id"] == "u2"][0]["audio"]
    out = tmp_path / "eval.md"
    rc = evaluate.main([
        "--corpus", str(tmp_path / "corpus"), "--model", "random:tiny", "--out", str(out), "--limit", "2",
        "--modes", "1word", "--lambdas", "1", "--skip", "all", "--threads", "1", "--max-overrun-s", "0.5",
        "--no-codec", "--voice", str(ref), "--quiet",
    ])
    assert rc == 0
    data = json.loads(out.with_suffix(".json").read_text())
    model = [r for r in data["utterances"] if r["system"] == "model"]
    assert len(model) == 2 and {r["enrollment"] for r in model} == {f"voice:{ref}"}
    assert {r["voice"] for r in model} == {"voice-a", "voice-b"}  # the texts' own voices, for the GT rows
    assert data["meta"]["voice"] == str(ref) and data["meta"]["n_heldout_refs"] == 0
    assert f"Enrollment: `{ref}` for every clip." in out.read_text()
    assert evaluate.main(["--corpus", str(tmp_path / "corpus"), "--model", "none", "--out", str(out),
                          "--voice", str(tmp_path / "missing.wav"), "--quiet"]) == 2
    # a training voice of the corpus: its training utterance; a held-out voice has none
    assert evaluate.voice_reference("voice-a", rows, tmp_path / "corpus") == ("u2", tmp_path / "corpus" / "wav/u2.wav")
    assert evaluate.voice_reference("voice-b", rows, tmp_path / "corpus") is None


def test_sampling_settings_are_validated_where_sessions_validate_them():
    assert evaluate.parse_sampling("acoustic_temperature=0,grapheme_top_k=5") == {
        "acoustic_temperature": 0.0, "grapheme_top_k": 5}
    for bad in ("top_k=0", "top_p=0.9", "top_k=x", "first_codebook_temperature", "grapheme_temperature=-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            evaluate.parse_sampling(bad)


class _Fake:
    """A backend stand-in that is always available."""

    def __init__(self, **methods):
        self.reason = None
        self.description = "fake"
        self.__dict__.update(methods)

    def available(self):
        return True


def test_scorer_wer_similarity_and_heldout_identification(tmp_path):
    rows = _write_corpus(tmp_path)
    (tmp_path / "voices.json").write_text(json.dumps({"voices": [
        {"id": "voice-a", "variant": "alex"}, {"id": "voice-b", "variant": "annie"},
        {"id": "voice-c", "variant": "Annie"}, {"id": "voice-d", "engine": "flite", "variant": "annie"}]}))
    assert evaluate.voice_variants(tmp_path)["voice-d"] == "flite-annie"  # another synthesiser's voice
    utt = evaluate.select_utterances(rows, tmp_path, limit=None)[1]  # u3, held-out voice-b, enrolled with u4
    # embeddings keyed by clip length: the clip is closer to voice-c's reference than to its own enrollment
    embs = {24000: np.array([1.0, 0.0]),  # voice-c reference (u5, 1.0 s)
            int(24000 * 1.1): np.array([0.6, 0.8])}  # own enrollment (u4)
    backends = {
        "asr": _Fake(transcribe=lambda audio, sr: "the quick brown box"),
        "sim": _Fake(embed=lambda audio, sr: embs.get(len(audio), np.array([0.9, 0.1]))),
        "mos": _Fake(score=lambda audio, sr: 3.5),
    }
    scorer = evaluate.Scorer(backends, Normalizer("simple", simple_normalize),
                             evaluate.heldout_references(rows, tmp_path), evaluate.voice_variants(tmp_path))
    out = scorer.score(np.zeros(12000, np.float32) + 0.1, utt)
    assert (out["word_errors"], out["ref_words"]) == (1, 4)
    assert out["sim"] == pytest.approx(cosine(np.array([0.9, 0.1]), np.array([0.6, 0.8])))
    assert out["id_best_other"] == "voice-c" and out["id_rank"] == 2 and not out["id_correct"]
    assert "id_variant_correct" not in out  # voice-c is the same variant (annie): no other variant to beat
    assert out["mos"] == 3.5


def test_compare_pairs_clips_and_bootstraps_the_difference(tmp_path, capsys) -> None:
    from livespeech.training.eval import compare

    def run(path, word_errors):
        utts = [{"utt": f"u{i}", "system": "model", "mode": "online", "lambda": 1.0, "word_errors": e,
                 "ref_words": 10, "char_errors": 2 * e, "ref_chars": 40} for i, e in enumerate(word_errors)]
        utts.append({"utt": "u0", "system": "ground truth", "mode": None, "lambda": None, "word_errors": 0,
                     "ref_words": 10, "char_errors": 0, "ref_chars": 40})
        path.write_text(json.dumps({"utterances": utts}))
        return path

    a = run(tmp_path / "a.json", [5, 6, 7, 8] * 10)
    b = run(tmp_path / "b.json", [3, 6, 4, 8] * 10)
    r = compare.paired(compare.rows(a, "model", "online", 1.0), compare.rows(b, "model", "online", 1.0),
                       "word_errors", "ref_words")
    assert r["n"] == 40 and math.isclose(r["a"], 0.65) and math.isclose(r["diff"], -0.125)
    assert r["ci"][1] < 0 and (r["better"], r["worse"]) == (20, 0)
    same = compare.paired(compare.rows(a, "model", None, None), compare.rows(a, "model", None, None),
                          "char_errors", "ref_chars")
    assert same["diff"] == 0 and same["ci"] == (0.0, 0.0)
    assert compare.main([str(a), str(b), "--mode", "online", "--lambda", "1"]) == 0
    assert "B - A -12.5" in capsys.readouterr().out
    # one setting against another on the same clips: B's rows at lambda 0 of one run
    both = json.loads(a.read_text())
    both["utterances"] += [{**u, "lambda": 0.0, "word_errors": u["word_errors"] + 1}
                           for u in both["utterances"] if u["system"] == "model"]
    (tmp_path / "both.json").write_text(json.dumps(both))
    both_path = str(tmp_path / "both.json")
    assert compare.main([both_path, both_path, "--mode", "online", "--lambda", "1", "--lambda-b", "0"]) == 0
    out = capsys.readouterr().out
    assert "online lambda 1 of" in out and "online lambda 0 of" in out and "B - A +10.0" in out
    # runs pooled (one a seed): pairs in order, a clip's counts summed over its pairs
    a2 = run(tmp_path / "a2.json", [5, 6, 7, 8] * 10)
    b2 = run(tmp_path / "b2.json", [5, 6, 7, 8] * 10)  # no difference in the second pair
    ra, rb = compare.pooled([compare.rows(x, "model", "online", 1.0) for x in (a, a2)],
                            [compare.rows(x, "model", "online", 1.0) for x in (b, b2)])
    assert len(ra) == 40 and ra["u0"]["word_errors"] == 10 and rb["u0"]["word_errors"] == 8
    r2 = compare.paired(ra, rb, "word_errors", "ref_words")
    assert r2["n"] == 40 and math.isclose(r2["diff"], -0.0625) and r2["ci"][1] < 0
    assert compare.main([f"{a},{a2}", f"{b},{b2}", "--mode", "online", "--lambda", "1"]) == 0
    out = capsys.readouterr().out
    assert "WER % on 40 clips x 2 runs a side" in out and "B - A -6.2" in out
    with pytest.raises(SystemExit):
        compare.main([f"{a},{a2}", str(b), "--mode", "online", "--lambda", "1"])
    with pytest.raises(SystemExit):  # a usage error, not a traceback
        compare.main([str(a), str(tmp_path / "missing.json"), "--mode", "online", "--lambda", "1"])


def test_compare_sets_one_system_against_another_in_one_synthesisers_voices(tmp_path, capsys) -> None:
    from livespeech.training.eval import compare

    utts = []
    for i in range(40):
        voice = "flite-kal" if i % 4 == 0 else "espeak-en-m1"
        truth = 2 if voice.startswith("flite") else 4
        codec = 3 * truth if voice.startswith("flite") else truth + 1
        for system, e in (("ground truth", truth), ("codec resynthesis", codec)):
            utts.append({"utt": f"u{i}", "voice": voice, "system": system, "mode": None, "lambda": None,
                         "word_errors": e, "ref_words": 10, "char_errors": e, "ref_chars": 40})
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"utterances": utts}))
    r = compare.paired(compare.rows(path, "ground truth", None, None, "flite-"),
                       compare.rows(path, "codec resynthesis", None, None, "flite-"), "word_errors", "ref_words")
    assert r["n"] == 10 and math.isclose(r["ratio"], 3.0) and r["ratio_ci"] == (3.0, 3.0)
    args = [str(path), str(path), "--system", "ground truth", "--system-b", "codec resynthesis"]
    assert compare.main(args) == 0
    out = capsys.readouterr().out  # (10 x 6 + 30 x 5) / (10 x 2 + 30 x 4) = 210 / 140
    assert "B = codec resynthesis of" in out and "WER % on 40 clips" in out and "B / A 1.50x" in out
    assert compare.main(args + ["--voices", "espeak-"]) == 0
    out = capsys.readouterr().out
    assert "(voices espeak-*)" in out and "WER % on 30 clips" in out and "B / A 1.25x" in out


def test_compare_against_the_words_said_scores_a_transcript_against_the_spoken_form(tmp_path, capsys) -> None:
    from livespeech.training.eval import compare
    from livespeech.training.eval.text import Normalizer, simple_normalize

    normalize = Normalizer("simple", simple_normalize)
    row = {"utt": "u0", "system": "model", "mode": "paragraph", "lambda": 1.0, "text": "Visit example.com today.",
           "hyp": "Visit example dot com today.", "word_errors": 2, "ref_words": 3, "char_errors": 4, "ref_chars": 25}
    said = compare.said_counts(row, normalize)
    assert (said["word_errors"], said["ref_words"]) == (0, 5) and said["char_errors"] == 0
    heard_as_written = compare.said_counts({**row, "hyp": "Visit example com today."}, normalize)
    assert (heard_as_written["word_errors"], heard_as_written["ref_words"]) == (1, 5)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"utterances": [{**row, "hyp": "Visit example com today."}]}))
    b.write_text(json.dumps({"utterances": [row]}))
    assert compare.main([str(a), str(b), "--mode", "paragraph", "--against-said"]) == 0
    out = capsys.readouterr().out
    assert "(against the words said)" in out and "A 20.0, B 0.0" in out


def test_real_time_pacing_pushes_each_piece_at_its_time():
    from livespeech.api.session import Finished

    class Handle:
        def __init__(self, sink):
            self.sink, self.pushed = sink, []

        def push_text(self, text, client_time_s=None, flush=False):
            self.pushed.append((text, time.perf_counter()))

        def end_input(self):
            self.sink(Finished(summary=None))

    class FakeEngine:
        def open_session(self, cfg, voice, sink):
            self.handle = Handle(sink)
            return self.handle

    eng = FakeEngine()
    pieces = [("a ", None, True), ("b ", None, True), ("c ", None, True)]
    start = time.perf_counter()
    events, _ = evaluate.run_session(eng, None, None, pieces, 10, push_at_s=[0.0, 0.2, 0.3])
    (_, t0), (_, t1), (_, t2) = eng.handle.pushed
    assert events and t0 - start < 0.2 <= t1 - start and t2 - start >= 0.3
    evaluate.run_session(eng, None, None, pieces, 10)  # burst: all at once
    assert [p for p, _ in eng.handle.pushed] == ["a ", "b ", "c "]


def test_the_server_mode_pushes_words_and_lets_the_sessions_chunker_cut_them():
    from pathlib import Path

    from livespeech.api.session import ChunkingConfig, Finished

    class Handle:
        def __init__(self, sink):
            self.sink, self.pushed = sink, []

        def push_text(self, text, client_time_s=None, flush=False):
            self.pushed.append((text, flush))

        def end_input(self):
            self.sink(Finished(summary=None))

    class FakeEngine:
        def open_session(self, cfg, voice, sink):
            self.cfg, self.handle = cfg, Handle(sink)
            return self.handle

    utt = evaluate.Utterance("u", "v", False, "One two three, four five.", ["One", "two", "three,", "four", "five."],
                             [0.0, 0.3, 0.6, 1.0, 1.3], [(0, 3, 0), (3, 2, 75)], Path("u.wav"), 1.6)
    eng = FakeEngine()
    for chunking, expected in (({}, ChunkingConfig()),
                               ({"min_words": 2, "max_words": 4}, ChunkingConfig(min_words=2, max_words=4))):
        evaluate.synthesize(eng, None, utt, evaluate.MODES["server"], 1.0, 0, "burst", 10, chunking=chunking)
        assert eng.cfg.chunking == expected
        assert eng.handle.pushed == [(w + " ", False) for w in utt.words]  # no flush: the chunker cuts
    evaluate.synthesize(eng, None, utt, evaluate.MODES["online"], 1.0, 0, "burst", 10)
    assert eng.handle.pushed == [("One two three, ", True), ("four five. ", True)]  # the manifest's chunks
    assert eng.cfg.chunking.max_words == 16
    assert evaluate.parse_chunking("min_words=2,max_words=4,release_when_waiting=false") == {
        "min_words": 2, "max_words": 4, "release_when_waiting": False}
    for bad in ("min_words=3,max_words=2", "words=2", "min_words=x", "release_when_waiting=maybe"):
        with pytest.raises(argparse.ArgumentTypeError):
            evaluate.parse_chunking(bad)


def test_paragraphs_speak_a_text_files_lines_with_and_without_the_spoken_form(tmp_path):
    """`eval.paragraphs --text-file` speaks each line in a session of its own; with
    `--no-spoken-form` the engine reads every word as written (the A/B of docs/eval.md,
    "Numbers and symbols"): the written words are timed either way, and said in words the
    number's audio is longer."""
    from livespeech.training.eval import paragraphs

    lines = tmp_path / "lines.txt"
    lines.write_text("It costs $1,234,567.89 today.\n\nOk.\n")
    rows = {}
    for flag in ([], ["--no-spoken-form"]):
        out = tmp_path / f"p{len(flag)}.json"
        assert paragraphs.main(["--text-file", str(lines), "--skip-asr", "--out", str(out), *flag]) == 0
        run = json.loads(out.read_text())
        assert run["meta"]["spoken_form"] is not bool(flag) and run["meta"]["paragraphs"] == 2
        rows[bool(flag)] = run["utterances"]
    assert [r["text"] for r in rows[False]] == ["It costs $1,234,567.89 today.", "Ok."]
    assert all(r["unspoken_words"] == [] for r in rows[False] + rows[True])
    # "one million two hundred thirty four thousand ... eighty nine cents" takes longer than "$1,234,567.89" read as written
    assert rows[False][0]["audio_s"] > rows[True][0]["audio_s"]


def test_paragraphs_speak_consecutive_test_sentences_in_one_session_each_and_compare_pairs_them(tmp_path, capsys):
    """`eval.paragraphs` on the shipped default (Whisper skipped): the test sentences joined
    a paragraph a session, all the text pushed at once, every word spoken; its rows pair in
    `compare` like the evaluation's."""
    from livespeech.training.eval import compare, paragraphs

    _write_corpus(tmp_path / "corpus")
    assert paragraphs.paragraphs(tmp_path / "corpus", 5, 2) == ["Hello there, good friend. The quick brown fox."]
    with pytest.raises(ValueError):
        paragraphs.paragraphs(tmp_path / "corpus", 1, 3)
    out = tmp_path / "p.json"
    assert paragraphs.main(["--corpus", str(tmp_path / "corpus"), "--model", "models/weights/default",
                            "--paragraphs", "1", "--sentences", "2", "--skip-asr", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["utterances"]
    assert row["mode"] == "paragraph" and row["text"] == "Hello there, good friend. The quick brown fox."
    assert 1.0 < row["audio_s"] < 10.0 and row["unspoken_words"] == []
    # compare pairs rows by paragraph (word counts added as a run with Whisper would have them)
    for r, errors in ((row, 3), (dict(row), 5)):
        r.update(word_errors=errors, ref_words=9, char_errors=errors, ref_chars=40)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"utterances": [row]}))
    b.write_text(json.dumps({"utterances": [dict(row, word_errors=5, char_errors=5)]}))
    assert compare.main([str(a), str(b), "--mode", "paragraph", "--lambda", "1"]) == 0
    assert "WER % on 1 clips: A 33.3, B 55.6" in capsys.readouterr().out
