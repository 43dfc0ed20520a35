"""A session's text in the model's text memory (`ModelRunner`): released chunks tokenized
a word a chunk, placed on the session's speech timeline, moved in oldest first,
re-placed as the timeline moves and evicted once they left the np window.

What the memory holds of each session is counted in the rows of the speech timelines
(server/timeline.py), so that after a step one compiled pass over the batch finds the
few sessions whose memory has work to do (`TextMemory.due`)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from livespeech.api.session import SessionConfig
from livespeech.models.compiled import compiled
from livespeech.models.graphemes import has_content
from livespeech.models.spoken_form import spoken_words

from .metrics import Metrics
from .session import EngineSession, Phase
from .timeline import SpeechTimelines, Windows, cached_tokens_before

# a cached chunk is re-placed when its timeline position moved at least this far
REPLACE_MIN_FRAMES = 3
# chunks that left the np window are evicted once they hold this many tokens (or when
# the window needs the room for its next word: `fill`): an eviction compacts the slot's
# text memory (~0.3 ms on the 2-core CPU, the same for one word as for many), and the
# window's mask hides them meanwhile, so the step's results are the same
EVICT_MIN_TOKENS = 16


def _due(slots, lo, last_text_chunk, count, n_past, in_memory, first_cached, token_start, tokens, n_tokens,
         text_chunk, capacity, evict_min, out):
    """`TextMemory.due`, row after row."""
    for r in range(len(slots)):
        s = slots[r]
        if n_past[s] < 0:
            out[r] = False
            continue
        n, moved = count[s], in_memory[s]
        evict = lo[r] > 0 and cached_tokens_before(token_start[s], n, tokens[s], first_cached[s], moved,
                                                   lo[r]) >= evict_min
        fill = False
        if moved < n:
            room = capacity - cached_tokens_before(token_start[s], n, tokens[s], first_cached[s], moved, moved)
            fill = room >= n_tokens[s, moved] or text_chunk[s, moved] <= last_text_chunk[r] + 1
        out[r] = evict or fill


_due = compiled(_due)


class TextMemory:
    def __init__(self, runner, tokenizer, max_text_tokens: int, metrics: Metrics, spoken_form: bool = True):
        self.runner = runner
        self._capacity = runner.text_capacity  # tokens a slot
        self._tokenizer = tokenizer
        self._max_text_tokens = max_text_tokens
        self.metrics = metrics
        # the words said for each written one (numbers, symbols, initialisms: models/spoken_form.py)
        self._said = spoken_words if spoken_form else (lambda word: [word])

    def release(self, s: EngineSession, chunks) -> None:
        """The words of released text chunks into the session's transcript and memory, a
        chunk of the memory for each word said (a written "$5" is two: "five dollars")."""
        for tc in chunks:
            s.begin_text_chunk()
            for i, written in enumerate(tc.words):
                said = self._said(written)
                begun = False  # the written word has its first graphemes in the transcript
                for j, word in enumerate(said):
                    first = not s.chunks
                    ids = self._tokenizer.encode_words([word], first_in_text=first)[: self._max_text_tokens - 1]
                    ch = s.register_chunk(word, ids, written, continues=begun)
                    begun = begun or ch.n_chars > 0
                    self.metrics.text_tokens_total.inc(len(ids))
                    # a client's timestamp is its chunk's first word's; the timeline spaces
                    # the words after it
                    s.timeline.add(ch.n_chars, s.step_count, tc.client_time_s if i == j == 0 else None, len(ids))
                if not begun and has_content(written):
                    s.note_unsayable(written)
        self.fill(s)

    def add_eos(self, s: EngineSession) -> None:
        """The end of the text, once all of it was released."""
        if s.text_complete and not s.eos_added and s.chunks:
            s.begin_text_chunk()
            eos = s.register_chunk(None, [self._tokenizer.eos_id])
            s.timeline.add(eos.n_chars, s.step_count, n_tokens=len(eos.token_ids))
            s.guidance.input_complete = True
            s.eos_added = True
            self.fill(s)

    def fill(self, s: EngineSession) -> None:
        """Move chunks into the model's text memory, oldest first. When it is full, the
        chunks that left the np window for good make room at once only for a chunk the
        window needs (`EngineSession.window_needs`); otherwise `evict_past` frees them
        EVICT_MIN_TOKENS at a time: text far ahead of the speech kept memory full, and
        each word the window passed cost an eviction of its own."""
        timeline = s.timeline
        while s.n_in_memory < len(s.chunks):
            ch = s.chunks[s.n_in_memory]
            if self._room(s) < len(ch.token_ids):
                if not s.window_needs(ch):
                    return  # `evict_past` makes room as the speech moves on
                self._evict_before(s, s.window()[0])
                if self._room(s) < len(ch.token_ids):
                    # keep at least the current chunk: drop older ones beyond np
                    self._evict_before(s, timeline.current_chunk(s.step_count))
                if self._room(s) < len(ch.token_ids):
                    return  # wait until the speech moves on
            tau = timeline.tau(ch.index)
            timeline.set_memory_tau(ch.index, tau)
            self.runner.add_chunk(s.slot, ch.token_ids, tau, ch.index)
            timeline.moved_in()

    def _room(self, s: EngineSession) -> int:
        return self._capacity - s.timeline.cached_tokens()

    def _evict_before(self, s: EngineSession, chunk: int) -> None:
        self.runner.evict_chunks_before(s.slot, chunk)
        s.timeline.evicted_before(chunk)

    @staticmethod
    def replace_horizon(config: SessionConfig) -> int:
        """The chunks a session's `replace` re-places at most: the window reaches nf text
        chunks past the current one and one more may become current, the words of at
        most nf + 2 text chunks (later ones are placed when they come within reach)."""
        return (config.n_future_chunks + 2) * config.chunking.max_words

    def replace(self, table: SpeechTimelines, slots: np.ndarray, frames: np.ndarray, spoken: np.ndarray) -> None:
        """Re-place the chunks that rows `slots` of `table` (bound with `replace_horizon`)
        moved after a step, given their progress (`spoken` transcript characters) by
        their `frames` (each one's step count after that step), and the cached chunks
        among them in the model's memory."""
        if not len(slots):
            return
        moved = table.replace(slots, spoken, frames, table.horizon[slots])
        rows = slots[moved.at]
        cached = moved.chunk < table.in_memory[rows]
        # re-rotating keys costs a call per layer: skip sub-frame-scale drift
        far = cached & (np.abs(moved.tau - table.memory_tau[rows, moved.chunk]) >= REPLACE_MIN_FRAMES)
        if far.any():
            table.memory_tau[rows[far], moved.chunk[far]] = moved.tau[far]
            self.runner.place_chunks(rows[far], moved.chunk[far], moved.tau[far])

    def due(self, table: SpeechTimelines, slots: np.ndarray, windows: Windows) -> np.ndarray:
        """Whether `evict_past` has work to do for each of `slots` (rows of `table`; one
        compiled pass), given their np/nf windows (`SpeechTimelines.windows`): chunks that
        left the window to evict, or a chunk that `fill` would move in (room for it, or
        the window needs it). A session for which it is False may skip `evict_past`."""
        out = np.empty(len(slots), bool)
        _due(slots, windows.lo, windows.last_text_chunk, table.count, table.n_past, table.in_memory,
             table.first_cached, table.token_start, table.tokens, table.n_tokens, table.text_chunk,
             self._capacity, EVICT_MIN_TOKENS, out)
        return out

    def evict_past(self, s: EngineSession, lo: Optional[int] = None) -> None:
        """Evict the chunks that left the np window for good (`EVICT_MIN_TOKENS` at a time),
        then fill; lo: the first chunk of the session's window, where the caller has it."""
        if s.phase is Phase.ENDED or s.config.n_past_chunks < 0:
            return
        if lo is None:
            lo = s.window()[0]
        if lo > 0 and s.timeline.tokens_before(lo) >= EVICT_MIN_TOKENS:
            self._evict_before(s, lo)
        self.fill(s)
