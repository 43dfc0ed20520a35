"""Word spans from synthesiser events (pure functions, no synthesiser needed).

eSpeak NG reports a WORD event (character position, length, output sample) and PHONEME
events (mnemonic, output sample). Turning them into one span per written word has
pitfalls, all handled here:

* joined groups: common phrases ("of the", "has been", "in the") are spoken as one word
  with one event, so the later words get none. The group's phonemes are split at the
  boundaries that best match each word said alone (edit distance against
  ``espeak_TextToPhonemes`` of each word), or proportionally by characters when no
  phoneme information is available.
* numbers / abbreviations expand into several events ("1,234" gives five, "3.5" three):
  every event whose position falls inside a written token is grouped back onto it.
* an event's ``length`` stops at apostrophes ("it's" -> "it"): spans of the written words
  are taken from the text, never from the event length.
* zero-length WORD events at punctuation and sentence ends are skipped; an event at a
  position between tokens (eSpeak puts "what" of "wait - what" on the dash) belongs to
  the next token.
* word ends come from the phoneme stream: a word ends where the next event after its
  last spoken phoneme starts (usually a pause phoneme or the next word), so pauses at
  commas are not counted as speech.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

from livespeech.models.graphemes import word_graphemes

from .espeak import Event


class AlignError(ValueError):
    """The events cannot be mapped onto the written words; the utterance is rejected."""


@dataclass(frozen=True)
class Token:
    text: str  # the word as written, with attached punctuation ("there,")
    start: int  # character offsets in the sentence
    end: int


_WS = re.compile(r"\S+")


def tokenize(text: str) -> list[Token]:
    """The spoken words of ``text``: whitespace-separated tokens that contain a letter or
    digit (pure punctuation such as a standalone "-" is not a word)."""
    return [Token(m.group(), m.start(), m.end()) for m in _WS.finditer(text) if word_graphemes(m.group())]


def _is_pause(name: str) -> bool:
    return not name or name.startswith("_")


def token_index_at(tokens: Sequence[Token], pos: int) -> int | None:
    """Index of the token containing character ``pos``; a position between tokens maps to
    the next token; None after the last token."""
    for i, t in enumerate(tokens):
        if pos < t.end:
            return i
    return None


@dataclass
class _Group:
    tokens: list[int]
    start: int  # sample
    phonemes: list[tuple[str, int]]  # (name, sample) incl. pauses, in order
    end: int = -1


def _substitution(a: str, b: str) -> float:
    """Similar phonemes (same first character, e.g. "@" / "@2", "ah" / "ax") cost half."""
    return 0.0 if a == b else 0.5 if a[:1] == b[:1] else 1.0


def phoneme_distance(a: Sequence[str], b: Sequence[str]) -> float:
    """Edit distance between phoneme sequences (`_substitution` costs)."""
    n, m = len(a), len(b)
    prev = [float(j) for j in range(m + 1)]
    for i in range(1, n + 1):
        cur = [float(i)] + [0.0] * m
        ai = a[i - 1]
        for j in range(1, m + 1):
            cur[j] = min(prev[j] + 1.0, cur[j - 1] + 1.0, prev[j - 1] + _substitution(ai, b[j - 1]))
        prev = cur
    return prev[m]


def spans_from_phonemes(speech: Sequence[tuple[str, int, int]],
                        words: Sequence[Sequence[str]]) -> list[tuple[int, int]]:
    """One (start, end) sample span per word, for a synthesiser that times phonemes but
    not words (Flite): ``speech`` is the sentence's spoken phonemes (name, start, end),
    pauses removed; ``words`` each word's phonemes said alone. The sentence is aligned
    to the words' phonemes in order (edit distance, `_substitution` costs); a sentence
    phoneme belongs to the word of the phoneme it is aligned with, an extra one to the
    word before it (at the very start, the first word). A word left with no phoneme
    cannot be timed: AlignError."""
    ref = [w for w, ps in enumerate(words) for _ in ps]
    names = [p for ps in words for p in ps]
    n, m = len(speech), len(names)
    if n == 0 or m == 0:
        raise AlignError("no phonemes")
    cost = [[float(i + j) if i == 0 or j == 0 else 0.0 for j in range(m + 1)] for i in range(n + 1)]
    for i in range(1, n + 1):
        row, up, a = cost[i], cost[i - 1], speech[i - 1][0]
        for j in range(1, m + 1):
            row[j] = min(up[j - 1] + _substitution(a, names[j - 1]), up[j] + 1.0, row[j - 1] + 1.0)
    owner: list[int | None] = [None] * n  # word of each sentence phoneme; None: an extra one
    i, j = n, m
    while i > 0 and j > 0:
        if cost[i][j] == cost[i - 1][j - 1] + _substitution(speech[i - 1][0], names[j - 1]):
            owner[i - 1] = ref[j - 1]
            i, j = i - 1, j - 1
        elif cost[i][j] == cost[i - 1][j] + 1.0:
            i -= 1
        else:
            j -= 1
    prev = 0
    for k, w in enumerate(owner):
        owner[k] = prev = w if w is not None else prev
    spans = []
    for w in range(len(words)):
        mine = [k for k, o in enumerate(owner) if o == w]
        if not mine:
            raise AlignError(f"word {w} has no phoneme in the sentence")
        spans.append((speech[mine[0]][1], speech[mine[-1]][2]))
    return spans


def best_split(group: Sequence[str], words: Sequence[Sequence[str]]) -> list[int]:
    """Split points b_1 < ... < b_{k-1} of ``group`` (phoneme names) into ``len(words)``
    non-empty parts that minimise the summed edit distance of each part to the phonemes
    of the corresponding word said alone. Returns [0, b_1, ..., b_{k-1}]."""
    n, k = len(group), len(words)
    if k == 1:
        return [0]
    if n < k:
        raise AlignError("fewer phonemes than words in a joined group")
    inf = float("inf")
    # cost[j][b]: best cost of words[:j] covering group[:b]
    cost = [[inf] * (n + 1) for _ in range(k + 1)]
    back = [[0] * (n + 1) for _ in range(k + 1)]
    cost[0][0] = 0.0
    for j in range(1, k + 1):
        lo = j  # each part non-empty
        hi = n - (k - j)
        for b in range(lo, hi + 1):
            best, arg = inf, 0
            for a in range(j - 1, b):
                if cost[j - 1][a] == inf:
                    continue
                c = cost[j - 1][a] + phoneme_distance(group[a:b], words[j - 1])
                if c < best - 1e-9:
                    best, arg = c, a
            cost[j][b] = best
            back[j][b] = arg
    cuts = []
    b = n
    for j in range(k, 0, -1):
        a = back[j][b]
        cuts.append(a)
        b = a
    return cuts[::-1]


def proportional_split(start: int, end: int, words: Sequence[str]) -> list[tuple[int, int]]:
    """Split [start, end) among ``words`` in proportion to their normalised lengths."""
    lens = [max(1, len(word_graphemes(w))) for w in words]
    total = sum(lens)
    out = []
    acc = 0
    for n in lens:
        a = start + (end - start) * acc // total
        acc += n
        b = start + (end - start) * acc // total
        out.append((a, b))
    return out


def word_spans(
    text: str,
    events: Sequence[Event],
    n_samples: int,
    phonemes_alone: Callable[[str], Sequence[str]] | None = None,
    tokens: Sequence[Token] | None = None,
) -> list[tuple[int, int]]:
    """One (start, end) span in output samples for every token of ``tokenize(text)``.

    ``events`` are the synthesiser's events of the call that produced the audio (word,
    phoneme, end/sentence), in output order. ``phonemes_alone(word)`` gives a word's
    phonemes said alone (used to split joined groups); without it joined groups are
    split proportionally by characters.
    Raises AlignError when the events cannot be mapped (the caller rejects the utterance).
    """
    tokens = list(tokens) if tokens is not None else tokenize(text)
    if not tokens:
        raise AlignError("no words")
    groups: list[_Group] = []
    boundaries: list[int] = []  # samples of events that end the preceding speech
    current: _Group | None = None
    for ev in events:
        if ev.kind == "word":
            if ev.length <= 0:
                boundaries.append(ev.sample)
                continue
            idx = token_index_at(tokens, ev.pos)
            if idx is None:  # speech after the last written word: cannot be attributed
                raise AlignError(f"word event after the last token at {ev.pos}")
            if current is not None and current.tokens[-1] == idx:
                continue  # another event for the same token (number, abbreviation)
            if current is not None and idx < current.tokens[-1]:
                raise AlignError("word events go backwards")
            current = _Group([idx], ev.sample, [])
            groups.append(current)
        elif ev.kind == "phoneme":
            if current is None:
                if _is_pause(ev.name):
                    continue
                # speech before the first word event: belongs to the first token
                current = _Group([0], ev.sample, [])
                groups.append(current)
            current.phonemes.append((ev.name, ev.sample))
        else:
            boundaries.append(ev.sample)
    if not groups:
        raise AlignError("no word events")
    # tokens without their own event join the group before them (eSpeak's joined words)
    first = groups[0]
    if first.tokens[0] != 0:
        first.tokens = list(range(0, first.tokens[0] + 1))
    for g, nxt in zip(groups, groups[1:] + [None]):
        last = nxt.tokens[0] if nxt is not None else len(tokens)
        g.tokens = list(range(g.tokens[0], last))
    # every phoneme/word/end sample, to find where each group's speech stops
    marks = sorted({s for g in groups for _, s in g.phonemes} | {g.start for g in groups}
                   | set(boundaries) | {n_samples})
    bounds: list[list] = []  # per group: [start, end, speech phonemes]
    for g in groups:
        speech = [(nm, s) for nm, s in g.phonemes if not _is_pause(nm)]
        if not speech:
            raise AlignError(f"no spoken phonemes for {tokens[g.tokens[0]].text!r}")
        # start: the word event, unless pauses come first (then the first spoken phoneme)
        if g.phonemes and _is_pause(g.phonemes[0][0]):
            start = speech[0][1]
        else:
            start = min(g.start, speech[0][1])
        last_s = speech[-1][1]
        end = min(next((m for m in marks if m > last_s), n_samples), n_samples)
        bounds.append([start, end, speech])
    # eSpeak sometimes puts a word event on the last phoneme of the word before it (a
    # linking consonant, "one of"): the boundary goes to the next word's first phoneme
    for prev, cur in zip(bounds, bounds[1:]):
        if prev[1] > cur[0]:
            last_prev = prev[2][-1][1]
            first_cur = cur[2][0][1]
            b = first_cur if first_cur > last_prev else cur[0]
            prev[1] = b
            cur[0] = b
    spans: list[tuple[int, int]] = []
    for g, (start, end, speech) in zip(groups, bounds):
        if len(g.tokens) == 1:
            spans.append((start, end))
            continue
        words = [tokens[i].text for i in g.tokens]
        names = [nm for nm, _ in speech]
        cut = None
        if phonemes_alone is not None and len(names) >= len(words):
            alone = [list(phonemes_alone(speakable(w))) for w in words]
            if all(alone):
                cut = best_split(names, alone)
        if cut is None:
            spans.extend(proportional_split(start, end, words))
            continue
        starts = [start] + [speech[c][1] for c in cut[1:]]
        for j in range(len(words)):
            spans.append((starts[j], starts[j + 1] if j + 1 < len(words) else end))
    if len(spans) != len(tokens):
        raise AlignError("span count mismatch")
    prev_end = 0
    for (a, b), t in zip(spans, tokens):
        if not (0 <= a < b <= n_samples) or a < prev_end:
            raise AlignError(f"bad span {a}-{b} for {t.text!r}")
        prev_end = b
    return spans


PAUSE = "_"  # the one pause label of every synthesiser's phone timeline


def phone_timeline(phones: Sequence[tuple[str, int, int]], n_samples: int) -> list[tuple[str, int, int]]:
    """Spoken phones (name, start, end) in order -> a timeline covering [0, n_samples):
    every gap between phones (and before the first / after the last) becomes a ``PAUSE``
    phone, overlaps are cut at the later phone's start, empty phones are dropped. These are
    the codec's phoneme labels (training/phones.py), the same for every synthesiser."""
    out: list[tuple[str, int, int]] = []
    pos = 0
    for name, a, b in phones:
        a, b = max(a, pos), min(b, n_samples)
        if b <= a:
            continue
        if a > pos:
            out.append((PAUSE, pos, a))
        out.append((name, a, b))
        pos = b
    if pos < n_samples:
        out.append((PAUSE, pos, n_samples))
    return out


def espeak_phones(events: Sequence[Event], n_samples: int) -> list[tuple[str, int, int]]:
    """eSpeak NG's phoneme events -> spoken phones (name, start, end): a phoneme lasts
    until the next event of any kind; pause phonemes ("_", "_:", ...) are left out (the
    timeline fills them in); stress marks are not part of the phone's name."""
    marks = sorted({e.sample for e in events} | {n_samples})
    out = []
    for e in events:
        if e.kind != "phoneme" or _is_pause(e.name):
            continue
        name = e.name.replace("'", "").replace(",", "")
        end = next((m for m in marks if m > e.sample), n_samples)
        if name:
            out.append((name, e.sample, end))
    return out


def speakable(word: str) -> str:
    """A token without surrounding punctuation, for asking how it sounds alone."""
    return word.strip(".,;:!?\"()[]'-") or word
