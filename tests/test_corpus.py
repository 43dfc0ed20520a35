"""Tests of the synthetic training corpus (training/corpus).

Pure functions (sentence cleaning and parsing, splits, chunk simulation, planning, word
event regrouping on recorded eSpeak event lists) run everywhere. The end-to-end tests need
eSpeak NG (Debian: libespeak-ng1) and skip with the reason when it is missing.
"""
from __future__ import annotations

import json
import math
import os
import random
import sys
import wave

import numpy as np
import pytest

from livespeech.models.graphemes import VOCAB_SIZE, normalize_text
from livespeech.training.corpus import espeak, flite, piper
from livespeech.training.corpus.align import (AlignError, best_split, phoneme_distance, proportional_split,
                                   spans_from_phonemes, tokenize, word_spans)
from livespeech.training.corpus.build import CorpusConfig, build, read_jsonl
from livespeech.training.corpus.espeak import Event
from livespeech.training.corpus.plan import (n_frames_for, plan, sentence_split, simulate_chunks,
                                  source_weights, spans_to_frames)
from livespeech.training.corpus.sentences import (Sentence, clean_sentence, dedupe, parse_chatterbot_yaml,
                                       parse_fortunes, parse_html_paragraphs, parse_rst,
                                       parse_wordnet_data, split_sentences)
from livespeech.training.corpus.synth import read_wav
from livespeech.training.corpus.voices import Voice, choose_heldout_variants

HAVE_ESPEAK = espeak.available()
needs_espeak = pytest.mark.skipif(
    not HAVE_ESPEAK, reason="eSpeak NG not installed (apt-get install espeak-ng libespeak-ng1)")
needs_flite = pytest.mark.skipif(not flite.available(), reason="Flite not installed (apt-get install flite)")
needs_piper = pytest.mark.skipif(not piper.available(), reason="Piper not installed (pip install -e '.[piper]')")


# ----------------------------------------------------------------------------- sentences
@pytest.mark.parametrize("text", [
    "The horse threw its inexperienced rider.",
    "I don't think it's worth washing hogs over.",
    "\u201cHe will need laws,\u201d said the Demon slyly.",
    "Pay $5 now, it is 50% off the price.",
    "It's a well-known fact -- trust me.",
    "The U.S.A. is big, isn't it?",
])
def test_clean_sentence_accepts(text):
    out = clean_sentence(text)
    assert out is not None
    assert out.isascii() and "--" not in out


@pytest.mark.parametrize("text", [
    "Too short.",  # < 4 words
    " ".join(["word"] * 36) + ".",  # > 35 words
    "Use sendfile() to send the file now.",  # code
    "In Calc, the range would be $Sheet1.$B$3:$B$14 here.",
    "Set the value of my_variable to something else.",
    "THIS IS A HEADING WITH NO LOWER CASE.",
    "no capital letter and no final punctuation",
    "Visit http://example.com for more details.",
    "Caf\u00e9 \u65e5\u672c is a nice place to be.",  # non-Latin script
    "Nothing at ''WARNING'' level or above is logged.",  # reST literal
    "8: Wearing a blindfold makes diet foods palatable.",  # list numbering
])
def test_clean_sentence_rejects(text):
    assert clean_sentence(text) is None


def test_clean_fragment_gets_capital_and_period():
    assert clean_sentence("the horse threw its rider", fragment_ok=True) == "The horse threw its rider."
    assert clean_sentence("how are you doing today?", fragment_ok=True) == "How are you doing today?"


def test_split_sentences_keeps_abbreviations():
    parts = split_sentences("Mr. Smith went to Washington. He met Dr. Jones there! Was it fun? Yes.")
    assert parts == ["Mr. Smith went to Washington.", "He met Dr. Jones there!", "Was it fun?", "Yes."]


def test_parsers():
    fortune = ("A black cat crossing your path signifies that the animal is going somewhere.\n"
               "\t\t-- Groucho Marx\n%\nQ: Why did the chicken cross the road?\n"
               "A: To get to the other side.\n%\n")
    got = list(parse_fortunes(fortune))
    assert "Groucho" not in " ".join(got)
    assert "A black cat crossing your path signifies that the animal is going somewhere." in got
    assert "Why did the chicken cross the road?" in got
    wn = ('00002724 29 v 01 choke 0 002 @ 00001740 v 0000 | breathe with great difficulty; '
          '"She choked with emotion when she spoke"; "he choked"  \n')
    assert list(parse_wordnet_data(wn)) == ["She choked with emotion when she spoke", "he choked"]
    yml = "categories:\n- greetings\nconversations:\n- - Good morning, how are you?\n  - I am doing well.\n"
    assert list(parse_chatterbot_yaml(yml))[-2:] == ["Good morning, how are you?", "I am doing well."]
    rst = ("Title\n=====\n\nThe interpreter acts as a simple calculator.  It uses :class:`float`\n"
           "for numbers.  For example::\n\n   >>> 2 + 2\n   4\n\n.. note::\n\n   Hidden note text here.\n")
    got = list(parse_rst(rst))
    assert got == ["The interpreter acts as a simple calculator.", "It uses float for numbers.", "For example:"]
    page = "<p>Choose <code>Tools</code> now.</p><p>To resize the window, drag a corner.</p><pre>x</pre>"
    assert list(parse_html_paragraphs(page)) == ["To resize the window, drag a corner."]


def test_dedupe_is_deterministic_and_normalised():
    a = [Sentence("Hello there, how are you?", "fortunes"), Sentence("hello there how are you", "wordnet"),
         Sentence("Another one bites the dust.", "dialogue")]
    out1 = dedupe(a)
    out2 = dedupe(list(reversed(a)))
    assert len(out1) == 2 and [s.key for s in out1] == [s.key for s in out2]
    assert out1[0].source == "dialogue"  # sorted by source order


# ----------------------------------------------------------------------------- splits, plan
def test_sentence_split_by_normalised_text():
    assert sentence_split("Hello, World!", 0, 0.1, 0.1) == sentence_split("hello world", 0, 0.1, 0.1)
    splits = [sentence_split(f"sentence number {i} here", 3, 0.05, 0.1) for i in range(20000)]
    assert 0.08 < splits.count("test") / len(splits) < 0.12
    assert 0.035 < splits.count("dev") / len(splits) < 0.065


def _voices(n_train=6, n_held=2):
    out = [Voice(f"v{i}", "espeak", "en-US", f"m{i}", 175, 50, 50, False) for i in range(n_train)]
    out += [Voice(f"h{i}", "espeak", "en-US", f"f{i}", 175, 50, 50, True) for i in range(n_held)]
    return out


def test_plan_is_deterministic_and_respects_splits():
    pool = [Sentence(f"Sentence number {i} is here.", src) for i, src in
            enumerate(["fortunes"] * 60 + ["python-doc"] * 40)]
    splits = [sentence_split(s.text, 1, 0.2, 0.2) for s in pool]
    voices = _voices()

    def take(n):
        it = plan(pool, splits, voices, seed=1)
        return [next(it) for _ in range(n)]

    a, b = take(400), take(400)
    assert a == b
    assert [j.id for j in a] == sorted({j.id for j in a})
    for j in a:
        assert j.split == splits[j.sentence]
        assert j.text == pool[j.sentence].text
        if j.split == "train":
            assert not j.heldout_voice and j.voice.startswith("v")
    evals = [j for j in a if j.split != "train"]
    assert any(j.heldout_voice for j in evals) and any(not j.heldout_voice for j in evals)
    # conversational source weighted up: fortunes 0.36 vs python-doc 0.09
    n_fortunes = sum(j.source == "fortunes" for j in a)
    assert n_fortunes > 0.65 * len(a)
    w = source_weights(pool, None)
    assert abs(sum(w.values()) - 1) < 1e-9


def test_plan_draws_synthesisers_by_share_and_keeps_the_sentence_sequence():
    """Flite voices beside eSpeak ones: each utterance's synthesiser is drawn by weight,
    held-out voices stay per synthesiser, and the sentences (and splits) come in the same
    order as in an eSpeak-only plan: adding a synthesiser does not reshuffle the text."""
    pool = [Sentence(f"Sentence number {i} is here.", "fortunes") for i in range(100)]
    splits = [sentence_split(s.text, 1, 0.2, 0.2) for s in pool]
    fl = [Voice(f"fl{i}", "flite", "en", name, 100, 0, 0, name == "rms") for i, name in
          enumerate(["awb", "slt", "rms"])]
    only = plan(pool, splits, _voices(), seed=1)
    mixed = plan(pool, splits, _voices() + fl, seed=1, engine_weights={"espeak": 0.7, "flite": 0.3})
    a, b = [next(only) for _ in range(2000)], [next(mixed) for _ in range(2000)]
    assert [j.sentence for j in a] == [j.sentence for j in b]
    engine = {v.id: v.engine for v in _voices() + fl}
    share = sum(engine[j.voice] == "flite" for j in b) / len(b)
    assert 0.26 < share < 0.34
    assert {j.voice for j in b if engine[j.voice] == "flite" and j.split == "train"} == {"fl0", "fl1"}
    assert any(j.voice == "fl2" and j.split != "train" for j in b)
    with pytest.raises(ValueError, match="no training voices"):
        next(plan(pool, splits, [], seed=1))


def test_corpus_config_checks_synthesisers():
    with pytest.raises(ValueError, match="unknown synthesisers"):
        CorpusConfig(engines={"festival": 1.0})
    with pytest.raises(ValueError, match="positive share"):
        CorpusConfig(engines={"flite": 0.0})


def test_spans_from_phonemes_aligns_a_sentence_to_words_said_alone():
    # "the apple": said alone "dh ax", in the sentence "dh iy" (before a vowel); an extra
    # "hh" the sentence has and no word has goes to the word before it
    speech = [("dh", 0, 10), ("iy", 10, 20), ("ae", 20, 30), ("p", 30, 40), ("hh", 40, 45),
              ("ax", 45, 50), ("l", 50, 60)]
    words = [("dh", "ax"), ("ae", "p", "ax", "l")]
    assert spans_from_phonemes(speech, words) == [(0, 20), (20, 60)]
    speech = [("w", 0, 5), ("ah", 5, 10), ("n", 10, 15), ("t", 15, 20), ("uw", 20, 30)]
    assert spans_from_phonemes(speech, [("w", "ah", "n"), ("t", "uw")]) == [(0, 15), (15, 30)]
    with pytest.raises(AlignError):  # three words, two phonemes: one word gets none
        spans_from_phonemes([("ay", 0, 10), ("s", 10, 20)], [("ay",), ("s",), ("z", "iy")])


def test_flite_failures_reject_the_utterance_and_a_missing_flite_stops(monkeypatch):
    monkeypatch.setenv("LIVESPEECH_FLITE", "/bin/false")  # runs, exits 1
    with pytest.raises(AlignError, match="flite failed"):
        flite.speak("slt", 1.0, "Hello there.", tokenize("Hello there."))
    monkeypatch.setattr(flite, "binary", lambda: None)
    with pytest.raises(RuntimeError, match="flite not found"):
        flite.speak("slt", 1.0, "Hello there.", tokenize("Hello there."))


def test_piper_phones_merge_marks_and_split_word_gaps():
    # "^ h ˈ æ ː z _ b , _ d $": the stress mark starts the vowel, the length mark extends
    # it, a word gap goes half to each word; punctuation and start/end are pauses (a gap
    # after a comma gives its first half to no word)
    symbols = [("^", 2), ("h", 3), ("\u02c8", 2), ("\u00e6", 4), ("\u02d0", 1), ("z", 2), (" ", 5),
               ("b", 1), (",", 4), (" ", 2), ("d", 2), ("$", 3)]
    assert piper.phones(symbols) == [("h", 2, 5), ("\u00e6", 5, 12), ("z", 12, 16), ("b", 16, 20),
                                     ("d", 25, 28)]


def test_a_missing_piper_stops_with_a_clear_error(monkeypatch):
    piper.voice.cache_clear()
    monkeypatch.setitem(sys.modules, "piper", None)  # import piper -> ImportError
    try:
        assert not piper.available()
        with pytest.raises(RuntimeError, match="Piper not installed"):
            piper.speak(1.0, "Hello there.", tokenize("Hello there."))
    finally:
        piper.voice.cache_clear()


def test_heldout_variants_fixed_share():
    variants = [f"v{i}" for i in range(100)]
    h = choose_heldout_variants(variants, 0.1, seed=0)
    assert len(h) == 10 and h == choose_heldout_variants(list(reversed(variants)), 0.1, seed=0)
    assert choose_heldout_variants(["a"], 0.5, 0) == set()


# ----------------------------------------------------------------------------- chunks, frames
def test_simulate_chunks():
    rng = random.Random(0)
    for n in range(1, 40):
        starts = sorted(rng.randint(0, 500) for _ in range(n))
        chunks = simulate_chunks(starts, random.Random(n))
        assert chunks[0][0] == 0 and chunks[0][2] == 0
        pos = 0
        for k, (first, size, tau) in enumerate(chunks):
            assert first == pos
            assert 1 <= size <= 4
            if k < len(chunks) - 1:
                assert size >= 2
            if k > 0:
                assert tau == starts[first]
                assert tau >= chunks[k - 1][2]
            pos += size
        assert pos == n


def test_spans_to_frames_monotone_nonempty():
    spans = [(0.1, 0.105), (0.105, 0.3), (0.31, 0.311), (0.5, 0.9)]
    n = n_frames_for(1.0)
    fr = spans_to_frames(spans, n)
    assert n == 75
    prev = 0
    for a, b in fr:
        assert prev <= a < b <= n
        prev = b
    assert n_frames_for(1.00001) == 76 and n_frames_for(2.0) == 150


# ----------------------------------------------------------------------------- word events
# recorded from eSpeak NG 1.51 (en-US) for this sentence: "I" is put on the dash, "of the"
# and "have been" are joined, "1,234" gives five events, "it's" has length 2.
REC_TEXT = "Wait - I don't think 1,234 of the people have been there, it's 5pm."
REC_N = 124351
REC_EVENTS = [
    ['sentence', 0, 0, 0, ''], ['word', 0, 4, 0, ''], ['phoneme', 0, 0, 0, 'w'], ['phoneme', 0, 0, 2048, 'eI'],
    ['phoneme', 0, 0, 5086, 't'], ['phoneme', 0, 0, 6084, '_:'], ['phoneme', 0, 0, 7296, '_:'],
    ['word', 5, 1, 8508, ''], ['phoneme', 5, 0, 8508, 'aI'], ['word', 9, 3, 10684, ''],
    ['phoneme', 9, 0, 10684, 'd'], ['phoneme', 9, 0, 11964, 'oU'], ['phoneme', 9, 0, 14524, 'n'],
    ['phoneme', 9, 0, 17260, 't'], ['word', 15, 5, 18258, ''], ['phoneme', 15, 0, 18522, 'T'],
    ['phoneme', 15, 0, 20331, 'I'], ['phoneme', 15, 0, 22379, 'N'], ['phoneme', 15, 0, 25253, 'k'],
    ['word', 21, 2, 26247, ''], ['phoneme', 21, 0, 26247, 'w'], ['phoneme', 21, 0, 28359, 'V'],
    ['phoneme', 21, 0, 29895, 'n'], ['word', 22, 2, 31663, ''], ['phoneme', 22, 0, 31927, 'T'],
    ['phoneme', 22, 0, 33736, 'aU'], ['phoneme', 22, 0, 36936, 'z'], ['phoneme', 22, 0, 38088, '@'],
    ['phoneme', 22, 0, 39240, 'n'], ['phoneme', 22, 0, 40840, 'd'], ['phoneme', 22, 0, 41638, '_!'],
    ['word', 23, 3, 42189, ''], ['phoneme', 23, 0, 43269, 't'], ['phoneme', 23, 0, 44151, 'u:'],
    ['phoneme', 23, 0, 46390, 'h'], ['phoneme', 23, 0, 47754, 'V'], ['phoneme', 23, 0, 49802, 'n'],
    ['phoneme', 23, 0, 51982, 'd'], ['phoneme', 23, 0, 52366, 'r'], ['phoneme', 23, 0, 53582, 'I2'],
    ['phoneme', 23, 0, 54286, 'd'], ['word', 24, 3, 56195, ''], ['phoneme', 24, 0, 56459, 'T'],
    ['phoneme', 24, 0, 58268, '3:'], ['phoneme', 24, 0, 60892, 't#'], ['phoneme', 24, 0, 61788, 'i'],
    ['word', 24, 3, 63006, ''], ['phoneme', 24, 0, 63270, 'f'], ['phoneme', 24, 0, 64939, 'o@'],
    ['phoneme', 24, 0, 68331, 'r'], ['word', 27, 2, 68651, ''], ['phoneme', 27, 0, 69483, 'V'],
    ['phoneme', 27, 0, 70379, 'v'], ['phoneme', 27, 0, 71723, 'D'], ['phoneme', 27, 0, 72747, '@2'],
    ['word', 34, 6, 73754, ''], ['phoneme', 34, 0, 74834, 'p'], ['phoneme', 34, 0, 75554, 'i:'],
    ['phoneme', 34, 0, 78673, 'p'], ['phoneme', 34, 0, 79393, '@L'], ['word', 41, 4, 81551, ''],
    ['phoneme', 41, 0, 81815, 'h'], ['phoneme', 41, 0, 82935, 'a#'], ['phoneme', 41, 0, 84279, 'v'],
    ['phoneme', 41, 0, 86494, 'b'], ['phoneme', 41, 0, 87006, 'I'], ['phoneme', 41, 0, 88350, 'n'],
    ['word', 51, 5, 89816, ''], ['phoneme', 51, 0, 90080, 'D'], ['phoneme', 51, 0, 92000, 'e@'],
    ['phoneme', 57, 0, 98529, '_:'], ['phoneme', 57, 0, 101836, '_'], ['end', 57, 0, 101836, ''],
    ['word', 58, 2, 101836, ''], ['phoneme', 58, 0, 101836, 'I'], ['phoneme', 58, 0, 104284, 't'],
    ['phoneme', 58, 0, 105282, 's'], ['word', 63, 1, 106885, ''], ['phoneme', 63, 0, 107149, 'f'],
    ['phoneme', 63, 0, 108818, 'aI'], ['phoneme', 63, 0, 112274, 'v'], ['word', 64, 2, 113807, ''],
    ['phoneme', 64, 0, 114666, 'p'], ['phoneme', 64, 0, 115386, 'i:'], ['phoneme', 64, 0, 116666, ';'],
    ['phoneme', 64, 0, 118010, 'E'], ['phoneme', 64, 0, 121402, 'm'], ['phoneme', 67, 0, 124197, '_:'],
    ['phoneme', 67, 0, 124351, '_'], ['end', 66, 0, 124351, ''],
]
REC_ALONE = {
    'Wait': ['w', 'eI', 't'], 'I': ['aI'], "don't": ['d', 'oU', 'n', 't'], 'think': ['T', 'I', 'N', 'k'],
    'of': ['V', 'v'], 'the': ['D', '@2'], 'people': ['p', 'i:', 'p', '@L'], 'have': ['h', 'a', 'v'],
    'been': ['b', 'I', 'n'], 'there': ['D', 'e@'], "it's": ['I', 't', 's'],
    '5pm': ['f', 'aI', 'v', 'p', 'i:', ';', 'E', 'm'],
}


def _rec_spans(**kw):
    events = [Event.from_list(e) for e in REC_EVENTS]
    return word_spans(REC_TEXT, events, REC_N, **kw)


def test_regroup_recorded_events():
    toks = tokenize(REC_TEXT)
    assert [t.text for t in toks] == ["Wait", "I", "don't", "think", "1,234", "of", "the", "people",
                                      "have", "been", "there,", "it's", "5pm."]
    spans = dict(zip([t.text for t in toks], _rec_spans(phonemes_alone=lambda w: REC_ALONE[w])))
    assert spans["Wait"] == (0, 6084)  # ends at the pause phoneme, not at the next word
    assert spans["I"] == (8508, 10684)  # the event sat on the dash
    assert spans["1,234"] == (26247, 68651)  # five events grouped back onto the number
    # joined "of the": split where "the" (D @2) starts; "have been" where "b" starts
    assert spans["of"] == (68651, 71723) and spans["the"] == (71723, 73754)
    assert spans["have"] == (81551, 86494) and spans["been"] == (86494, 89816)
    assert spans["there,"] == (89816, 98529)  # the comma pause is not speech
    assert spans["it's"] == (101836, 106885)  # whole token although the event stops at "'"
    assert spans["5pm."][1] == 124197
    prev = 0
    for a, b in spans.values():
        assert prev <= a < b <= REC_N
        prev = b


def test_regroup_without_phonemes_is_proportional():
    toks = [t.text for t in tokenize(REC_TEXT)]
    spans = dict(zip(toks, _rec_spans()))
    a, b = spans["of"][0], spans["the"][1]
    assert spans["of"][1] == spans["the"][0] == a + (b - a) * 2 // 5  # "of" 2 letters, "the" 3


def test_regroup_skips_zero_length_and_rejects_bad_events():
    text = "Hello there, world."
    ev = [Event("word", 0, 5, 0), Event("phoneme", 0, 0, 0, "h"), Event("phoneme", 0, 0, 500, "oU"),
          Event("word", 6, 5, 1000), Event("phoneme", 6, 0, 1000, "D"), Event("phoneme", 6, 0, 1500, "_:"),
          Event("word", 11, 0, 2000),  # zero length at the comma
          Event("word", 13, 5, 2000), Event("phoneme", 13, 0, 2000, "w"), Event("phoneme", 13, 0, 2500, "d"),
          Event("end", 18, 0, 3000)]
    assert word_spans(text, ev, 3000) == [(0, 1000), (1000, 1500), (2000, 3000)]
    backwards = [ev[3], ev[4], ev[0], ev[1]]
    with pytest.raises(AlignError):
        word_spans(text, backwards, 3000)
    with pytest.raises(AlignError):
        word_spans(text, [], 3000)


def test_best_split_and_distance():
    assert phoneme_distance(["D", "@2"], ["D", "@"]) == 0.5
    assert best_split(["D", "a#", "t", "h", "a#", "z", "b", "I", "n"],
                      [["D", "a", "t"], ["h", "a", "z"], ["b", "I", "n"]]) == [0, 3, 6]
    with pytest.raises(AlignError):
        best_split(["a"], [["a"], ["b"]])
    assert proportional_split(0, 100, ["ab", "abc"]) == [(0, 40), (40, 100)]


def test_read_jsonl_repairs_torn_line(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "wor')
    assert [r["id"] for r in read_jsonl(str(p), repair=True)] == ["a", "b"]
    assert p.read_text() == '{"id": "a"}\n{"id": "b"}\n'


# ----------------------------------------------------------------------------- end to end
SENTENCES = """\
The horse threw its inexperienced rider.
I don't think it's worth washing hogs over.
She choked with emotion when she spoke about her husband.
A lot of people are afraid of heights, not me.
Have you heard the news about the new library?
It is one of the best things that has been in the world.
We were walking around in the neighborhood to see whether we could find the dog.
Can you tell me where the nearest train station is?
The weather was lovely, so we went for a long walk by the river.
He paid 1,234 dollars for the old car in 1999.
Please turn off the lights when you leave the room.
My brother has been living in the city for ten years.
What time does the meeting start tomorrow morning?
They said the concert was the best they had ever seen.
Reading a good book is a wonderful way to spend an evening.
The children laughed as the puppy chased its own tail.
I would like a cup of tea with milk, please.
Our teacher explained the problem in a very simple way.
If it rains tomorrow, we will stay at home and play games.
The old man sat on the bench and fed the pigeons.
"""


def _config(tmp_path, **kw):
    f = tmp_path / "sentences.txt"
    f.write_text(SENTENCES)
    base = dict(seed=7, dev_frac=0.2, test_frac=0.3, heldout_frac=0.34, voices_per_combo=1,
                accents=["en-US"], variants=["f2", "m1", "m3"], sources=[], sentence_file=str(f))
    base.update(kw)
    return CorpusConfig(**base)


def _check_corpus(out: str) -> list[dict]:
    recs = read_jsonl(os.path.join(out, "manifest.jsonl"))
    with open(os.path.join(out, "voices.json")) as f:
        voices = {v["id"]: v for v in json.load(f)["voices"]}
    pool = read_jsonl(os.path.join(out, "sentences.jsonl"))
    keys = ("id", "split", "voice", "heldout_voice", "source", "text", "words", "audio",
            "duration_s", "graphemes", "chunks", "phones")
    for r in recs:
        assert all(k in r for k in keys), r.keys()
        assert r["split"] in ("train", "dev", "test")
        assert r["voice"] in voices and voices[r["voice"]]["heldout"] == r["heldout_voice"]
        if r["heldout_voice"]:
            assert r["split"] != "train"
        assert pool[r["sentence"]]["text"] == r["text"] and pool[r["sentence"]]["split"] == r["split"]
        with wave.open(os.path.join(out, r["audio"])) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
            assert abs(w.getnframes() / 24000 - r["duration_s"]) < 1e-4
        words = r["words"]
        assert [w[0] for w in words] == [t.text for t in tokenize(r["text"])]
        prev = 0.0
        for _, a, b in words:
            assert prev <= a < b <= r["duration_s"] + 1e-6
            prev = b
        # the phone timeline covers the file without gaps, and each word holds a spoken phone
        phones = r["phones"]
        assert phones[0][1] == 0 and abs(phones[-1][2] - r["duration_s"]) < 1e-3
        assert all(a < b and nm for nm, a, b in phones)
        assert all(p[2] == q[1] for p, q in zip(phones, phones[1:]))
        for _, a, b in words:
            assert any(nm != "_" and pa < b and pb > a for nm, pa, pb in phones)
        n = math.ceil(r["duration_s"] * 75)
        assert len(r["graphemes"]) == n
        assert all(0 <= g < VOCAB_SIZE for g in r["graphemes"])
        chunks = r["chunks"]
        frames = spans_to_frames([(a, b) for _, a, b in words], n)
        assert chunks[0][0] == 0 and chunks[0][2] == 0
        assert sum(c[1] for c in chunks) == len(words)
        for k, (first, size, tau) in enumerate(chunks):
            assert 2 <= size <= 4 or (k == len(chunks) - 1 and size >= 1)
            if k:  # the frame at which the chunk's first word starts
                assert tau >= chunks[k - 1][2] and tau == frames[first][0]
                assert abs(tau - words[first][1] * 75) <= 1.0
            assert 0 <= tau < n
    # no test (or dev) sentence in train
    by_split: dict[str, set] = {"train": set(), "dev": set(), "test": set()}
    for r in recs:
        by_split[r["split"]].add(normalize_text(r["text"]))
    assert not by_split["train"] & by_split["test"]
    assert not by_split["train"] & by_split["dev"]
    return recs


@needs_espeak
def test_build_tiny_corpus(tmp_path):
    out = str(tmp_path / "corpus")
    summary = build(out, hours=1.0, config=_config(tmp_path), max_utterances=10, progress=False,
                    log=lambda *a: None)
    recs = _check_corpus(out)
    assert len(recs) == 10 and len({r["id"] for r in recs}) == 10
    assert summary["utterances"] == 10
    assert {r["split"] for r in recs} >= {"train"}
    for name in ("voices.json", "summary.json", "config.json", "sentences.jsonl"):
        assert os.path.exists(os.path.join(out, name))
    with open(os.path.join(out, "voices.json")) as f:
        vj = json.load(f)
    assert sum(v["heldout"] for v in vj["voices"]) == 1 and len(vj["voices"]) == 3


def test_a_synthesis_error_in_a_one_worker_build_is_the_error_raised(tmp_path, monkeypatch):
    # a fresh interpreter has not imported concurrent.futures.process: the build's own
    # error handling must not need it, or its AttributeError hides the synthesiser's error
    import concurrent.futures
    from livespeech.training.corpus import build as build_module

    def no_synthesiser(job):
        raise OSError("libespeak-ng not found")

    monkeypatch.delattr(concurrent.futures, "process", raising=False)
    monkeypatch.setattr(build_module, "_work", no_synthesiser)
    with pytest.raises(OSError, match="libespeak-ng not found"):
        build(str(tmp_path / "corpus"), hours=1.0, config=_config(tmp_path), max_utterances=2, workers=1,
              progress=False, log=lambda *a: None)


@needs_espeak
def test_resume_after_interruption(tmp_path):
    cfg = _config(tmp_path)
    ref = str(tmp_path / "ref")
    build(ref, hours=1.0, config=cfg, max_utterances=10, progress=False, log=lambda *a: None)
    out = str(tmp_path / "resumed")
    build(out, hours=1.0, config=cfg, max_utterances=10, progress=False, log=lambda *a: None, stop_after=4)
    assert len(read_jsonl(os.path.join(out, "manifest.jsonl"))) == 4
    # simulate a kill in the middle of writing the next line, with its WAV already renamed
    with open(os.path.join(out, "manifest.jsonl"), "a") as f:
        f.write('{"id":"u00000004","split":"tr')
    build(out, hours=1.0, config=cfg, max_utterances=10, progress=False, log=lambda *a: None)
    recs = _check_corpus(out)
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)) == 10
    ref_recs = read_jsonl(os.path.join(ref, "manifest.jsonl"))
    key = lambda r: (r["id"], r["text"], r["voice"], r["split"], r["chunks"][0])  # noqa: E731
    assert sorted(map(key, recs)) == sorted(map(key, ref_recs))
    # a finished corpus is left alone; other options are refused
    build(out, hours=1.0, config=cfg, max_utterances=10, progress=False, log=lambda *a: None)
    assert len(read_jsonl(os.path.join(out, "manifest.jsonl"))) == 10
    from livespeech.training.corpus.build import ConfigMismatch

    with pytest.raises(ConfigMismatch):
        build(out, hours=1.0, config=_config(tmp_path, seed=8), max_utterances=10, progress=False,
              log=lambda *a: None)


@needs_espeak
def test_a_corpus_can_skip_the_training_utterances_an_earlier_one_had(tmp_path):
    cfg = _config(tmp_path)
    quiet = dict(progress=False, log=lambda *a: None)
    first = read_jsonl(os.path.join(build(str(tmp_path / "a"), hours=1.0, config=cfg, max_utterances=12,
                                          **quiet)["out"], "manifest.jsonl"))
    first_train = [int(r["id"][1:]) for r in first if r["split"] == "train"]
    skip = max(first_train) + 1
    build(str(tmp_path / "b"), hours=1.0, config=cfg, max_utterances=12, skip_train_before=skip, **quiet)
    second = _check_corpus(str(tmp_path / "b"))
    assert all(int(r["id"][1:]) >= skip for r in second if r["split"] == "train")
    assert any(r["split"] == "train" for r in second)
    # the plan's own dev/test utterances, the same as in the corpus without the skip
    held = lambda recs: {(r["id"], r["text"], r["voice"]) for r in recs if r["split"] != "train"}  # noqa: E731
    assert held(first) <= held(second)


@needs_espeak
def test_cli_parallel_build(tmp_path, capsys):
    from livespeech.training.corpus.cli import main

    f = tmp_path / "s.txt"
    f.write_text(SENTENCES)
    out = str(tmp_path / "c")
    rc = main(["build", "--out", out, "--hours", "1", "--workers", "2", "--max-utterances", "6",
               "--sentences", str(f), "--sources", "", "--accents", "en-US", "--variants", "m1,f2",
               "--voices-per-combo", "1", "--dev-frac", "0.2", "--test-frac", "0.2"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "train" in captured.out and "corpus" in captured.err  # summary + progress line
    recs = _check_corpus(out)
    assert len(recs) == 6
    assert main(["summary", "--out", out]) == 0
    # a resume without the definition's flags takes the corpus's own (scripts/train_gpu.sh
    # resumes a definition made elsewhere); a flag that disagrees with it is refused
    capsys.readouterr()
    assert main(["build", "--out", out, "--hours", "1", "--max-utterances", "8", "--no-progress"]) == 0
    assert len(_check_corpus(out)) == 8
    assert main(["build", "--out", out, "--hours", "1", "--max-utterances", "8", "--no-progress",
                 "--dev-frac", "0.2"]) == 0  # the same value as the corpus's
    assert main(["build", "--out", out, "--hours", "1", "--no-progress", "--seed", "3"]) == 2
    assert "seed: corpus has 0, asked for 3" in capsys.readouterr().err


@needs_espeak
def test_a_corpus_built_from_a_saved_definition_has_its_sentences_splits_and_voices(tmp_path, capsys):
    import gzip
    import shutil

    from livespeech.training.corpus.cli import main

    first = str(tmp_path / "first")
    build(first, hours=1.0, config=_config(tmp_path), max_utterances=6, progress=False, log=lambda *a: None)
    definition = tmp_path / "definition"  # what training/corpus/definition holds: the pool gzipped
    definition.mkdir()
    for name in ("config.json", "voices.json"):
        shutil.copy(os.path.join(first, name), definition / name)
    with open(os.path.join(first, "sentences.jsonl"), "rb") as f, gzip.open(definition / "sentences.jsonl.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    second = str(tmp_path / "second")
    args = ["build", "--hours", "1", "--max-utterances", "6", "--no-progress", "--definition", str(definition)]
    assert main(args + ["--out", second]) == 0
    key = lambda r: (r["id"], r["text"], r["voice"], r["split"])  # noqa: E731
    assert sorted(map(key, _check_corpus(second))) == sorted(map(key, read_jsonl(os.path.join(first, "manifest.jsonl"))))
    assert main(args + ["--out", second, "--max-utterances", "7"]) == 0  # resuming: the same definition
    assert len(_check_corpus(second)) == 7
    other = str(tmp_path / "other")  # started from another pool: refused, left as it was
    f = tmp_path / "other.txt"
    f.write_text(SENTENCES + "\nThis sentence is only in the other pool.\n")
    build(other, hours=1.0, config=_config(tmp_path, sentence_file=str(f)), max_utterances=1, progress=False,
          log=lambda *a: None)
    capsys.readouterr()
    assert main(args + ["--out", other]) == 2
    assert "another sentence pool" in capsys.readouterr().err
    assert len(read_jsonl(os.path.join(other, "manifest.jsonl"))) == 1


def test_the_repositorys_corpus_definition_is_whole():
    """training/corpus/definition: the pool the evaluation's test split comes from
    (docs/eval.md) matches the fingerprint its config.json was made with."""
    import gzip

    from livespeech.training.corpus.sentences import pool_fingerprint

    root = os.path.join(os.path.dirname(__file__), "..", "training", "corpus", "definition")
    with open(os.path.join(root, "config.json")) as f:
        cfg = json.load(f)
    with gzip.open(os.path.join(root, "sentences.jsonl.gz"), "rt") as f:
        rows = [json.loads(line) for line in f]
    assert [r["index"] for r in rows] == list(range(cfg["n_sentences"]))
    assert pool_fingerprint([Sentence(r["text"], r["source"]) for r in rows]) == cfg["pool_fingerprint"]
    assert {r["split"] for r in rows} == {"train", "dev", "test"}
    with open(os.path.join(root, "voices.json")) as f:
        assert json.load(f)["voices"]


def _one_engine_corpus(out: str, tmp_path, engine: str, n: int) -> tuple[list[dict], dict]:
    """A corpus of ``n`` utterances of one synthesiser, through the common checks:
    (manifest records, voices.json)."""
    build(out, hours=1.0, config=_config(tmp_path, engines={engine: 1.0}), max_utterances=n,
          progress=False, log=lambda *a: None)
    recs = _check_corpus(out)
    assert len(recs) == n and {r["engine"] for r in recs} == {engine}
    with open(os.path.join(out, "voices.json")) as f:
        return recs, json.load(f)


@needs_flite
def test_flite_voices_in_a_corpus(tmp_path):
    """A corpus of Flite voices only: 16 kHz speech resampled to 24 kHz, word spans in
    order and inside the audio (the common checks), one whole voice held out."""
    recs, vj = _one_engine_corpus(str(tmp_path / "corpus"), tmp_path, "flite", 6)
    held = {v["variant"] for v in vj["voices"] if v["heldout"]}
    assert len(held) == 1 and vj["heldout_variants"] == [f"flite-{held.pop()}"]
    # the words cover the speech: the first starts in the lead-in pad, the last ends by the trail
    for r in recs:
        assert r["words"][0][1] < 0.5 and r["duration_s"] - r["words"][-1][2] < 0.6


@needs_piper
def test_piper_voice_in_a_corpus(tmp_path):
    """A corpus of the Piper voice only: 22,050 Hz speech resampled to 24 kHz, word spans
    in order and inside the audio (the common checks), over audible speech, with the
    longer gaps between them silent; the one speaker is never held out."""
    out = str(tmp_path / "corpus")
    recs, vj = _one_engine_corpus(out, tmp_path, "piper", 4)
    assert vj["heldout_variants"] == [] and {v["variant"] for v in vj["voices"]} == {"joe"}
    word_rms, gap_rms = [], []
    for r in recs:
        audio, sr = read_wav(os.path.join(out, r["audio"]))
        x = audio.astype(np.float64) / 32768
        rms = lambda a, b: float(np.sqrt(np.mean(x[int(a * sr): int(b * sr)] ** 2)))  # noqa: E731
        assert r["words"][0][1] < 0.5 and r["duration_s"] - r["words"][-1][2] < 0.6
        word_rms += [rms(a, b) for _, a, b in r["words"]]
        gap_rms += [rms(w[2], n[1]) for w, n in zip(r["words"], r["words"][1:]) if n[1] - w[2] > 0.04]
    # a short "a" can be quiet (2 of 408 words in a 40-utterance check); a shifted
    # alignment puts many words in pauses and speech in the gaps
    assert sum(v < 0.01 for v in word_rms) <= len(word_rms) // 10, word_rms
    assert all(v < 0.01 for v in gap_rms), gap_rms


@needs_piper
def test_cli_lists_piper_voices(capsys):
    from livespeech.training.corpus.cli import main

    assert main(["voices", "--engines", "piper", "--json"]) == 0
    voices = json.loads(capsys.readouterr().out)["voices"]
    assert [v["id"] for v in voices] == ["piper-joe-0", "piper-joe-1"]
    assert {v["heldout"] for v in voices} == {False}


@needs_flite
def test_cli_lists_flite_voices(capsys):
    from livespeech.training.corpus.cli import main

    assert main(["voices", "--engines", "flite", "--json"]) == 0
    voices = json.loads(capsys.readouterr().out)["voices"]
    assert {v["engine"] for v in voices} == {"flite"} and len(voices) == 2 * len(flite.voices())
    assert main(["voices", "--engines", "festival"]) == 2
