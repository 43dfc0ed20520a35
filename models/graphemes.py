"""Grapheme vocabulary: the semantic codebook placed before the acoustic ones.

The grapheme stream is time-aligned at the codec frame rate (75 Hz). Blanks inside
speech are replaced by the next non-blank token (paper, Sec. 4.2), so a doubled
letter ("ll") cannot be told apart from a single one in the stream; every consumer
that compares the stream with a transcript therefore compares against the transcript
with consecutive repeats collapsed (`collapse_repeats`).
"""
from __future__ import annotations

import unicodedata
from typing import Iterable, Optional, Sequence

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


def has_content(word: str) -> bool:
    """Whether a word says something: a letter or a digit of any script ("Привет", "42"),
    where punctuation, marks and emoji do not."""
    return any(c.isalnum() for c in word)


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
    words: Sequence[str], spans: Sequence[tuple[int, int]], n_frames: int,
    phones: Optional[Sequence[tuple[str, int, int]]] = None, pause: str = "_",
) -> list[int]:
    """Frame-level grapheme targets from word spans (start, end) in frames.

    Each word's characters share its span evenly; the SPACE before a word sits in the
    gap before it (or on the word's first frame when there is no gap); every unlabelled
    frame inside speech takes the next label to its right (the paper's blank filling);
    frames after the last word stay BLANK.

    With ``phones`` (the utterance's phone timeline: (name, start, end) frames, ``pause``
    for pauses) the letters follow the speech: a word's letters are spread over its
    spoken phones rather than its frames, and the whole pause between two words is SPACE
    rather than carrying the next word's first letter.
    """
    ids = spoken_letters(words)
    return [ids[p] if p >= 0 else BLANK for p in letter_positions(words, spans, n_frames, phones, pause)]


def spoken_letters(words: Sequence[str]) -> list[int]:
    """The grapheme ids `letter_positions` indexes: each word's letters, SPACE between words."""
    out: list[int] = []
    for word in words:
        chars = word_graphemes(word)
        if chars:
            out += ([SPACE] if out else []) + chars
    return out


def letter_positions(
    words: Sequence[str], spans: Sequence[tuple[int, int]], n_frames: int,
    phones: Optional[Sequence[tuple[str, int, int]]] = None, pause: str = "_",
) -> list[int]:
    """Per frame, the index into `spoken_letters(words)` of the letter (or SPACE) it
    carries as `align_words_to_frames` lays them out; -1 after the last word."""
    labels = [-1] * n_frames
    spoken = None if phones is None else [(a, b) for name, a, b in phones if name != pause and b > a]
    prev_end = None  # end of the last word that got labels (skipped words don't count)
    offset = 0  # the word's first letter in spoken_letters
    for word, (start, end) in zip(words, spans):
        chars = word_graphemes(word)
        if not chars:
            continue
        first, offset = offset, offset + len(chars) + 1
        start = max(0, min(start, n_frames))
        end = max(start, min(end, n_frames))
        if end <= start:
            continue
        if prev_end is not None:
            gap_start = max(0, min(prev_end, start))
            if gap_start < start:
                for t in range(gap_start, start if spoken is not None else gap_start + 1):
                    labels[t] = first - 1
            elif end - start > len(chars):
                labels[start] = first - 1
                start += 1
        prev_end = end
        if spoken is None:
            n = end - start
            for k in range(n):
                labels[start + k] = first + min(len(chars) - 1, k * len(chars) // n)
            continue
        bounds = _letter_bounds(len(chars), start, end, [(max(a, start), min(b, end)) for a, b in spoken
                                                          if a < end and b > start])
        for k in range(len(chars)):  # a letter squeezed to no frame is not in the stream
            for t in range(bounds[k], bounds[k + 1]):
                labels[t] = first + k
    return _fill(labels, n_frames)


def _letter_bounds(n_letters: int, start: int, end: int, phones: Sequence[tuple[int, int]]) -> list[int]:
    """n_letters + 1 frame boundaries splitting [start, end) among a word's letters: evenly
    over its phones (``phones``: the (start, end) frames of its spoken phones, in order),
    so a letter moves with the sounds, not with the clock; evenly over frames without them."""
    if not phones:
        return [start + (end - start) * k // n_letters for k in range(n_letters + 1)]
    # the phones' boundaries on a phone-index axis: position x in [0, m] -> a frame
    m = len(phones)
    edges = [start] + [max(start, min(end, phones[i][1])) for i in range(m - 1)] + [end]
    edges = [max(a, b) for a, b in zip(edges, [start] + edges[:-1])]  # monotone

    def at(x: float) -> int:
        i = min(int(x), m - 1)
        return int(round(edges[i] + (edges[i + 1] - edges[i]) * (x - i)))

    return [at(k * m / n_letters) for k in range(n_letters + 1)]


def _fill(labels: list[int], n_frames: int) -> list[int]:
    """Unlabelled (-1) frames take the next label to their right; after the last label, -1."""
    out = [-1] * n_frames
    nxt = -1
    for t in range(n_frames - 1, -1, -1):
        if labels[t] >= 0:
            nxt = labels[t]
        out[t] = nxt
    last = max((t for t in range(n_frames) if labels[t] >= 0), default=-1)
    for t in range(last + 1, n_frames):
        out[t] = -1
    return out
