"""What the simulated upstream sends: texts and their timing (pure, seeded).

A *turn* is what one session speaks: a few consecutive sentences. Its *schedule* is a
list of `Piece`s with the time (seconds after the turn starts) at which each is sent:

- LLM mode: ~4-character sub-word pieces (leading spaces attached, as BPE tokens are)
  at `rate` pieces per second, each gap scaled by uniform(1-jitter, 1+jitter), with an
  optional pause (tool call, slow token) after a piece with probability `pause_prob`;
- paced mode: whole words at `words_per_s` (an upstream that already runs at speech
  rate, e.g. a streaming translator), same jitter.

Every piece carries its sentence index, so the sentence-level baseline knows when each
sentence became complete (the arrival of its last piece).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

# assistant-like sentences, 5..25 words, with the punctuation an LLM produces
BUILTIN_SENTENCES: tuple[str, ...] = (
    "Sure, I can help you with that.",
    "The weather in Paris tomorrow will be mostly sunny, with a high of twenty-two degrees.",
    "Your flight to Boston leaves at seven forty-five from gate twelve.",
    "Here is a quick summary of the three options we discussed earlier.",
    "First, preheat the oven to two hundred degrees and line a baking tray with paper.",
    "I could not find any meetings on your calendar for Friday afternoon.",
    "That is a great question, and the answer depends on what you want to optimise for.",
    "The package was delivered this morning and left at the front door.",
    "Would you like me to read the next message?",
    "In short, the new plan costs a little more but includes twice the storage.",
    "Mix the flour and the butter until the dough feels like coarse sand.",
    "The train is running about ten minutes late because of signal problems near the station.",
    "Okay.",
    "Let me check that for you.",
    "According to the report, revenue grew by eight percent in the last quarter, mostly from new customers.",
    "You have two unread messages, one from Anna and one from the bank.",
    "Turn left at the next junction, then keep right for about three hundred metres.",
    "I have set a reminder for tomorrow at nine, called call the dentist.",
    "The museum is open every day except Monday, from ten in the morning until six in the evening.",
    "Sorry, I did not catch that.",
    "Could you say it again, a little more slowly?",
    "If the problem persists, try restarting the router and waiting a minute before reconnecting.",
    "The recipe serves four people and takes about forty minutes from start to finish.",
    "Your balance is one thousand two hundred and fifty euros.",
    "It looks like rain later today, so you might want to take an umbrella.",
    "Here are the top three results for Italian restaurants near you.",
    "The first one has excellent reviews and is only a five minute walk away.",
    "I am not sure about that, but I can search the web if you like.",
    "The meeting has been moved to Thursday at half past two, in the small conference room.",
    "Great, your table for two is booked for eight o'clock tonight.",
    "To reset your password, open the settings page and choose security, then follow the instructions.",
    "The score at half time was two to one, after an early goal from the visitors.",
)

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_WORD = re.compile(r"\s*\S+")


@dataclass(frozen=True)
class Piece:
    t_s: float  # send time, seconds after the turn's first piece
    text: str
    sentence: int  # index of the sentence in the turn


@dataclass(frozen=True)
class Turn:
    sentences: tuple[str, ...]
    pieces: tuple[Piece, ...]

    @property
    def text(self) -> str:
        return " ".join(self.sentences)

    @property
    def words(self) -> int:
        return len(self.text.split())

    def sentence_complete_s(self) -> list[float]:
        """Time at which each sentence's last piece is sent."""
        done = [0.0] * len(self.sentences)
        for p in self.pieces:
            done[p.sentence] = max(done[p.sentence], p.t_s)
        return done

    def sentence_first_s(self) -> list[float]:
        first = [float("inf")] * len(self.sentences)
        for p in self.pieces:
            first[p.sentence] = min(first[p.sentence], p.t_s)
        return first


@dataclass(frozen=True)
class Pacing:
    mode: str = "llm"  # "llm" | "paced"
    llm_rate: float = 40.0  # pieces (tokens) per second
    piece_chars: int = 4
    words_per_s: float = 2.5
    jitter: float = 0.3
    pause_prob: float = 0.0  # per piece
    pause_ms: float = 0.0

    def validate(self) -> "Pacing":
        if self.mode not in ("llm", "paced"):
            raise ValueError(f"pacing mode must be llm or paced, got {self.mode!r}")
        if self.llm_rate <= 0 or self.words_per_s <= 0:
            raise ValueError("rates must be positive")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter must be in [0, 1)")
        if not 0 <= self.pause_prob <= 1 or self.pause_ms < 0:
            raise ValueError("pause_prob must be in [0, 1] and pause_ms >= 0")
        if self.piece_chars < 1:
            raise ValueError("piece_chars must be >= 1")
        return self


def split_pieces(text: str, piece_chars: int = 4) -> list[str]:
    """Sub-word pieces like an LLM's BPE tokens: leading spaces stay attached to the
    word's first piece ("Hello world" -> "Hell", "o", " worl", "d")."""
    pieces: list[str] = []
    for m in _WORD.finditer(text):
        word = m.group(0)
        lead = len(word) - len(word.lstrip())
        first = lead + piece_chars
        pieces.append(word[:first])
        pieces += [word[i : i + piece_chars] for i in range(first, len(word), piece_chars)]
    return [p for p in pieces if p]


def split_words(text: str) -> list[str]:
    return [m.group(0) for m in _WORD.finditer(text)]


def schedule(sentences: Sequence[str], pacing: Pacing, rng: random.Random) -> tuple[Piece, ...]:
    """Send times of the pieces of `sentences` (first piece at t=0)."""
    pacing.validate()
    out: list[Piece] = []
    t = 0.0
    first = True
    for si, sentence in enumerate(sentences):
        text = sentence if si == 0 else " " + sentence
        if pacing.mode == "llm":
            units, rate = split_pieces(text, pacing.piece_chars), pacing.llm_rate
        else:
            units, rate = split_words(text), pacing.words_per_s
        for u in units:
            if not first:
                t += rng.uniform(1 - pacing.jitter, 1 + pacing.jitter) / rate
                if pacing.pause_prob and rng.random() < pacing.pause_prob:
                    t += pacing.pause_ms / 1000.0
            first = False
            out.append(Piece(t, u, si))
    return tuple(out)


def load_sentences(path: Optional[str]) -> tuple[str, ...]:
    """Built-in sentences, or those of a text file (split at . ! ? and blank lines)."""
    if path is None:
        return BUILTIN_SENTENCES
    text = Path(path).read_text(encoding="utf-8")
    out: list[str] = []
    for para in re.split(r"\n\s*\n|\n", text):
        para = " ".join(para.split())
        if para:
            out += [s.strip() for s in _SENTENCE_END.split(para) if s.strip()]
    if not out:
        raise ValueError(f"{path}: no sentences")
    return tuple(out)


def make_turn(corpus: Sequence[str], n_sentences: int, pacing: Pacing, seed: int) -> Turn:
    """A turn of `n_sentences` consecutive corpus sentences, chosen and timed by `seed`
    (the same seed gives the same text and timing in every mode, for paired comparison)."""
    rng = random.Random(seed)
    start = rng.randrange(len(corpus))
    sentences = tuple(corpus[(start + i) % len(corpus)] for i in range(max(1, n_sentences)))
    return Turn(sentences, schedule(sentences, pacing, rng))
