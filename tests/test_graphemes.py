"""The grapheme vocabulary: normalisation, ids, CTC collapse and frame alignment."""
import random

import pytest

from livespeech.models.graphemes import (BLANK, EOS, SPACE, SYMBOLS, VOCAB_SIZE, align_words_to_frames,
                              collapse_repeats, ctc_collapse, ids_to_text, letter_positions, normalize_text,
                              spoken_letters, text_to_ids, word_graphemes)


def g(ch):
    return SYMBOLS.index(ch)


def word_ids(words):
    """The transcript as the server builds it: SPACE-joined word graphemes."""
    out = []
    for w in words:
        ids = word_graphemes(w)
        if ids:
            out += ([SPACE] if out else []) + ids
    return out


def test_vocabulary_layout():
    assert (BLANK, EOS, SPACE) == (0, 1, 2)
    assert SYMBOLS[SPACE] == " " and len(SYMBOLS) == VOCAB_SIZE == len(set(SYMBOLS))
    assert all(len(s) == 1 for s in SYMBOLS[SPACE:])


@pytest.mark.parametrize("text, norm", [
    ("Hello, World!", "hello world"),
    ("  many   spaces\tand\nlines ", "many spaces and lines"),
    ("Café naïve Ångström", "cafe naive angstrom"),
    ("Don\u2019t stop", "don't stop"),  # curly apostrophe
    ("'quoted' words'", "quoted words"),  # quotes are not apostrophes
    ("rock-n-roll", "rock n roll"),
    ("R2D2 has 3 legs.", "r2d2 has 3 legs"),
    ("", ""),
    ("?! -- ...", ""),
    ("' '' '", ""),
])
def test_normalize_text(text, norm):
    assert normalize_text(text) == norm
    assert normalize_text(norm) == norm  # idempotent


def test_text_ids_round_trip():
    rng = random.Random(0)
    pool = "abcXYZ  '-.,!?0129éü\u2019\t\u4e2d"
    for _ in range(300):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(0, 30)))
        ids = text_to_ids(text)
        assert all(SPACE <= i < VOCAB_SIZE for i in ids)
        assert ids_to_text(ids) == normalize_text(text)
        assert text_to_ids(ids_to_text(ids)) == ids
    assert ids_to_text([BLANK, g("h"), EOS, g("i"), BLANK]) == "hi"  # specials dropped


def test_word_graphemes():
    assert word_graphemes("Hello,") == text_to_ids("hello")
    assert word_graphemes("--") == []
    assert word_graphemes("don't") == text_to_ids("don't")


def test_collapse_repeats():
    assert collapse_repeats(text_to_ids("hello  balloon")) == text_to_ids("helo balon")
    assert collapse_repeats([]) == []
    assert collapse_repeats([5, 5, 5]) == [5]


def test_ctc_collapse():
    a, b, c = g("a"), g("b"), g("c")
    filled = [a] * 5 + [b] * 10 + [c] * 2 + [BLANK] * 2  # the paper's example
    assert ctc_collapse(filled) == [a, b, c]
    raw = [a, a, BLANK, BLANK, BLANK, b, b, b, b] + [BLANK] * 6 + [c, c, BLANK, BLANK]
    assert ctc_collapse(raw) == [a, b, c]
    assert ctc_collapse([a, BLANK, a]) == [a, a]  # a blank separates a real repeat
    assert ctc_collapse([a, EOS, a, EOS]) == [a, a]
    assert ctc_collapse([BLANK, EOS]) == []
    assert ctc_collapse(iter([a, a, SPACE, SPACE, b])) == [a, SPACE, b]


def test_align_blank_filling_and_trailing_blank():
    frames = align_words_to_frames(["hi", "yo"], [(2, 5), (8, 10)], 14)
    h, i, y, o = g("h"), g("i"), g("y"), g("o")
    # leading silence takes the first grapheme, the gap holds SPACE then the next
    # word's first grapheme (blank filling to the right), trailing frames are BLANK
    assert frames == [h, h, h, h, i, SPACE, y, y, y, o, BLANK, BLANK, BLANK, BLANK]
    assert ctc_collapse(frames) == text_to_ids("hi yo")


def test_align_space_on_first_frame_without_gap():
    frames = align_words_to_frames(["ab", "cd"], [(0, 2), (2, 5)], 5)
    assert frames == [g("a"), g("b"), SPACE, g("c"), g("d")]
    # no room for the SPACE: the word keeps all its frames
    frames = align_words_to_frames(["ab", "cd"], [(0, 2), (2, 4)], 4)
    assert frames == [g("a"), g("b"), g("c"), g("d")]


def test_align_every_char_gets_a_frame_when_span_allows():
    rng = random.Random(1)
    for _ in range(200):
        words = ["".join(rng.choice("abcdeo'l") for _ in range(rng.randint(1, 8)))
                 for _ in range(rng.randint(1, 6))]
        words = [w for w in words if word_graphemes(w)] or ["a"]
        spans, t = [], rng.randint(0, 3)
        for w in words:
            n = len(word_graphemes(w)) + rng.randint(1, 6)  # room for the SPACE too
            spans.append((t, t + n))
            t += n + rng.randint(0, 3)
        n_frames = t + rng.randint(0, 4)
        frames = align_words_to_frames(words, spans, n_frames)
        assert len(frames) == n_frames
        assert frames[spans[-1][1]:] == [BLANK] * (n_frames - spans[-1][1])
        assert BLANK not in frames[:spans[-1][1]]
        # the collapsed stream is exactly the collapsed transcript
        assert ctc_collapse(frames) == collapse_repeats(word_ids(words))
        for w, (s, e) in zip(words, spans):
            assert set(word_graphemes(w)) <= set(frames[s:e])


def test_align_short_span_and_clipping():
    frames = align_words_to_frames(["abcdef"], [(0, 3)], 5)
    assert len(frames) == 5 and frames[3:] == [BLANK, BLANK]
    assert set(frames[:3]) <= set(word_graphemes("abcdef"))
    frames = align_words_to_frames(["ab", "cd"], [(0, 3), (5, 40)], 8)  # clipped at 8
    assert len(frames) == 8 and ctc_collapse(frames) == text_to_ids("ab cd")
    assert align_words_to_frames([], [], 3) == [BLANK] * 3
    assert align_words_to_frames(["ab"], [(2, 2)], 3) == [BLANK] * 3  # empty span


def test_align_skips_words_without_graphemes():
    # regression: a leading punctuation "word" used to put a SPACE before the first word
    frames = align_words_to_frames(["--", "hello"], [(0, 2), (2, 10)], 12)
    assert ctc_collapse(frames) == collapse_repeats(text_to_ids("hello"))
    # and the SPACE goes in the real gap after "hello", not after the skipped word
    frames = align_words_to_frames(["hello", "--", "world"], [(0, 5), (5, 9), (9, 15)], 15)
    assert frames[5] == SPACE
    assert ctc_collapse(frames) == collapse_repeats(text_to_ids("hello world"))


def test_letters_on_phones_move_with_the_sounds_and_pauses_are_spaces():
    # "hello" over frames 2..12: h is short (1 frame), o long (4); a pause 12..15; "yo" 15..18
    phones = [("_", 0, 2), ("h", 2, 3), ("@", 3, 5), ("l", 5, 8), ("oU", 8, 12), ("_", 12, 15),
              ("j", 15, 16), ("oU", 16, 18), ("_", 18, 20)]
    out = align_words_to_frames(["hello", "yo"], [(2, 12), (15, 18)], 20, phones=phones)
    text = "".join(SYMBOLS[i] if len(SYMBOLS[i]) == 1 else "." for i in out)
    assert text == "hhhelllllooo   yoo.."
    even = align_words_to_frames(["hello", "yo"], [(2, 12), (15, 18)], 20)
    assert ctc_collapse(out) == ctc_collapse(even)  # the same letters, other frames
    # a word with no phone timeline inside its span is split evenly over its frames
    assert align_words_to_frames(["ab"], [(0, 4)], 4, phones=[]) == align_words_to_frames(["ab"], [(0, 4)], 4)


def test_letter_positions_index_the_spoken_letters_the_frames_carry():
    words, spans = ["Hi,", "--", "yo"], [(2, 5), (5, 6), (8, 10)]
    letters = spoken_letters(words)
    assert letters == text_to_ids("hi yo")
    for phones in (None, [("h", 2, 3), ("aI", 3, 5), ("_", 5, 8), ("j", 8, 9), ("oU", 9, 10)]):
        pos = letter_positions(words, spans, 14, phones=phones)
        frames = align_words_to_frames(words, spans, 14, phones=phones)
        assert [letters[p] if p >= 0 else BLANK for p in pos] == frames
        assert pos[10:] == [-1] * 4 and pos[0] == 0  # leading silence takes the first letter
        assert all(b - a in (0, 1) for a, b in zip(pos[:10], pos[1:10]))  # one letter after another

