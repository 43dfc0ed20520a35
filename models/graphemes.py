"""Grapheme vocabulary: the semantic codebook placed before the acoustic ones.

The grapheme stream is time-aligned at the codec frame rate (75 Hz). Blanks inside
speech are replaced by the next non-blank token (paper, Sec. 4.2), so a doubled
letter ("ll") cannot be told apart from a single one in the stream; every consumer
that compares the stream with a transcript therefore compares against the transcript
with consecutive repeats collapsed (`collapse_repeats`).
"""
from __future__ import annotations

import unicodedata
from typing import Iterable, Sequence

BLANK = 0  # silence after the last word (leading silence takes the first character)
EOS = 1  # end of speech: the decoder emits it once the transcript is spoken
SPACE = 2
_CHARS = " '" + "abcdefghijklmnopqrstuvwxyz" + "0123456789"
SYMBOLS: tuple[str, ...] = ("<blank>", "<eos>") + tuple(_CHARS)
VOCAB_SIZE = len(SYMBOLS)
_INDEX = {c: i for i, c in enumerate(SYMBOLS) if len(c) == 1}


def normalize_text(text: str) -> str:
    """Lower-case ASCII letters, digits, apostrophes and single spaces.

    Accents are stripped (NFKD), every other character is a word separator, so the
    result is what a listener could write down from the speech, spelled as in the text.
    """
    decomposed = unicodedata.normalize("NFKD", text)
    out = []
    for ch in decomposed:
        if unicodedata.combining(ch):
            continue
        ch = ch.lower()
        if ch in ("\u2019", "\u2018", "`"):
            ch = "'"
        out.append(ch if ch in _INDEX and ch != " " else " ")
    words = "".join(out).split()
    # apostrophes only count inside words ("don't"), not as quotes
    words = [w.strip("'") for w in words]
    return " ".join(w for w in words if w)


def word_graphemes(word: str) -> list[int]:
    """Grapheme ids of one word (normalised; may be empty for pure punctuation)."""
    return [_INDEX[c] for c in normalize_text(word).replace(" ", "")]


def text_to_ids(text: str) -> list[int]:
    """Grapheme ids of a whole text: words joined by SPACE."""
    return [_INDEX[c] for c in normalize_text(text)]


def ids_to_text(ids: Iterable[int]) -> str:
    return "".join(SYMBOLS[i] for i in ids if i > EOS)


def collapse_repeats(ids: Sequence[int]) -> list[int]:
    """Drop consecutive duplicates (the part of CTC decoding that applies to transcripts)."""
    out: list[int] = []
    for i in ids:
        if not out or out[-1] != i:
            out.append(i)
    return out


def ctc_collapse(ids: Iterable[int]) -> list[int]:
    """CTC-decode a frame-level grapheme stream: merge repeats, drop blank and EOS."""
    out: list[int] = []
    prev = None
    for i in ids:
        if i != prev and i > EOS:
            out.append(i)
        prev = i
    return out


def align_words_to_frames(
    words: Sequence[str], spans: Sequence[tuple[int, int]], n_frames: int
) -> list[int]:
    """Frame-level grapheme targets from word spans (start, end) in frames.

    Each word's characters share its span evenly; the SPACE before a word sits in the
    gap before it (or on the word's first frame when there is no gap); every unlabelled
    frame inside speech takes the next label to its right (the paper's blank filling);
    frames after the last word stay BLANK.
    """
    labels = [-1] * n_frames
    prev_end = None  # end of the last word that got labels (skipped words don't count)
    for word, (start, end) in zip(words, spans):
        chars = word_graphemes(word)
        start = max(0, min(start, n_frames))
        end = max(start, min(end, n_frames))
        if not chars or end <= start:
            continue
        if prev_end is not None:
            gap_start = max(0, min(prev_end, start))
            if gap_start < start:
                labels[gap_start] = SPACE
            elif end - start > len(chars):
                labels[start] = SPACE
                start += 1
        prev_end = end
        n = end - start
        for k in range(n):
            labels[start + k] = chars[min(len(chars) - 1, k * len(chars) // n)]
    out = [BLANK] * n_frames
    nxt = BLANK
    for t in range(n_frames - 1, -1, -1):
        if labels[t] >= 0:
            nxt = labels[t]
            out[t] = nxt
        else:
            out[t] = nxt
    # trailing frames after the last word: BLANK, not the last label
    last = max((t for t in range(n_frames) if labels[t] >= 0), default=-1)
    for t in range(last + 1, n_frames):
        out[t] = BLANK
    return out
