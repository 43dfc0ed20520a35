"""Token pieces -> whole words -> text chunks (docs/design.md, "Token pieces to chunks").

An LLM sends sub-word pieces ("Hel", "lo", ","); BPE of a partial word differs from
the word's, so only whole words leave the chunker. A word is whole once whitespace
follows it, or on flush / end of input. Words are grouped into chunks of up to
`max_words` (the first chunk: `first_max_words`, so speech can start sooner); a chunk
is released early at sentence punctuation, on a client flush, at end of input, when
the speech is waiting for text and `min_words` are pending, or when its words have
waited `timer_ms` for more (the LLM paused): the timer releases a chunk of at least
`min_words`, or any pending words after twice that.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from livespeech.api.session import ChunkingConfig

_PUNCT = (".", ",", "!", "?", ";", ":", "\u2014", "\u2026")


def ends_with_punctuation(word: str) -> bool:
    return word.endswith(_PUNCT)


@dataclass
class TextChunk:
    index: int
    words: list[str]
    arrival_s: float  # when the chunk was released (its last word's arrival or the release)
    client_time_s: Optional[float] = None  # client timestamp of its first word, if given


@dataclass
class Chunker:
    config: ChunkingConfig = field(default_factory=ChunkingConfig)
    _partial: str = ""  # text of a word still being written
    _words: list[str] = field(default_factory=list)
    _first_word_ts: Optional[float] = None
    _partial_ts: Optional[float] = None
    _last_word_at: float = 0.0
    _next_index: int = 0

    @property
    def pending_words(self) -> int:
        return len(self._words)

    def held_words(self) -> list[str]:
        """Words received but not released yet, a word still being written included."""
        return self._words + ([self._partial] if self._partial else [])

    def push(self, text: str, now: float, client_time_s: Optional[float] = None, flush: bool = False) -> list[TextChunk]:
        out: list[TextChunk] = []
        if self._partial == "" and text.strip():
            self._partial_ts = client_time_s
        for ch in text:
            if ch.isspace():
                out += self._end_word(now)
            else:
                if not self._partial:
                    self._partial_ts = client_time_s if client_time_s is not None else self._partial_ts
                self._partial += ch
        if flush:
            out += self.flush(now)
        return out

    @property
    def partial_word(self) -> str:
        """The word still being written (no whitespace after it yet); "" if none."""
        return self._partial

    def flush(self, now: float, partial: bool = True) -> list[TextChunk]:
        """Release every pending word, and the word still being written unless `partial`
        is False (it may be the first piece of a longer word)."""
        out = self._end_word(now) if partial else []
        if self._words:
            out.append(self._release(now))
        return out

    def poll(self, now: float, waiting: bool = False) -> list[TextChunk]:
        """Release words that have waited too long (call periodically), or, while the
        speech waits for text (`waiting`), min_words of them at once."""
        if not self._words:
            return []
        if waiting and self.config.release_when_waiting and len(self._words) >= self.config.min_words:
            return [self._release(now)]
        waited = now - self._last_word_at
        limit = self.config.timer_ms / 1000.0
        if (waited >= limit and len(self._words) >= self.config.min_words) or waited >= 2 * limit:
            return [self._release(now)]
        return []

    def next_deadline(self) -> Optional[float]:
        if not self._words:
            return None
        limit = self.config.timer_ms / 1000.0
        return self._last_word_at + (limit if len(self._words) >= self.config.min_words else 2 * limit)

    def _end_word(self, now: float) -> list[TextChunk]:
        if not self._partial:
            return []
        word, self._partial = self._partial, ""
        if not self._words:
            self._first_word_ts = self._partial_ts
        self._words.append(word)
        self._last_word_at = now
        limit = self.config.first_chunk_words if self._next_index == 0 else self.config.max_words
        if len(self._words) >= limit or (
            self.config.flush_on_punctuation and ends_with_punctuation(word)
        ):
            return [self._release(now)]
        return []

    def _release(self, now: float) -> TextChunk:
        chunk = TextChunk(self._next_index, self._words, now, self._first_word_ts)
        self._next_index += 1
        self._words = []
        self._first_word_ts = None
        return chunk
