"""Chunk positions on the speech timeline (docs/design.md, "Chunks to speech time").

The model was trained with tau_i = the frame where chunk i's speech starts. An LLM
sends text much faster than it is spoken, so arrival times would cram the speech;
instead a chunk is placed no earlier than its arrival and no earlier than where the
speech of the chunks before it should end. Once speech runs, the model's own grapheme
progress (how many transcript characters have been spoken) re-places the chunks not
yet reached, the next few at each step (`SpeechTimeline.replace`): the next chunk
starts where the current one's remaining characters end, at the speaking rate measured
so far. Clients whose timestamps already are speech time (e.g. a streaming translator)
set the positions themselves.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

from livespeech.models.config import FRAME_RATE

DEFAULT_FRAMES_PER_CHAR = FRAME_RATE / 14.0  # ~14 characters/s of conversational speech


@dataclass
class PlacedChunk:
    char_start: int  # offset of the chunk in the (collapsed) transcript
    n_chars: int
    tau: int  # first frame
    fixed: bool = False  # client-supplied speech time, or already being spoken


@dataclass
class SpeechTimeline:
    """The chunks' first frames. `replace`, once a step, costs O(log chunks) plus the
    chunks it re-places: those reached, and the next `horizon` that move; the text held
    far ahead (a whole LLM answer at once) is not walked at every step."""
    frames_per_char: float = DEFAULT_FRAMES_PER_CHAR
    client_speech_time: bool = False
    chunks: list[PlacedChunk] = field(init=False, default_factory=list)
    _starts: list[int] = field(init=False, default_factory=list)  # each chunk's char_start, for bisection
    _fixed_below: int = field(init=False, default=0)  # every chunk before this index is fixed
    # the running maximum of those chunks' taus (a fixed chunk's tau never changes)
    _fixed_tau_max: list[int] = field(init=False, default_factory=list)
    _placed_through: int = field(init=False, default=-1)  # the last chunk the last `replace` brought up to date

    @property
    def n_chars(self) -> int:
        return self.chunks[-1].char_start + self.chunks[-1].n_chars if self.chunks else 0

    def add(self, n_chars: int, arrival_frame: int, client_time_s: Optional[float] = None) -> int:
        """Place a new chunk; returns its tau."""
        start = self.n_chars
        if self.client_speech_time and client_time_s is not None:
            tau = max(int(round(client_time_s * FRAME_RATE)), self.chunks[-1].tau if self.chunks else 0)
            self.chunks.append(PlacedChunk(start, n_chars, tau, fixed=True))
            self._starts.append(start)
            return tau
        natural_end = 0
        if self.chunks:
            prev = self.chunks[-1]
            natural_end = prev.tau + int(round(prev.n_chars * self.frames_per_char))
        tau = max(arrival_frame, natural_end) if self.chunks else 0
        self.chunks.append(PlacedChunk(start, n_chars, tau))
        self._starts.append(start)
        return tau

    def current_chunk(self, frame: int) -> int:
        """`models.attention.current_chunk` over the chunks' taus, without walking the
        chunks already spoken: the walk passes fixed chunk i iff the running maximum of
        the fixed taus through i is <= frame, so a bisection finds how far it gets through
        the fixed chunks, and only the few chunks after those are walked."""
        k = bisect.bisect_right(self._fixed_tau_max, frame)
        c = max(0, k - 1)
        for i in range(k, len(self.chunks)):
            if self.chunks[i].tau > frame:
                break
            c = i
        return c

    def last_tau(self) -> Optional[int]:
        """The last chunk's tau if it is up to date (fixed, or re-placed by the last
        `replace`); None while it lies beyond the re-placed chunks, that is, after the
        speech's next chunks (where its up-to-date tau is later than the frame)."""
        last = len(self.chunks) - 1
        if last < 0 or not (self.chunks[last].fixed or last <= self._placed_through):
            return None
        return self.chunks[last].tau

    def replace(self, spoken_chars: int, frame: int, horizon: int = 10) -> list[tuple[int, int]]:
        """Re-place the chunks the speech has not reached, given that `spoken_chars`
        transcript characters were spoken by `frame`: the next `horizon` chunks that move
        (the np/nf window needs at most nf + 1 of them; later ones are placed when they
        come within reach). Returns [(chunk, new_tau)]."""
        chunks = self.chunks
        if not chunks:
            return []
        fpc = self.frames_per_char
        if spoken_chars > 0 and frame > 0:
            # running estimate of the speaking rate, kept within a sane range
            fpc = self.frames_per_char = min(12.0, max(3.0, 0.9 * fpc + 0.1 * (frame / spoken_chars)))
        changed = []
        # the chunk being spoken: the last whose first character was reached
        cur = max(0, bisect.bisect_right(self._starts, spoken_chars) - 1)
        for i in range(self._fixed_below, cur + 1):
            ch = chunks[i]
            if not ch.fixed and i > 0 and ch.tau > frame:
                ch.tau = frame  # speech reached it early: it starts now
                changed.append((i, frame))
            ch.fixed = ch.fixed or ch.tau <= frame
        while self._fixed_below < len(chunks) and chunks[self._fixed_below].fixed:
            tau = chunks[self._fixed_below].tau
            self._fixed_tau_max.append(max(tau, self._fixed_tau_max[-1]) if self._fixed_tau_max else tau)
            self._fixed_below += 1
        ch = chunks[cur]
        expected = frame + max(0, ch.char_start + ch.n_chars - spoken_chars) * fpc
        # the walk below runs for every session at every step: kept to plain locals
        i, moving, n, earliest = cur + 1, 0, len(chunks), frame + 1
        while i < n and moving < horizon:
            ch = chunks[i]
            if ch.fixed:
                expected = ch.tau + ch.n_chars * fpc
            else:
                tau = int(round(expected))
                if tau < earliest:
                    tau = earliest
                if tau != ch.tau:
                    ch.tau = tau
                    changed.append((i, tau))
                expected = tau + ch.n_chars * fpc
                moving += 1
            i += 1
        self._placed_through = i - 1
        return changed
