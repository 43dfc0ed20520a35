"""Which sessions run in the next decode step.

A session runs when it has text to speak and its lookahead is satisfied (the start
policy of docs/design.md, `EngineSession.lookahead_ready`: chunk k has min(nf,
start_future_chunks + k) chunks after it, or the text has ended; also used to restart
after the text ran dry). Sessions far ahead of their playback yield the step to the
others, so a newly started session gets its first packet quickly even under load; and
while a session is starting (before its first packet and through its packet ramp,
`EngineSession.clocked` false), those more than `yield_lead_s` ahead sit out, so it
steps at a smaller batch, faster, until its listener holds a buffer. A ramp is bounded
in frames (`PacketPolicy.ramp_over`), so the yield is too: a session whose listener runs
short for other reasons (a client that stopped reading) never makes others sit out. At
16-24 sessions on 2 cores it cut TTFA by a fifth to a third and the starved audio at 24
sessions fourfold (docs/loadtest.md, "Measured choices").
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Scheduler:
    max_lead_s: float
    yield_lead_s: float

    def select(self, ready: np.ndarray, ahead_s: np.ndarray, clocked: np.ndarray) -> np.ndarray:
        """Which of the engine's sessions run the next step (a mask of its rows), given
        for each whether it may speak (admitted, not done, its lookahead ready), the audio
        its listener holds and whether its packets are on the packet clock."""
        batch = ready & (ahead_s < self.max_lead_s)
        if (batch & ~clocked).any():  # one is starting: those well ahead sit out
            batch &= ~clocked | (ahead_s < self.yield_lead_s)
        return batch
