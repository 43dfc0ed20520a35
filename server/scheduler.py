"""Which sessions run in the next decode step.

A session runs when it has text to speak and its lookahead is satisfied (the start
policy of DESIGN.md point 3, `EngineSession.lookahead_ready`: chunk k has min(nf,
start_future_chunks + k) chunks after it, or the text has ended; also used to restart
after the text ran dry). Sessions far ahead of their playback yield the step to the
others, so a newly started session gets its first packet quickly even under load.
"""
from __future__ import annotations

from dataclasses import dataclass

from .session import EngineSession, Phase


@dataclass
class Scheduler:
    max_lead_s: float

    def select(self, sessions: list[EngineSession], now: float) -> list[EngineSession]:
        batch = [
            s for s in sessions
            if s.phase is not Phase.ENDED and s.slot is not None and not s.done_decoding
            and s.lookahead_ready() and s.audio_ahead_s(now) < self.max_lead_s
        ]
        # contiguous slots make the batch a slice of the decode state (no gather copy)
        batch.sort(key=lambda s: s.slot)
        return batch
