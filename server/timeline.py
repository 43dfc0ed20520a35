"""Chunk positions on the speech timeline (docs/design.md, "Chunks to speech time").

The model was trained with tau_i = the frame where chunk i's speech starts. An LLM
sends text much faster than it is spoken, so arrival times would cram the speech;
instead a chunk is placed no earlier than its arrival and no earlier than where the
speech of the chunks before it should end. Once speech runs, the model's own grapheme
progress (how many transcript characters have been spoken) re-places the chunks not
yet reached, the next few at each step (`SpeechTimelines.replace`): the next chunk
starts where the current one's remaining characters end, at the speaking rate measured
so far. Clients whose timestamps already are speech time (e.g. a streaming translator)
set the positions themselves.

The timelines of an engine's slots are rows of per-chunk arrays (`SpeechTimelines`), so
that a step re-places the chunks of all the sessions it stepped, and finds their current
chunks, in one compiled loop over the batch (models/compiled.py) instead of a walk in
Python a session. A session holds its row as a `SpeechTimeline`; one made on its own
has a table of one row.

The table also maps each chunk to the released text chunk it belongs to and counts what
the model's text memory holds of a row, so that the np/nf windows of a batch
(`SpeechTimelines.windows`) and the text memory's work after a step
(server/text_memory.py) come from arrays as well.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from livespeech.models.attention import window_chunk_range
from livespeech.models.compiled import compiled, first_at_least
from livespeech.models.config import FRAME_RATE

DEFAULT_FRAMES_PER_CHAR = FRAME_RATE / 14.0  # ~14 characters/s of conversational speech


def _current_chunk(tau, fixed_tau_max, fixed_below, n, frame):
    """`models.attention.current_chunk` of one row at `frame` (the last chunk whose tau <=
    frame, the walk stopping at the first later one; 0 before the first), without walking
    the chunks already spoken: the walk passes fixed chunk i iff the running maximum of
    the fixed taus through i is <= frame, so a bisection finds how far it gets through
    the fixed chunks, and only the few chunks after those are walked."""
    lo, hi = 0, fixed_below
    while lo < hi:
        mid = (lo + hi) // 2
        if fixed_tau_max[mid] <= frame:
            lo = mid + 1
        else:
            hi = mid
    k, current = lo, max(lo - 1, 0)
    while k < n and tau[k] <= frame:
        current, k = k, k + 1
    return current


def _current_chunks(slots, frames, count, fixed_below, fixed_tau_max, tau, out):
    for r in range(len(slots)):
        s = slots[r]
        out[r] = _current_chunk(tau[s], fixed_tau_max[s], fixed_below[s], count[s], frames[r])


def _replace_rows(slots, spoken, frames, horizon, count, frames_per_char, fixed_below, placed_through,
                  char_start, n_chars, tau, fixed, fixed_tau_max, moved):
    """`SpeechTimelines.replace`, row after row: the chunks it moves go to `moved` (rows of
    position in `slots`, chunk, new tau), whose count it returns."""
    m = 0
    for r in range(len(slots)):
        s, spoken_chars, frame = slots[r], spoken[r], frames[r]
        n = count[s]
        if n == 0:
            continue
        fpc = frames_per_char[s]
        if spoken_chars > 0 and frame > 0:
            # running estimate of the speaking rate, kept within a sane range
            fpc = min(12.0, max(3.0, 0.9 * fpc + 0.1 * (frame / spoken_chars)))
            frames_per_char[s] = fpc
        # the chunk being spoken: the last whose first character was reached
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) // 2
            if char_start[s, mid] <= spoken_chars:
                lo = mid + 1
            else:
                hi = mid
        cur = max(lo - 1, 0)
        for i in range(fixed_below[s], cur + 1):
            if not fixed[s, i] and i > 0 and tau[s, i] > frame:
                tau[s, i] = frame  # speech reached it early: it starts now
                moved[m, 0], moved[m, 1], moved[m, 2] = r, i, frame
                m += 1
            fixed[s, i] = fixed[s, i] or tau[s, i] <= frame
        b = fixed_below[s]
        while b < n and fixed[s, b]:
            fixed_tau_max[s, b] = tau[s, b] if b == 0 else max(tau[s, b], fixed_tau_max[s, b - 1])
            b += 1
        fixed_below[s] = b
        expected = frame + max(0, char_start[s, cur] + n_chars[s, cur] - spoken_chars) * fpc
        i, moving = cur + 1, 0
        while i < n and moving < horizon[r]:
            if fixed[s, i]:
                expected = tau[s, i] + n_chars[s, i] * fpc
            else:
                t = max(int(round(expected)), frame + 1)
                if t != tau[s, i]:
                    tau[s, i] = t
                    moved[m, 0], moved[m, 1], moved[m, 2] = r, i, t
                    m += 1
                expected = t + n_chars[s, i] * fpc
                moving += 1
            i += 1
        placed_through[s] = i - 1
    return m


def _window(text_chunk, n, text_chunks, in_memory, n_past, n_future, current):
    """The np/nf window of one row at its current chunk: (its first chunk, its last chunk
    in the model's memory, its last text chunk); (0, -1, -1) without chunks. The window
    shows the chunks of the np text chunks before the current chunk's and of the nf after
    it (`models.attention.window_chunk_range`; n_past < 0: unbounded)."""
    if n == 0:
        return 0, -1, -1
    first, last = _window_chunk_range(text_chunk[current], n_past, n_future, text_chunks)
    lo = first_at_least(text_chunk, n, first)
    end = first_at_least(text_chunk, n, last + 1)
    return lo, min(end, in_memory) - 1, last


def _windows(slots, current, count, text_chunks, in_memory, n_past, n_future, text_chunk, lo, hi, last):
    for r in range(len(slots)):
        s = slots[r]
        lo[r], hi[r], last[r] = _window(text_chunk[s], count[s], text_chunks[s], in_memory[s], n_past[s],
                                        n_future[s], current[r])


def cached_tokens_before(token_start, n, tokens, first_cached, in_memory, chunk):
    """The tokens of one row's cached chunks before `chunk`: the memory holds chunks
    first_cached .. in_memory - 1, in order."""
    a, b = first_cached, min(chunk, in_memory)
    if b <= a:
        return 0
    return (token_start[b] if b < n else tokens) - token_start[a]


_current_chunk = compiled(_current_chunk, inline="always")
_current_chunks = compiled(_current_chunks)
_replace_rows = compiled(_replace_rows)
_window_chunk_range = compiled(window_chunk_range, inline="always")
_window = compiled(_window, inline="always")
_windows = compiled(_windows)
cached_tokens_before = compiled(cached_tokens_before, inline="always")


class Replaced(NamedTuple):
    """The chunks a `SpeechTimelines.replace` moved, each row's in chunk order: the position
    of its slot in the call's `slots`, the chunk, its new tau."""
    at: np.ndarray
    chunk: np.ndarray
    tau: np.ndarray


class Windows(NamedTuple):
    """The np/nf windows of a batch's rows (`SpeechTimelines.windows`): each row's first
    chunk, its last chunk in the model's memory (lo > hi: none) and its last text chunk."""
    lo: np.ndarray
    hi: np.ndarray
    last_text_chunk: np.ndarray


class SpeechTimelines:
    """The chunks' first frames of `slots` timelines, a row each (see the module docstring).

    Per chunk: its first character in the (collapsed) transcript, its characters, its tau,
    whether it is fixed (client-supplied speech time, or already being spoken), the
    running maximum of the fixed chunks' taus through it (a fixed chunk's tau never
    changes), the tau the model's text memory last placed its keys at (`memory_tau`,
    server/text_memory.py's), the released text chunk it belongs to, and its tokens
    (where they start in the row's text, how many). Per row: its chunk count, the speaking
    rate measured so far, the first chunk not fixed (every one before it is), the last
    chunk the last `replace` brought up to date (and the most chunks it moves), its text
    chunks and tokens so far, its np/nf window's sizes, and the chunks in the model's
    memory (those before `in_memory` were moved in, in order; those from `first_cached`
    on are still there). The rows are as wide as the longest needs: when one fills, all
    double (`bind` narrows them again)."""

    def __init__(self, slots: int, chunks: int = 64) -> None:
        self.count = np.zeros(slots, np.int64)
        self.frames_per_char = np.full(slots, DEFAULT_FRAMES_PER_CHAR)
        self.client_speech_time = np.zeros(slots, bool)
        self.fixed_below = np.zeros(slots, np.int64)
        self.placed_through = np.full(slots, -1, np.int64)
        self.text_chunks = np.zeros(slots, np.int64)
        self.tokens = np.zeros(slots, np.int64)
        self.n_past = np.full(slots, -1, np.int64)  # -1: unbounded
        self.n_future = np.zeros(slots, np.int64)
        self.horizon = np.full(slots, 10, np.int64)
        self.in_memory = np.zeros(slots, np.int64)
        self.first_cached = np.zeros(slots, np.int64)
        self.width, self._min_width = 0, chunks
        self._allocate(slots, chunks)
        self._moved = np.zeros((64, 3), np.int64)

    def _allocate(self, slots: int, width: int) -> None:
        """Rows `width` chunks wide, keeping the chunks there are (fewer than `width`)."""
        kept, self.width = min(self.width, width), width
        # 33 bytes a chunk a row, every row as wide as the most chunks a session has had: a
        # session of 100,000 characters (the default limit; ~20,000 words) widens 16 rows
        # to ~17 MB, 256 rows to ~280 MB
        for name, dtype in (("char_start", np.int32), ("n_chars", np.int32), ("tau", np.int32), ("fixed", bool),
                            ("fixed_tau_max", np.int32), ("memory_tau", np.int32), ("text_chunk", np.int32),
                            ("token_start", np.int32), ("n_tokens", np.int32)):
            a = np.zeros((slots, width), dtype)
            if kept:
                a[:, :kept] = getattr(self, name)[:, :kept]
            setattr(self, name, a)

    def bind(self, slot: int, client_speech_time: bool = False,
             frames_per_char: float = DEFAULT_FRAMES_PER_CHAR, n_past: int = -1, n_future: int = 0,
             horizon: int = 10) -> "SpeechTimeline":
        """Slot `slot`'s row, emptied, for a new session with an np/nf window of `n_past`
        (-1: unbounded) and `n_future` text chunks, whose `replace` re-places `horizon`
        chunks at most. Rows a long session widened narrow again once no row needs a
        quarter of their width."""
        self.count[slot] = self.fixed_below[slot] = 0
        self.text_chunks[slot] = self.tokens[slot] = self.in_memory[slot] = self.first_cached[slot] = 0
        self.n_past[slot], self.n_future[slot], self.horizon[slot] = n_past, n_future, horizon
        most = int(self.count.max())
        if self.width > self._min_width and 4 * most <= self.width:
            self._allocate(len(self.count), max(self._min_width, 1 << max(most - 1, 0).bit_length()))
        self.placed_through[slot] = -1
        self.frames_per_char[slot] = frames_per_char
        self.client_speech_time[slot] = client_speech_time
        self.fixed[slot] = False
        return SpeechTimeline(table=self, slot=slot)

    # --- one slot ----------------------------------------------------------------------
    def text_chars(self, slot: int) -> int:
        """The characters of the slot's chunks."""
        n = int(self.count[slot])
        return int(self.char_start[slot, n - 1] + self.n_chars[slot, n - 1]) if n else 0

    def begin_text_chunk(self, slot: int) -> None:
        """The chunks added next belong to the slot's next released text chunk."""
        self.text_chunks[slot] += 1

    def add(self, slot: int, n_chars: int, arrival_frame: int, client_time_s: Optional[float] = None,
            n_tokens: int = 0) -> int:
        """Place a new chunk of the current text chunk, with `n_tokens` tokens in the model's
        memory; returns its tau."""
        n = int(self.count[slot])
        if n == self.width:
            self._allocate(len(self.count), 2 * self.width)
        start = self.text_chars(slot)
        fixed = False
        if self.client_speech_time[slot] and client_time_s is not None:
            tau = max(int(round(client_time_s * FRAME_RATE)), int(self.tau[slot, n - 1]) if n else 0)
            fixed = True
        elif n:
            prev_chars = int(self.n_chars[slot, n - 1])
            natural_end = int(self.tau[slot, n - 1]) + int(round(prev_chars * float(self.frames_per_char[slot])))
            tau = max(arrival_frame, natural_end)
        else:
            tau = 0
        self.char_start[slot, n], self.n_chars[slot, n], self.tau[slot, n] = start, n_chars, tau
        self.fixed[slot, n] = fixed
        self.text_chunk[slot, n] = self.text_chunks[slot] - 1
        self.token_start[slot, n], self.n_tokens[slot, n] = self.tokens[slot], n_tokens
        self.tokens[slot] += n_tokens
        self.count[slot] = n + 1
        return tau

    def current_chunk(self, slot: int, frame: int) -> int:
        """`current_chunks` of one slot."""
        return _current_chunk(self.tau[slot], self.fixed_tau_max[slot], int(self.fixed_below[slot]),
                              int(self.count[slot]), frame)

    def window(self, slot: int, current: int) -> tuple[int, int, int]:
        """`windows` of one slot."""
        return _window(self.text_chunk[slot], int(self.count[slot]), int(self.text_chunks[slot]),
                       int(self.in_memory[slot]), int(self.n_past[slot]), int(self.n_future[slot]), current)

    def tokens_before(self, slot: int, chunk: int) -> int:
        """The tokens of the slot's chunks before `chunk` still in the model's memory."""
        return int(cached_tokens_before(self.token_start[slot], int(self.count[slot]), int(self.tokens[slot]),
                                        int(self.first_cached[slot]), int(self.in_memory[slot]), chunk))

    def cached_tokens(self, slot: int) -> int:
        """The tokens of the slot's chunks in the model's memory."""
        return self.tokens_before(slot, int(self.in_memory[slot]))

    def moved_in(self, slot: int) -> None:
        """The slot's next chunk went into the model's memory."""
        self.in_memory[slot] += 1

    def evicted_before(self, slot: int, chunk: int) -> None:
        """The model's memory dropped the slot's chunks before `chunk`."""
        self.first_cached[slot] = max(self.first_cached[slot], min(chunk, self.in_memory[slot]))

    def last_tau(self, slot: int) -> Optional[int]:
        """The last chunk's tau if it is up to date (fixed, or re-placed by the last
        `replace`); None while it lies beyond the re-placed chunks, that is, after the
        speech's next chunks (where its up-to-date tau is later than the frame)."""
        last = int(self.count[slot]) - 1
        if last < 0 or not (self.fixed[slot, last] or last <= self.placed_through[slot]):
            return None
        return int(self.tau[slot, last])

    # --- a batch of slots --------------------------------------------------------------
    def current_chunks(self, slots: np.ndarray, frames: np.ndarray) -> np.ndarray:
        """Each slot's current chunk at its frame (`_current_chunk`)."""
        out = np.empty(len(slots), np.int64)
        _current_chunks(slots, frames, self.count, self.fixed_below, self.fixed_tau_max, self.tau, out)
        return out

    def windows(self, slots: np.ndarray, current: np.ndarray) -> Windows:
        """Each slot's np/nf window at its current chunk (`_window`)."""
        lo, hi, last = (np.empty(len(slots), np.int64) for _ in range(3))
        _windows(slots, current, self.count, self.text_chunks, self.in_memory, self.n_past, self.n_future,
                 self.text_chunk, lo, hi, last)
        return Windows(lo, hi, last)

    def replace(self, slots: np.ndarray, spoken: np.ndarray, frames: np.ndarray,
                horizon: np.ndarray) -> Replaced:
        """Re-place the chunks the speech has not reached, in each of `slots`, given that
        `spoken` transcript characters were spoken by `frames`: the next `horizon` chunks
        that move (the np/nf window needs at most nf + 1 of them; later ones are placed
        when they come within reach). A chunk the speech reached early starts at once; a
        chunk being spoken is fixed. A row without chunks is left as it is."""
        most = int((self.count[slots] - self.fixed_below[slots]).sum())  # each chunk moves once at most
        if most > len(self._moved):
            self._moved = np.zeros((max(most, 2 * len(self._moved)), 3), np.int64)
        m = _replace_rows(slots, spoken, frames, horizon, self.count, self.frames_per_char, self.fixed_below,
                          self.placed_through, self.char_start, self.n_chars, self.tau, self.fixed,
                          self.fixed_tau_max, self._moved)
        moved = self._moved[:m]
        return Replaced(moved[:, 0].copy(), moved[:, 1].copy(), moved[:, 2].copy())


class SpeechTimeline:
    """One session's timeline: its row of a `SpeechTimelines` (`SpeechTimelines.bind`), or,
    made on its own, the one row of a table of its own."""

    def __init__(self, frames_per_char: float = DEFAULT_FRAMES_PER_CHAR, client_speech_time: bool = False,
                 n_past: int = -1, n_future: int = 0, *, table: Optional[SpeechTimelines] = None,
                 slot: int = 0) -> None:
        if table is None:
            table = SpeechTimelines(1, chunks=8)
            table.bind(0, client_speech_time, frames_per_char, n_past, n_future)
        self.table, self.slot = table, slot

    @property
    def frames_per_char(self) -> float:
        return float(self.table.frames_per_char[self.slot])

    @property
    def n_chars(self) -> int:
        return self.table.text_chars(self.slot)

    @property
    def taus(self) -> list[int]:
        return self.table.tau[self.slot, : self.table.count[self.slot]].tolist()

    @property
    def placed_through(self) -> int:
        return int(self.table.placed_through[self.slot])

    def tau(self, chunk: int) -> int:
        return int(self.table.tau[self.slot, chunk])

    def set_memory_tau(self, chunk: int, tau: int) -> None:
        self.table.memory_tau[self.slot, chunk] = tau

    @property
    def in_memory(self) -> int:
        return int(self.table.in_memory[self.slot])

    @property
    def text_chunks(self) -> int:
        return int(self.table.text_chunks[self.slot])

    def begin_text_chunk(self) -> None:
        self.table.begin_text_chunk(self.slot)

    def add(self, n_chars: int, arrival_frame: int, client_time_s: Optional[float] = None, n_tokens: int = 0) -> int:
        return self.table.add(self.slot, n_chars, arrival_frame, client_time_s, n_tokens)

    def window(self, frame: int) -> tuple[int, int, int]:
        """`SpeechTimelines.window` at the current chunk of `frame`."""
        return self.table.window(self.slot, self.current_chunk(frame))

    def tokens_before(self, chunk: int) -> int:
        return self.table.tokens_before(self.slot, chunk)

    def cached_tokens(self) -> int:
        return self.table.cached_tokens(self.slot)

    def moved_in(self) -> None:
        self.table.moved_in(self.slot)

    def evicted_before(self, chunk: int) -> None:
        self.table.evicted_before(self.slot, chunk)

    def current_chunk(self, frame: int) -> int:
        return self.table.current_chunk(self.slot, frame)

    def last_tau(self) -> Optional[int]:
        return self.table.last_tau(self.slot)

    def replace(self, spoken_chars: int, frame: int, horizon: int = 10) -> list[tuple[int, int]]:
        """`SpeechTimelines.replace` of this row alone: [(chunk, new tau)]."""
        moved = self.table.replace(np.array([self.slot]), np.array([spoken_chars]), np.array([frame]),
                                   np.array([horizon]))
        return list(zip(moved.chunk.tolist(), moved.tau.tolist()))
