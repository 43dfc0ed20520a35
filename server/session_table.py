"""The per-step state of an engine's sessions, a row a slot (`SessionTable`).

What the engine reads and writes of every session at every step (its phase, step count,
progress, pending frames, the audio its listener holds, the start policy's and the
runaway guard's inputs) lives in arrays, so that the bookkeeping around a decode step runs
for the whole batch in a few numpy and compiled passes (server/engine.py) rather than in
Python a session: at 256 sessions that walk cost ~2-3 ms of the engine thread a step
(docs/loadtest.md, "What holds now"). The rules that read these fields (the start policy,
the run-out, the runaway guard) are compiled loops over rows, and a session asking about
itself (server/session.py) runs the same loop over its one row.

A session's fields are its row of the engine's table once the engine binds it to its slot
(`bind`); before that and after its end (`unbind`) they are the one row of a table of its
own, so that an ended session never reads the row a later session took.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import numpy as np

from livespeech.models.compiled import compiled
from livespeech.models.config import FRAME_RATE

from .timeline import _current_chunk as _current_chunk_c  # compiled, inlined into the rules below

if TYPE_CHECKING:
    from livespeech.api.session import SessionConfig

    from .session import SessionLimits
    from .timeline import SpeechTimelines

# `SessionTable.phase` codes (`Phase` in server/session.py names them)
WAITING, RUNNING, ENDED = 0, 1, 2

# the start policy's verdicts (`start_verdicts`): READY_IF_LETTERS_LAID where the letter
# schedule is left out and would have the last word; ASK where the schedule must first
# lay letters the speech reached (Python: `EngineSession.lookahead_ready`)
NOT_READY, READY, READY_IF_LETTERS_LAID, ASK = 0, 1, 2, 3

NEVER = np.iinfo(np.int64).max  # a `words_mark` no progress reaches

# name: (dtype, value of a new session's row)
_FIELDS = {
    "phase": (np.int8, WAITING),
    "step_count": (np.int64, 0),
    "frames_done": (np.int64, 0),  # frames handed to the codec
    "n_pending": (np.int64, 0),  # completed frames waiting for the codec (`pending`)
    "clocked": (np.bool_, False),  # past the packet ramp: full packets on the packet clock
    "done_decoding": (np.bool_, False),
    "first_packet_at": (np.float64, np.nan),  # monotonic seconds; NaN: none yet
    "audio_sent_s": (np.float64, 0.0),
    "compute_s": (np.float64, 0.0),
    # the guidance progress, and the step it last changed at
    "last_progress": (np.int64, 0),
    "progress_step": (np.int64, 0),
    # the transcript length the grapheme stream last covered, and the step it did; -1: none yet
    "covered_chars": (np.int64, -1),
    "covered_step": (np.int64, 0),
    "n_chars": (np.int64, 0),  # the collapsed transcript's length so far
    "eos_added": (np.bool_, False),
    # the transcript length whose audio the speech finishes without more text; -1: none
    "run_out_chars": (np.int64, -1),
    # chunks up to this index are spoken without waiting for their lookahead
    "lookahead_waived_through": (np.int64, -1),
    # the progress from which `EngineSession.track_words` has a word's timing to set
    "words_mark": (np.int64, 0),
    # settings from the session's config and the engine's limits (`configure`)
    "packet_frames": (np.int64, 1),
    "start_future_chunks": (np.int64, 0),
    "audio_lag_frames": (np.int64, 0),  # graphemes lead the audio by this (the codebook delays)
    "run_out_tail": (np.int64, 0),
    "max_steps": (np.float64, np.inf),
    "overrun_steps": (np.float64, np.inf),
    "has_letters": (np.bool_, False),  # a letter schedule (models/front_end.py)
    "letters_frames": (np.int64, 0),  # the frames its letters are laid on (`LetterSchedule.n_frames`)
}
FIELDS = tuple(_FIELDS)


def _running_out(run_out_chars, n_chars, covered_chars, eos_added, step, covered_step, lag, tail):
    """`EngineSession.running_out` of one row."""
    if run_out_chars != n_chars or covered_chars != n_chars or eos_added:
        return False
    return step < covered_step + 1 + lag + tail


def _start_verdicts(rows, tl_rows, in_memory, count, tau, fixed_tau_max, fixed_below, text_chunk, n_future,
                    start_future, eos_added, covered_chars, n_chars, run_out_chars, step_count, covered_step, lag,
                    tail, waived_through, has_letters, letters_frames, use_letters, out):
    """`EngineSession.lookahead_ready` of each row (its timeline's row in `tl_rows`): with
    `use_letters`, ASK for a row whose letter schedule must lay letters first (the
    speech reached its last letter laid); without, READY_IF_LETTERS_LAID where the
    schedule would have the last word. While the speech is before its last letter laid
    the schedule lays nothing and lets it step."""
    for r in range(len(rows)):
        s, t = rows[r], tl_rows[r]
        n = in_memory[t]
        if n == 0:
            out[r] = NOT_READY
            continue
        if use_letters and has_letters[s] and step_count[s] >= letters_frames[s]:
            out[r] = ASK
            continue
        if eos_added[s]:
            out[r] = READY
            continue
        if covered_chars[s] == n_chars[s]:
            out[r] = READY if _running_out_c(run_out_chars[s], n_chars[s], covered_chars[s], eos_added[s],
                                             step_count[s], covered_step[s], lag[s], tail[s]) else NOT_READY
            continue
        # the chunk of the audio: of the last frame complete in every codebook
        c = _current_chunk_c(tau[t], fixed_tau_max[t], fixed_below[t], count[t], max(0, step_count[s] - lag[s]))
        k = text_chunk[t, c]
        last = text_chunk[t, n - 1]
        # the text chunks wholly in memory
        whole = last + (1 if n == count[t] or text_chunk[t, n] != last else 0)
        if c > waived_through[s] and whole - 1 < k + min(n_future[t], start_future[s] + k):
            out[r] = NOT_READY
        else:
            out[r] = READY if use_letters else READY_IF_LETTERS_LAID


def _runaway(rows, tl_rows, step_count, max_steps, eos_added, overrun, progress_step, count, fixed, placed_through,
             tau, out):
    """`SessionTable.runaway`, row after row (its timeline's row in `tl_rows`)."""
    for r in range(len(rows)):
        s, t = rows[r], tl_rows[r]
        step = step_count[s]
        if step >= max_steps[s]:
            out[r] = True
            continue
        if not eos_added[s]:
            out[r] = False
            continue
        # the last chunk's tau while it is up to date (`SpeechTimelines.last_tau`)
        last = count[t] - 1
        known = last >= 0 and (fixed[t, last] or last <= placed_through[t])
        out[r] = (known and step > tau[t, last] + overrun[s]) or step - progress_step[s] > overrun[s]


def _book(rows, progress, has_frame, frames, done, step_count, last_progress, progress_step, n_chars, covered_chars,
          covered_step, words_mark, n_pending, pending, done_decoding, track):
    """`SessionTable.book_step`, row after row."""
    for r in range(len(rows)):
        s, p = rows[r], progress[r]
        step = step_count[s]
        if p != last_progress[s]:
            last_progress[s], progress_step[s] = p, step
        if p >= n_chars[s] and covered_chars[s] != n_chars[s]:
            covered_chars[s], covered_step[s] = n_chars[s], step
        track[r] = p >= words_mark[s]
        step_count[s] = step + 1
        if has_frame[r]:
            k = n_pending[s]
            for q in range(frames.shape[1]):
                pending[s, k, q] = frames[r, q]
            n_pending[s] = k + 1
        if done[r]:
            done_decoding[s] = True


_running_out_c = compiled(_running_out, inline="always")
running_out = compiled(_running_out)
_start_verdicts = compiled(_start_verdicts)
_runaway = compiled(_runaway)
_book = compiled(_book)


class SessionTable:
    """The `FIELDS` of `rows` sessions, an array each, and their pending frames: `pending`
    [rows, capacity, codebooks], each row's oldest first (its first `n_pending`)."""

    def __init__(self, rows: int, codebooks: int = 0, free: bool = True) -> None:
        for name, (dtype, value) in _FIELDS.items():
            setattr(self, name, np.full(rows, value, dtype))
        if free:
            self.phase[:] = ENDED  # a row no session holds
        self.pending = np.zeros((rows, 8, codebooks), np.int64)

    @classmethod
    def of_one(cls, config: "SessionConfig", limits: "SessionLimits", audio_lag_frames: int) -> "SessionTable":
        """A new session's own row (row 0), with its settings."""
        t = cls(1, free=False)
        t.configure(0, config, limits, audio_lag_frames)
        return t

    def configure(self, row: int, config: "SessionConfig", limits: "SessionLimits", audio_lag_frames: int) -> None:
        self.packet_frames[row] = frames_for_ms(config.packet_ms)
        self.start_future_chunks[row] = config.start_future_chunks
        self.audio_lag_frames[row] = audio_lag_frames
        # the run-out's tail: the shortest packet's frames and one, so neither the
        # encoder's shortest packet nor the resampler's look-ahead holds audio back
        self.run_out_tail[row] = math.ceil(config.min_packet_ms * FRAME_RATE / 1000) + 1
        self.max_steps[row] = limits.max_session_s * FRAME_RATE
        self.overrun_steps[row] = limits.max_overrun_s * FRAME_RATE

    def compile_rules(self, timelines: "SpeechTimelines") -> None:
        """Compile the rules for this table's arrays now: numba compiles at a function's
        first call (~1.3 s in a fresh process on the 2-core VM, where no cache is kept
        yet), which must not fall on a session's first audio."""
        none = np.zeros(0, np.int64)
        self.start_verdicts(none, timelines)
        self.runaway(none, timelines)
        self.book_step(none, none, np.zeros(0, np.bool_), np.zeros((0, self.pending.shape[2]), np.int64),
                       np.zeros(0, np.bool_))
        running_out(self.run_out_chars[0], self.n_chars[0], self.covered_chars[0], self.eos_added[0],
                    self.step_count[0], self.covered_step[0], self.audio_lag_frames[0], self.run_out_tail[0])

    # --- a session's row ---------------------------------------------------------------
    def bind(self, slot: int, own: "SessionTable") -> None:
        """Slot `slot`'s row takes over a session's own row (`of_one`)."""
        for name in FIELDS:
            getattr(self, name)[slot] = getattr(own, name)[0]
        n = int(own.n_pending[0])
        if n:
            self._fit(n, own.pending.shape[2])
            self.pending[slot, :n] = own.pending[0, :n]

    def unbind(self, slot: int) -> "SessionTable":
        """A session's row, as its own table from now on; the slot's row is free."""
        own = SessionTable(1, self.pending.shape[2], free=False)
        for name in FIELDS:
            getattr(own, name)[0] = getattr(self, name)[slot]
        n = int(self.n_pending[slot])
        own._fit(n, self.pending.shape[2])
        own.pending[0, :n] = self.pending[slot, :n]
        self.phase[slot] = ENDED
        self.n_pending[slot] = 0
        return own

    def _fit(self, frames: int, codebooks: int) -> None:
        """Room for `frames` pending frames of `codebooks` codes a row (a table made
        without a width takes the first frames')."""
        rows, capacity, width = self.pending.shape
        if width and codebooks != width:
            raise ValueError(f"frames of {codebooks} codes for rows of {width}")
        if frames > capacity or codebooks != width:  # rare: the rows double
            grown = np.zeros((rows, max(capacity, 1 << max(frames - 1, 0).bit_length()), codebooks), np.int64)
            grown[:, :capacity] = self.pending
            self.pending = grown

    # --- rows of a batch ---------------------------------------------------------------
    def audio_ahead_s(self, rows, now: float):
        """Seconds of audio each row's listener has buffered (sent, less played since the
        first packet; 0 before it): an array for an array of rows, a float for one row."""
        first = self.first_packet_at[rows]
        if isinstance(rows, (int, np.integer)):
            return 0.0 if first != first else float(self.audio_sent_s[rows] - (now - first))
        return np.where(np.isnan(first), 0.0, self.audio_sent_s[rows] - (now - first))

    def start_verdicts(self, rows: np.ndarray, timelines: "SpeechTimelines", tl_rows: Optional[np.ndarray] = None,
                       letters: bool = True) -> np.ndarray:
        """The start policy of each row (`EngineSession.lookahead_ready`), its timeline in
        row `tl_rows` of `timelines` (default: `rows`): NOT_READY, READY, or, with
        `letters`, ASK where its letter schedule must lay letters first; without,
        READY_IF_LETTERS_LAID where the schedule would have the last word."""
        out = np.empty(len(rows), np.int8)
        tl = timelines
        _start_verdicts(rows, rows if tl_rows is None else tl_rows, tl.in_memory, tl.count, tl.tau, tl.fixed_tau_max,
                        tl.fixed_below, tl.text_chunk, tl.n_future, self.start_future_chunks, self.eos_added,
                        self.covered_chars, self.n_chars, self.run_out_chars, self.step_count, self.covered_step,
                        self.audio_lag_frames, self.run_out_tail, self.lookahead_waived_through, self.has_letters,
                        self.letters_frames, letters, out)
        return out

    def runaway(self, rows: np.ndarray, timelines: "SpeechTimelines",
                tl_rows: Optional[np.ndarray] = None) -> np.ndarray:
        """The runaway guard of each row, its timeline as in `start_verdicts`: once the
        text is complete, speech running past the (re-placed) end of the text, or without
        transcript progress for a while, ends with EOS; and any speech at the longest
        session's length."""
        out = np.empty(len(rows), np.bool_)
        tl = timelines
        _runaway(rows, rows if tl_rows is None else tl_rows, self.step_count, self.max_steps, self.eos_added,
                 self.overrun_steps, self.progress_step, tl.count, tl.fixed, tl.placed_through, tl.tau, out)
        return out

    def book_step(self, rows: np.ndarray, progress: np.ndarray, has_frame: np.ndarray, frames: np.ndarray,
                  done: np.ndarray) -> np.ndarray:
        """Book a step of `rows`, in one compiled pass: each row's guidance progress after it
        (when it last changed, and the step the stream first covered all the text so
        far: progress can step back after errors, and the speech stops at the text all the
        same, where a run-out would otherwise go on while a babbling stream keeps moving
        its progress), its step count moved on, its completed frame's codes (where
        `has_frame`) appended to its pending frames, whether its last frame was emitted
        (`done`). Returns the rows whose progress reached their `words_mark`: their word
        timings change at this step's frame (`EngineSession.track_words`)."""
        self._fit(int(self.n_pending.max()) + 1, frames.shape[1])
        track = np.empty(len(rows), np.bool_)
        _book(rows, progress, has_frame, frames, done, self.step_count, self.last_progress, self.progress_step,
              self.n_chars, self.covered_chars, self.covered_step, self.words_mark, self.n_pending, self.pending,
              self.done_decoding, track)
        return track

    def take_frames(self, rows: np.ndarray, n: int) -> np.ndarray:
        """The oldest `n` pending frames of each row, [rows, n, codebooks], off its pending
        frames and onto its frames done."""
        taken = self.pending[rows, :n]
        self.pending[rows, : self.pending.shape[1] - n] = self.pending[rows, n:]
        self.n_pending[rows] -= n
        self.frames_done[rows] += n
        return taken


def frames_for_ms(ms: float) -> int:
    """The frames that last at least `ms` (at least one)."""
    return max(1, math.ceil(ms * FRAME_RATE / 1000))
