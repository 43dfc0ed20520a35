"""Which sessions run a step: the lookahead and the lead cap."""
from livespeech.server.scheduler import Scheduler
from livespeech.server.session import Phase


class Stub:
    """The part of `EngineSession` the scheduler reads."""

    def __init__(self, slot: int, ahead_s: float, ready: bool = True, clocked: bool = True):
        self.slot, self.ahead_s, self.ready, self.clocked = slot, ahead_s, ready, clocked
        self.phase, self.done_decoding = Phase.RUNNING, False

    def lookahead_ready(self, now=None):
        return self.ready

    def audio_ahead_s(self, now):
        return self.ahead_s


def select(*sessions):
    return [s.slot for s in Scheduler(max_lead_s=2.0, yield_lead_s=0.5).select(list(sessions), 0.0)]


def test_sessions_far_ahead_or_without_lookahead_sit_out():
    assert select(Stub(2, 0.5), Stub(0, 1.5), Stub(1, 2.5), Stub(3, 0.0, ready=False)) == [0, 2]


def test_while_a_session_starts_those_well_ahead_sit_out():
    steady = [Stub(0, 0.2), Stub(1, 0.6), Stub(2, 1.5)]
    assert select(*steady) == [0, 1, 2]
    # a starting session (not yet on the packet clock) in the batch: only those under 0.5 s step with it
    assert select(*steady, Stub(3, 0.0, clocked=False)) == [0, 3]
    # one that is not ready (waiting for text) makes no one sit out
    assert select(*steady, Stub(3, 0.0, ready=False, clocked=False)) == [0, 1, 2]
    # several starting at once all step, whatever their buffers
    assert select(Stub(0, 0.7, clocked=False), Stub(1, 0.0, clocked=False), Stub(2, 1.0)) == [0, 1]
