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
chunks, in a few numpy passes over the batch instead of a walk in Python a session. A
session holds its row as a `SpeechTimeline`; one made on its own has a table of one row.
"""
from __future__ import annotations

import bisect
from typing import NamedTuple, Optional

import numpy as np

from livespeech.models.config import FRAME_RATE

DEFAULT_FRAMES_PER_CHAR = FRAME_RATE / 14.0  # ~14 characters/s of conversational speech
MIN_FRAMES_PER_CHAR, MAX_FRAMES_PER_CHAR = 3.0, 12.0  # the speaking rate's sane range

# Each row's sorted values (its chunks' first characters, its fixed chunks' running tau
# maximum) are searched for all rows at once in one flat array: row r's keys are
# r * _SPAN + value, and the columns past the row's end hold its largest key.
_SPAN = 1 << 32
_PAD = _SPAN - 1


class Replaced(NamedTuple):
    """The chunks a `SpeechTimelines.replace` moved, each row's in chunk order: the position
    of its slot in the call's `slots`, the chunk, its new tau."""
    at: np.ndarray
    chunk: np.ndarray
    tau: np.ndarray


class SpeechTimelines:
    """The chunks' first frames of `slots` timelines, a row each (see the module docstring).

    Per chunk: its first character in the (collapsed) transcript, its characters, its tau,
    and whether it is fixed (client-supplied speech time, or already being spoken). Per
    row: its chunk count, the speaking rate measured so far, the first chunk not fixed
    (every one before it is), the last chunk the last `replace` brought up to date, and the
    running maximum of the fixed chunks' taus (a fixed chunk's tau never changes). The rows
    are as wide as the longest needs: when one fills, all double."""

    def __init__(self, slots: int, chunks: int = 64) -> None:
        self.count = np.zeros(slots, np.int64)
        # each row's running maximum of its fixed chunks' taus, for one slot's bisection
        # (its rows of `_fixed_keys` serve a batch's)
        self._fixed_tau_max: list[list[int]] = [[] for _ in range(slots)]
        self.frames_per_char = np.full(slots, DEFAULT_FRAMES_PER_CHAR)
        self.client_speech_time = np.zeros(slots, bool)
        self.fixed_below = np.zeros(slots, np.int64)
        self.placed_through = np.full(slots, -1, np.int64)
        self._allocate(slots, chunks)

    def _allocate(self, slots: int, width: int) -> None:
        """Rows `width` chunks wide, keeping the chunks there are."""
        kept = getattr(self, "width", 0)
        self.width = width
        for name, dtype in (("char_start", np.int64), ("n_chars", np.int64), ("tau", np.int64), ("fixed", bool)):
            a = np.zeros((slots, width), dtype)
            if kept:
                a[:, :kept] = getattr(self, name)
            setattr(self, name, a)
        rows = np.arange(slots, dtype=np.int64)[:, None] * _SPAN
        cols = np.arange(width)
        self._start_keys = np.where(cols < self.count[:, None], rows + self.char_start, rows + _PAD)
        fixed_keys = np.full((slots, width), _PAD, np.int64)
        for slot, top in enumerate(self._fixed_tau_max):
            fixed_keys[slot, : len(top)] = top
        self._fixed_keys = rows + fixed_keys

    def bind(self, slot: int, client_speech_time: bool = False,
             frames_per_char: float = DEFAULT_FRAMES_PER_CHAR) -> "SpeechTimeline":
        """Slot `slot`'s row, emptied, for a new session."""
        self.count[slot] = self.fixed_below[slot] = 0
        self.placed_through[slot] = -1
        self.frames_per_char[slot] = frames_per_char
        self.client_speech_time[slot] = client_speech_time
        self.fixed[slot] = False
        self._fixed_tau_max[slot] = []
        self._start_keys[slot] = self._fixed_keys[slot] = slot * _SPAN + _PAD
        return SpeechTimeline(table=self, slot=slot)

    # --- one slot ----------------------------------------------------------------------
    def text_chars(self, slot: int) -> int:
        """The characters of the slot's chunks."""
        n = int(self.count[slot])
        return int(self.char_start[slot, n - 1] + self.n_chars[slot, n - 1]) if n else 0

    def add(self, slot: int, n_chars: int, arrival_frame: int, client_time_s: Optional[float] = None) -> int:
        """Place a new chunk; returns its tau."""
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
        self._start_keys[slot, n] = slot * _SPAN + start
        self.count[slot] = n + 1
        return tau

    def current_chunk(self, slot: int, frame: int) -> int:
        """`current_chunks` of one slot."""
        k = bisect.bisect_right(self._fixed_tau_max[slot], frame)
        current, n = max(k - 1, 0), int(self.count[slot])
        if k < n:
            tau = self.tau[slot]
            while k < n and tau[k] <= frame:
                current, k = k, k + 1
        return current

    def last_tau(self, slot: int) -> Optional[int]:
        """The last chunk's tau if it is up to date (fixed, or re-placed by the last
        `replace`); None while it lies beyond the re-placed chunks, that is, after the
        speech's next chunks (where its up-to-date tau is later than the frame)."""
        last = int(self.count[slot]) - 1
        if last < 0 or not (self.fixed[slot, last] or last <= self.placed_through[slot]):
            return None
        return int(self.tau[slot, last])

    # --- a batch of slots --------------------------------------------------------------
    def _search(self, keys: np.ndarray, slots: np.ndarray, values: np.ndarray) -> np.ndarray:
        """For each of `slots`, how many of its row's keys are <= the value (a bisection)."""
        return np.searchsorted(keys.reshape(-1), slots * _SPAN + values, side="right") - slots * self.width

    def current_chunks(self, slots: np.ndarray, frames: np.ndarray) -> np.ndarray:
        """`models.attention.current_chunk` of each slot at its frame (the last chunk whose
        tau <= frame, the walk stopping at the first later one; 0 before the first),
        without walking the chunks already spoken: the walk passes fixed chunk i iff the
        running maximum of the fixed taus through i is <= frame, so a bisection finds how
        far it gets through the fixed chunks, and only the few chunks after those are walked."""
        k = self._search(self._fixed_keys, slots, frames)
        current = np.maximum(k - 1, 0)
        n = self.count[slots]
        walking = np.nonzero(k < n)[0]
        while len(walking):
            i = k[walking]
            on = self.tau[slots[walking], i] <= frames[walking]
            walking = walking[on]
            current[walking] = i[on]
            k[walking] += 1
            walking = walking[k[walking] < n[walking]]
        return current

    def replace(self, slots: np.ndarray, spoken: np.ndarray, frames: np.ndarray,
                horizon: np.ndarray) -> Replaced:
        """Re-place the chunks the speech has not reached, in each of `slots`, given that
        `spoken` transcript characters were spoken by `frames`: the next `horizon` chunks
        that move (the np/nf window needs at most nf + 1 of them; later ones are placed
        when they come within reach). A row without chunks is left as it is."""
        at = np.nonzero(self.count[slots] > 0)[0]
        slots, spoken, frames, horizon = slots[at], spoken[at], frames[at], horizon[at]
        moved: list[tuple[np.ndarray, ...]] = []
        # the running estimate of the speaking rate, kept within its range
        fpc = self.frames_per_char[slots]
        rate = (spoken > 0) & (frames > 0)
        measured = frames[rate] / spoken[rate]
        fpc[rate] = np.minimum(MAX_FRAMES_PER_CHAR, np.maximum(MIN_FRAMES_PER_CHAR, 0.9 * fpc[rate] + 0.1 * measured))
        self.frames_per_char[slots] = fpc
        # the chunk being spoken: the last whose first character was reached
        cur = np.maximum(self._search(self._start_keys, slots, spoken) - 1, 0)
        # chunks reached: one the speech reached before its tau starts now; all are fixed
        i = self.fixed_below[slots].copy()
        rows = np.nonzero(i <= cur)[0]
        while len(rows):
            s, c, f = slots[rows], i[rows], frames[rows]
            early = ~self.fixed[s, c] & (c > 0) & (self.tau[s, c] > f)
            self.tau[s[early], c[early]] = f[early]
            moved.append((at[rows[early]], c[early], f[early]))
            self.fixed[s, c] |= self.tau[s, c] <= f
            i[rows] += 1
            rows = rows[i[rows] <= cur[rows]]
        self._advance_fixed(slots)
        # the next `horizon` chunks that move, from where the current one's characters end
        n = self.count[slots]
        expected = frames + np.maximum(0, self.char_start[slots, cur] + self.n_chars[slots, cur] - spoken) * fpc
        i, moving, earliest = cur + 1, np.zeros_like(cur), frames + 1
        rows = np.nonzero((i < n) & (moving < horizon))[0]
        while len(rows):
            s, c = slots[rows], i[rows]
            fixed, old = self.fixed[s, c], self.tau[s, c]
            tau = np.where(fixed, old, np.maximum(np.rint(expected[rows]).astype(np.int64), earliest[rows]))
            changed = tau != old
            self.tau[s[changed], c[changed]] = tau[changed]
            moved.append((at[rows[changed]], c[changed], tau[changed]))
            expected[rows] = tau + self.n_chars[s, c] * fpc[rows]
            moving[rows] += ~fixed
            i[rows] += 1
            rows = rows[(i[rows] < n[rows]) & (moving[rows] < horizon[rows])]
        self.placed_through[slots] = i - 1
        if not moved:
            return Replaced(*(np.zeros(0, np.int64) for _ in range(3)))
        out = [np.concatenate(parts) for parts in zip(*moved)]
        order = np.lexsort((out[1], out[0]))  # each row's chunks in order
        return Replaced(*(a[order] for a in out))

    def _advance_fixed(self, slots: np.ndarray) -> None:
        """Move each row's first chunk not fixed past the chunks fixed since, keeping the
        running maximum of their taus."""
        b = self.fixed_below[slots]
        n = self.count[slots]
        rows = np.nonzero(b < n)[0]
        rows = rows[self.fixed[slots[rows], b[rows]]]
        while len(rows):
            s, j = slots[rows], b[rows]
            key = s * _SPAN + self.tau[s, j]
            key = np.where(j > 0, np.maximum(key, self._fixed_keys[s, np.maximum(j - 1, 0)]), key)
            self._fixed_keys[s, j] = key
            for slot, top in zip(s.tolist(), (key - s * _SPAN).tolist()):
                self._fixed_tau_max[slot].append(top)
            b[rows] += 1
            rows = rows[b[rows] < n[rows]]
            rows = rows[self.fixed[slots[rows], b[rows]]]
        self.fixed_below[slots] = b


class SpeechTimeline:
    """One session's timeline: its row of a `SpeechTimelines` (`SpeechTimelines.bind`), or,
    made on its own, the one row of a table of its own."""

    def __init__(self, frames_per_char: float = DEFAULT_FRAMES_PER_CHAR, client_speech_time: bool = False,
                 *, table: Optional[SpeechTimelines] = None, slot: int = 0) -> None:
        if table is None:
            table = SpeechTimelines(1, chunks=8)
            table.bind(0, client_speech_time, frames_per_char)
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

    def add(self, n_chars: int, arrival_frame: int, client_time_s: Optional[float] = None) -> int:
        return self.table.add(self.slot, n_chars, arrival_frame, client_time_s)

    def current_chunk(self, frame: int) -> int:
        return self.table.current_chunk(self.slot, frame)

    def last_tau(self) -> Optional[int]:
        return self.table.last_tau(self.slot)

    def replace(self, spoken_chars: int, frame: int, horizon: int = 10) -> list[tuple[int, int]]:
        """`SpeechTimelines.replace` of this row alone: [(chunk, new tau)]."""
        moved = self.table.replace(np.array([self.slot]), np.array([spoken_chars]), np.array([frame]),
                                   np.array([horizon]))
        return list(zip(moved.chunk.tolist(), moved.tau.tolist()))
