"""Chunk positions on the speech timeline (docs/design.md, "Chunks to speech time").

The model was trained with tau_i = the frame where chunk i's speech starts. An LLM
sends text much faster than it is spoken, so arrival times would cram the speech;
instead a chunk is placed no earlier than its arrival and no earlier than where the
speech of the chunks before it should end. Once speech runs, the model's own grapheme
progress (how many transcript characters have been spoken) re-places every chunk not
yet reached: the next chunk starts where the current one's remaining characters end,
at the speaking rate measured so far. Clients whose timestamps already are speech time
(e.g. a streaming translator) set the positions themselves.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from livespeech.models.attention import current_chunk
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
    frames_per_char: float = DEFAULT_FRAMES_PER_CHAR
    client_speech_time: bool = False
    chunks: list[PlacedChunk] = field(default_factory=list)

    @property
    def n_chars(self) -> int:
        return self.chunks[-1].char_start + self.chunks[-1].n_chars if self.chunks else 0

    def add(self, n_chars: int, arrival_frame: int, client_time_s: Optional[float] = None) -> int:
        """Place a new chunk; returns its tau."""
        start = self.n_chars
        if self.client_speech_time and client_time_s is not None:
            tau = max(int(round(client_time_s * FRAME_RATE)), self.chunks[-1].tau if self.chunks else 0)
            self.chunks.append(PlacedChunk(start, n_chars, tau, fixed=True))
            return tau
        natural_end = 0
        if self.chunks:
            prev = self.chunks[-1]
            natural_end = prev.tau + int(round(prev.n_chars * self.frames_per_char))
        tau = max(arrival_frame, natural_end) if self.chunks else 0
        self.chunks.append(PlacedChunk(start, n_chars, tau))
        return tau

    def current_chunk(self, frame: int) -> int:
        return current_chunk(frame, [ch.tau for ch in self.chunks])

    def replace(self, spoken_chars: int, frame: int) -> list[tuple[int, int]]:
        """Re-place the chunks the speech has not reached, given that `spoken_chars`
        transcript characters were spoken by `frame`. Returns [(chunk, new_tau)]."""
        if not self.chunks:
            return []
        if spoken_chars > 0 and frame > 0:
            # running estimate of the speaking rate, kept within a sane range
            rate = frame / spoken_chars
            self.frames_per_char = min(12.0, max(3.0, 0.9 * self.frames_per_char + 0.1 * rate))
        changed = []
        # the chunk being spoken: the last whose first character was reached
        cur = 0
        for i, ch in enumerate(self.chunks):
            if spoken_chars >= ch.char_start:
                cur = i
        for i, ch in enumerate(self.chunks[: cur + 1]):
            if not ch.fixed and i > 0 and ch.tau > frame:
                ch.tau = frame  # speech reached it early: it starts now
                changed.append((i, frame))
            ch.fixed = ch.fixed or ch.tau <= frame
        expected = frame + max(0, self.chunks[cur].char_start + self.chunks[cur].n_chars - spoken_chars) * self.frames_per_char
        for i in range(cur + 1, len(self.chunks)):
            ch = self.chunks[i]
            if ch.fixed:
                expected = ch.tau + ch.n_chars * self.frames_per_char
                continue
            tau = max(frame + 1, int(round(expected)))
            if tau != ch.tau:
                ch.tau = tau
                changed.append((i, tau))
            expected = tau + ch.n_chars * self.frames_per_char
        return changed
