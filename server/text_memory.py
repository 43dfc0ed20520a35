"""A session's text in the model's text memory (`ModelRunner`): released chunks tokenized
a word a chunk, placed on the session's speech timeline, moved in oldest first,
re-placed as the timeline moves and evicted once they left the np window."""
from __future__ import annotations

from typing import Optional

import numpy as np

from .metrics import Metrics
from .session import EngineSession, Phase

# a cached chunk is re-placed when its timeline position moved at least this far
REPLACE_MIN_FRAMES = 3
# chunks that left the np window are evicted once they hold this many tokens (or when
# the window needs the room for its next word: `fill`): an eviction compacts the slot's
# text memory (~0.3 ms on the 2-core CPU, the same for one word as for many), and the
# window's mask hides them meanwhile, so the step's results are the same
EVICT_MIN_TOKENS = 16


class TextMemory:
    def __init__(self, runner, tokenizer, max_text_tokens: int, metrics: Metrics):
        self.runner = runner
        self._tokenizer = tokenizer
        self._max_text_tokens = max_text_tokens
        self.metrics = metrics

    def release(self, s: EngineSession, chunks) -> None:
        for tc in chunks:
            s.begin_text_chunk()
            for i, word in enumerate(tc.words):
                first = not s.chunks
                ids = self._tokenizer.encode_words([word], first_in_text=first)[: self._max_text_tokens - 1]
                ch = s.register_chunk(word, ids)
                self.metrics.text_tokens_total.inc(len(ids))
                # a client's timestamp is its chunk's first word's; the timeline spaces
                # the words after it
                s.timeline.add(ch.n_chars, s.step_count, tc.client_time_s if i == 0 else None)
        self.fill(s)

    def add_eos(self, s: EngineSession) -> None:
        """The end of the text, once all of it was released."""
        if s.text_complete and not s.eos_added and s.chunks:
            s.begin_text_chunk()
            eos = s.register_chunk(None, [self._tokenizer.eos_id])
            s.timeline.add(eos.n_chars, s.step_count)
            s.guidance.input_complete = True
            s.eos_added = True
            self.fill(s)

    def fill(self, s: EngineSession) -> None:
        """Move chunks into the model's text memory, oldest first. When it is full, the
        chunks that left the np window for good make room at once only for a chunk the
        window needs (`EngineSession.window_needs`); otherwise `evict_past` frees them
        EVICT_MIN_TOKENS at a time: text far ahead of the speech kept memory full, and
        each word the window passed cost an eviction of its own."""
        while s.n_in_memory < len(s.chunks):
            ch = s.chunks[s.n_in_memory]
            if self.runner.text_room(s.slot) < len(ch.token_ids):
                if not s.window_needs(ch):
                    return  # `evict_past` makes room as the speech moves on
                self.runner.evict_chunks_before(s.slot, s.window()[0])
                if self.runner.text_room(s.slot) < len(ch.token_ids):
                    # keep at least the current chunk: drop older ones beyond np
                    cur = s.timeline.current_chunk(s.step_count)
                    self.runner.evict_chunks_before(s.slot, cur)
                if self.runner.text_room(s.slot) < len(ch.token_ids):
                    return  # wait until the speech moves on
            tau = s.timeline.tau(ch.index)
            s.timeline.set_memory_tau(ch.index, tau)
            self.runner.add_chunk(s.slot, ch.token_ids, tau, ch.index)
            s.n_in_memory += 1

    def replace(self, sessions: list[EngineSession], slots: np.ndarray, frames: np.ndarray) -> None:
        """Re-place the chunks the timelines of `sessions` (rows `slots` of one
        `SpeechTimelines`) moved after a step, at their `frames` (each one's step count
        after that step), and the cached chunks among them in the model's memory."""
        if not sessions:
            return
        n = len(sessions)
        table = sessions[0].timeline.table
        spoken = np.fromiter((s.guidance.progress for s in sessions), np.int64, n)
        # the window reaches nf text chunks past the current one and one more may become
        # current: the words of at most nf + 2 text chunks
        horizon = np.fromiter(((s.config.n_future_chunks + 2) * s.config.chunking.max_words for s in sessions),
                              np.int64, n)
        moved = table.replace(slots, spoken, frames, horizon)
        rows = slots[moved.at]
        cached = moved.chunk < np.fromiter((s.n_in_memory for s in sessions), np.int64, n)[moved.at]
        # re-rotating keys costs a call per layer: skip sub-frame-scale drift
        far = cached & (np.abs(moved.tau - table.memory_tau[rows, moved.chunk]) >= REPLACE_MIN_FRAMES)
        if far.any():
            table.memory_tau[rows[far], moved.chunk[far]] = moved.tau[far]
            self.runner.place_chunks(rows[far].tolist(), moved.chunk[far].tolist(), moved.tau[far].tolist())

    def evict_past(self, s: EngineSession, current: Optional[int] = None) -> None:
        """Evict the chunks that left the np window for good (`EVICT_MIN_TOKENS` at a time),
        then fill; current: the session's current chunk, where the caller has it."""
        if s.phase is Phase.ENDED or s.config.n_past_chunks < 0:
            return
        lo = s.window(current)[0]
        if lo > 0 and self.runner.tokens_before(s.slot, lo) >= EVICT_MIN_TOKENS:
            self.runner.evict_chunks_before(s.slot, lo)
        self.fill(s)
