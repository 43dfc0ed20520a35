"""When a session's pending frames go to the codec, and how many: the packet policy.

It reads a session's packet state (pending frames, frames done, whether it is on the
packet clock, whether its text ran dry, its listener's buffer) and the engine's step
clock; it holds no session and no engine, so it is tested with stubs
(tests/test_packet_policy.py). The sessions on the packet clock, most sessions at most
steps, it decides for the engine's whole batch from their rows of the session table
(`clocked_rows`; tests/test_session_table.py holds it to `due`).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from livespeech.models.config import FRAME_RATE

from .session import Phase
from .session_table import RUNNING, frames_for_ms


class PacketPlan(NamedTuple):
    """What `PacketPolicy.due` decided for a session at this step."""
    frames: int  # how many of its pending frames to decode
    short: bool  # the audio left over after whole packets goes out too (>= min_packet_ms)
    clocked: bool = False  # a full packet on the packet clock's tick (`PacketPolicy.on_clock`)


class PacketDecision(NamedTuple):
    clocked: bool  # the session's packets follow the packet clock from now on
    plan: Optional[PacketPlan]  # the packet to decode now, if any


_CLOCKED_BETWEEN_TICKS = PacketDecision(True, None)

# The packet ramp's bound in full packets' worth of frames (`PacketPolicy.ramp_over`):
# a ramp packet takes a codec call of its own, and while a session ramps others well
# ahead sit out (server/scheduler.py), so a listener that never fills (a client that
# stopped reading) must not keep it ramping for good
RAMP_MAX_PACKETS = 8


class StepClock:
    """The engine's decode steps: their count (the packet clock, `PacketPolicy.on_clock`)
    and the time from one step's start to the next (EMA): what a listener waits for the
    next frames of its session. Gaps under 0.5 s count, waits for text included: that
    makes a first packet after such waits 3-4 frames, not 2, and dropping them (first
    packet 15-20 ms sooner) starved listeners at the ramp's end through gRPC, even at one
    session (docs/loadtest.md, "Measured choices")."""

    def __init__(self) -> None:
        self.steps = 0
        self.period_s = 0.02
        self._last_step_at: Optional[float] = None

    def step(self, t0: float) -> None:
        """A step starts at `t0` (perf_counter seconds)."""
        self.steps += 1
        if self._last_step_at is not None and t0 - self._last_step_at < 0.5:  # not after idling
            self.period_s += 0.1 * (t0 - self._last_step_at - self.period_s)
        self._last_step_at = t0


class PacketPolicy:
    def __init__(self, clock: StepClock, low_water_steps: float, min_first_frames: int,
                 first_packet_min_ms: float = 0.0):
        self.clock = clock
        # while a session's packets ramp up, a shorter one goes out as soon as its
        # listener has less than this many step periods of audio left
        self.low_water_steps = low_water_steps
        # a reflect-padded codec reads this far ahead at a stream's start
        self.min_first_frames = min_first_frames
        # the first packet's audio whatever the step period (`EngineConfig.first_packet_min_ms`)
        self.first_packet_min_frames = frames_for_ms(first_packet_min_ms)

    @property
    def low_water_s(self) -> float:
        """Audio a listener needs in hand to outlast the making of the next packet."""
        return self.low_water_steps * self.clock.period_s

    def due(self, s, now: float) -> PacketDecision:
        """The packet to decode from the session's pending frames now, if any, and whether
        its packets follow the packet clock from now on.

        A full packet when packet_ms of frames are pending; once the ramp below is over,
        on the shared packet clock (`on_clock`). Shorter ones (at least min_packet_ms)
        only where they buy latency without costing capacity (every codec call has a
        fixed cost, ~2 ms on the CPU default model): the first audio (at least
        `low_water_steps` step periods of it, and first_packet_min_ms, so it lasts until
        the next); the ramp after it (a packet may be as long as all the audio sent before
        it, so the listener's buffer covers its making; sooner if it would run dry first),
        which ends as `ramp_over` says, at a tick, with all pending frames: the first
        clocked packet then follows `full` steps later, where ending it between ticks left
        the listener up to 2 x full - 1 steps to wait (at 16-20 sessions the stalls 0.19
        and 0.32 s into the audio, docs/loadtest.md "Measured choices"); and when the text
        ran dry."""
        full = frames_for_ms(s.config.packet_ms)
        tick = self.on_clock(full)
        if s.clocked and not tick and s.phase is Phase.RUNNING and s.frames_done and not s.done_decoding:
            return _CLOCKED_BETWEEN_TICKS  # what `_plan` says there, found sooner: most sessions, most steps
        handoff = not s.clocked and tick and self.ramp_over(s, full, now)
        clocked = s.clocked or handoff
        return PacketDecision(clocked, self._plan(s, now, full, tick, handoff, clocked))

    def clocked_rows(self, table, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`due` for the rows of `table` (server/session_table.py) past their ramp, as
        arrays: which rows it settles from the packet clock alone (running on the clock,
        past the first packet, not done), and of those, the rows with a full packet due
        at this tick (`PacketPlan(full, False, clocked=True)`); every other row of those
        stays on the clock with no packet. The engine asks `due` of the other rows."""
        full = table.packet_frames[rows]
        steady = (table.clocked[rows] & (table.phase[rows] == RUNNING) & (table.frames_done[rows] > 0)
                  & ~table.done_decoding[rows])
        return steady, steady & (self.clock.steps % full == 0) & (table.n_pending[rows] >= full)

    def _plan(self, s, now: float, full: int, tick: bool, handoff: bool, clocked: bool) -> Optional[PacketPlan]:
        n = s.n_pending
        ramp = not clocked
        waiting = s.phase is Phase.WAITING
        if n == 0:
            return None
        if s.frames_done == 0 and n < self.min_first_frames and not s.done_decoding:
            return None  # a reflect-padded codec reads that far ahead at a stream's start
        if s.done_decoding:
            return PacketPlan(n, False)
        if waiting and s.ran_out():  # the audio of all the text so far goes out
            return PacketPlan(n, True)
        shortest = frames_for_ms(s.config.min_packet_ms)
        if handoff:  # all pending frames now, so the next tick, `full` steps on, finds a full packet
            return PacketPlan(n, True) if n >= shortest else None
        if not ramp and not waiting:
            return PacketPlan(full, False, clocked=True) if n >= full and tick else None
        if n >= full:
            return PacketPlan(n, waiting)  # when waiting, frames held for the clock go out too
        if s.frames_done == 0:
            # the first packet must also last until the next one is made: longer under load
            shortest = max(shortest, self.min_first_frames, self.first_packet_min_frames,
                           math.ceil(self.low_water_s * FRAME_RATE))
        if n < shortest:
            return None
        if (s.frames_done == 0 or waiting
                or (ramp and (n >= s.frames_done or s.audio_ahead_s(now) < self.low_water_s))):
            return PacketPlan(n, True)
        return None

    def ramp_over(self, s, full: int, now: float) -> bool:
        """Whether a session's packets leave the ramp for the packet clock (for good; asked
        at the clock's ticks only, see `due`). After two full packets' worth, and then
        only once its listener holds a clocked packet's longest wait (2 x full steps; at
        the hand-off it is `full` steps, but the step period measured in the ramp, while
        others sit out, is shorter than after it), or after `RAMP_MAX_PACKETS`: a
        listener left with less at the ramp's end ran dry before its first clocked packet
        (the N=1 stalls 0.16-0.19 s into the audio; at 18-22 sessions, with the ramp
        bounded at four packets, those at 0.28-0.45 s: docs/loadtest.md "Measured choices")."""
        if s.frames_done < 2 * full:
            return False
        return (s.frames_done >= RAMP_MAX_PACKETS * full
                or s.audio_ahead_s(now) >= 2 * full * self.clock.period_s)

    def on_clock(self, full: int) -> bool:
        """Whether steady sessions' full packets are decoded at this step: every `full`
        engine steps, the same steps for every session, so their codec calls batch (a
        call's cost is mostly fixed: CPU default model, 6 frames, 6.3 ms for one session,
        10.9 ms for four together). A session holds its frames for the tick (at most
        full - 1 steps), even when its listener runs low: a first version let such a
        session decode at once, and under load, when every listener runs low, the calls
        stopped batching (at 6 sessions on 2 cores: 32-40 s of starved audio in 20 s of
        turns against 3.8 s without that exception, docs/loadtest.md). One that sat steps
        out (ahead of its lead) has less than a packet at a tick and waits for a later
        one, then decodes one packet's worth and keeps the rest: so every call on a tick
        takes the same frame count."""
        return self.clock.steps % full == 0
