"""When a session's packet is due and how big: the ramp, the packet clock, the low water,
the last packet. Sessions are stubs; the clock is set by hand."""
from types import SimpleNamespace

import pytest

from livespeech.server.packets import RAMP_MAX_PACKETS, PacketPlan, PacketPolicy, StepClock
from livespeech.server.session_table import frames_for_ms
from livespeech.server.session import Phase

FULL = 6  # 80 ms at 75 Hz
SHORTEST = 3  # 40 ms


class Stub:
    """The part of `EngineSession` the packet policy reads."""

    def __init__(self, pending: int, frames_done: int = 0, ahead_s: float = 50.0, clocked: bool = False,
                 waiting: bool = False, done: bool = False, ran_out: bool = False):
        self.config = SimpleNamespace(packet_ms=80, min_packet_ms=40)
        self.n_pending = pending
        self.frames_done, self.ahead_s, self.clocked = frames_done, ahead_s, clocked
        self.phase = Phase.WAITING if waiting else Phase.RUNNING
        self.done_decoding, self._ran_out = done, ran_out

    def ran_out(self):
        return self._ran_out

    def audio_ahead_s(self, now):
        return self.ahead_s


def policy(steps: int = 1, period_s: float = 0.02, low_water_steps: float = 0.0, min_first_frames: int = 1,
           first_packet_min_ms: float = 0.0):
    clock = StepClock()
    clock.steps, clock.period_s = steps, period_s
    return PacketPolicy(clock, low_water_steps, min_first_frames, first_packet_min_ms)


def test_frames_for_ms_rounds_up_to_at_least_one_frame():
    assert [frames_for_ms(ms) for ms in (80, 40, 20, 1)] == [6, 3, 2, 1]


def test_nothing_pending_is_no_packet():
    assert policy().due(Stub(0), 0.0) == (False, None)


def test_the_first_packet_covers_the_shortest_the_codecs_start_and_the_low_water():
    assert policy().due(Stub(2), 0.0).plan is None
    assert policy().due(Stub(3), 0.0).plan == PacketPlan(3, True)
    # a reflect-padded codec reads 7 frames ahead at a stream's start
    assert policy(min_first_frames=7).due(Stub(6), 0.0).plan is None
    assert policy(min_first_frames=7).due(Stub(7), 0.0).plan == PacketPlan(7, False)  # over a full packet
    # 3 step periods of 20 ms: 60 ms of audio, 4.5 frames -> 5
    assert policy(low_water_steps=3).due(Stub(4), 0.0).plan is None
    assert policy(low_water_steps=3).due(Stub(5), 0.0).plan == PacketPlan(5, True)
    # ... longer as the steps slow down: one step period of 50 ms, 3.75 frames -> 4
    assert policy(low_water_steps=1, period_s=0.02).due(Stub(3), 0.0).plan == PacketPlan(3, True)
    assert policy(low_water_steps=1, period_s=0.05).due(Stub(3), 0.0).plan is None
    assert policy(low_water_steps=1, period_s=0.05).due(Stub(4), 0.0).plan == PacketPlan(4, True)


def test_the_first_packet_holds_its_floor_of_audio_when_the_steps_are_fast():
    def stub(pending, frames_done=0, ahead_s=50.0):
        s = Stub(pending, frames_done, ahead_s=ahead_s)
        s.config.min_packet_ms = 20  # the sessions' default: 2 frames
        return s
    fast = dict(low_water_steps=6, period_s=0.002)  # six 2 ms steps: 12 ms, one frame
    assert policy(**fast).due(stub(2), 0.0).plan == PacketPlan(2, True)
    # 40 ms: 3 frames, for the first packet only
    assert policy(first_packet_min_ms=40, **fast).due(stub(2), 0.0).plan is None
    assert policy(first_packet_min_ms=40, **fast).due(stub(3), 0.0).plan == PacketPlan(3, True)
    # a ramp packet to a listener under the low water is not held to it
    assert policy(first_packet_min_ms=40, **fast).due(stub(2, frames_done=3, ahead_s=0.0), 0.0).plan == PacketPlan(2, True)
    # the step periods still rule where they ask for more: six 10 ms steps, 4.5 frames -> 5
    assert policy(first_packet_min_ms=40, low_water_steps=6, period_s=0.01).due(stub(4), 0.0).plan is None


def test_ramp_packets_are_as_long_as_the_audio_sent_before_them():
    p = policy(steps=1)  # off the clock's ticks: the ramp does not end here
    assert p.due(Stub(3, frames_done=3), 0.0) == (False, PacketPlan(3, True))
    assert p.due(Stub(5, frames_done=6), 0.0).plan is None
    assert p.due(Stub(6, frames_done=6), 0.0).plan == PacketPlan(6, False)  # a full packet
    assert p.due(Stub(2, frames_done=2), 0.0).plan is None  # never under min_packet_ms


def test_a_listener_under_the_low_water_gets_a_ramp_packet_sooner():
    p = policy(steps=1, low_water_steps=3)  # low water: 60 ms
    assert p.due(Stub(3, frames_done=5, ahead_s=0.07), 0.0).plan is None
    assert p.due(Stub(3, frames_done=5, ahead_s=0.05), 0.0).plan == PacketPlan(3, True)
    assert p.due(Stub(2, frames_done=5, ahead_s=0.0), 0.0).plan is None  # still at least min_packet_ms


def test_the_ramp_hands_off_at_a_tick_with_all_pending_frames():
    # two full packets' worth sent and the listener holds a clocked packet's longest wait
    # (2 x 6 steps of 20 ms = 0.24 s): on the clock from this tick, all 4 pending frames now
    held = Stub(4, frames_done=2 * FULL, ahead_s=0.25)
    assert policy(steps=FULL).due(held, 0.0) == (True, PacketPlan(4, True))
    assert policy(steps=FULL + 1).due(held, 0.0).clocked is False  # not between ticks
    assert policy(steps=FULL).due(Stub(2, frames_done=2 * FULL, ahead_s=0.25), 0.0) == (True, None)  # under the shortest


def test_the_ramp_lasts_while_the_listener_holds_less_up_to_its_bound():
    short = lambda done: Stub(4, frames_done=done, ahead_s=0.2)  # noqa: E731  under 0.24 s
    assert policy(steps=FULL).due(short(2 * FULL), 0.0).clocked is False
    assert policy(steps=FULL).due(short(RAMP_MAX_PACKETS * FULL - 1), 0.0).clocked is False
    assert policy(steps=FULL).due(short(RAMP_MAX_PACKETS * FULL), 0.0) == (True, PacketPlan(4, True))
    # under two packets' worth, even a full listener stays in the ramp
    assert policy(steps=FULL).due(Stub(4, frames_done=2 * FULL - 1, ahead_s=50.0), 0.0).clocked is False
    # measured slower steps need more in hand
    assert policy(steps=FULL, period_s=0.03).due(Stub(4, frames_done=2 * FULL, ahead_s=0.25), 0.0).clocked is False


def test_clocked_sessions_decode_one_full_packet_at_each_tick_only():
    clocked = lambda n: Stub(n, frames_done=30, clocked=True, ahead_s=0.0)  # noqa: E731  even when running low
    assert policy(steps=2 * FULL).due(clocked(8), 0.0) == (True, PacketPlan(FULL, False, clocked=True))
    assert policy(steps=2 * FULL + 1).due(clocked(8), 0.0).plan is None
    assert policy(steps=2 * FULL).due(clocked(FULL - 1), 0.0).plan is None


@pytest.mark.parametrize("clocked", [False, True])
def test_the_last_packet_goes_out_at_once_with_all_pending_frames(clocked):
    p = policy(steps=1, min_first_frames=7)
    assert p.due(Stub(1, frames_done=30, clocked=clocked, done=True), 0.0).plan == PacketPlan(1, False)
    assert p.due(Stub(2, frames_done=0, done=True), 0.0).plan == PacketPlan(2, False)  # a speech shorter than a first packet


def test_a_session_whose_text_ran_dry_sends_what_it_holds():
    p = policy(steps=1)
    waiting = lambda n, **kw: Stub(n, frames_done=30, clocked=True, waiting=True, **kw)  # noqa: E731
    assert p.due(waiting(3), 0.0).plan == PacketPlan(3, True)  # off the clock, min_packet_ms
    assert p.due(waiting(2), 0.0).plan is None
    assert p.due(waiting(8), 0.0).plan == PacketPlan(8, True)  # frames held for the clock too
    assert p.due(waiting(1, ran_out=True), 0.0).plan == PacketPlan(1, True)  # the audio of all its text


def test_the_step_clock_counts_steps_and_averages_their_period_not_after_idling():
    clock = StepClock()
    clock.step(10.0)
    clock.step(10.03)
    assert clock.steps == 2 and clock.period_s == pytest.approx(0.021)
    clock.step(11.0)  # after an idle gap: not a period
    assert clock.steps == 3 and clock.period_s == pytest.approx(0.021)
    p = PacketPolicy(clock, 3.0, 1)
    assert p.low_water_s == pytest.approx(0.063)
    ticks = []
    for step in range(5, 14):
        clock.steps = step
        ticks.append(p.on_clock(FULL))
    assert ticks == [step % FULL == 0 for step in range(5, 14)]  # every packet's worth of steps
