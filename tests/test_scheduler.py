"""Which sessions run a step: the lookahead and the lead cap."""
from server.scheduler import Scheduler
from server.session import Phase


class Stub:
    """The part of `EngineSession` the scheduler reads."""

    def __init__(self, slot: int, ahead_s: float, ready: bool = True):
        self.slot, self.ahead_s, self.ready = slot, ahead_s, ready
        self.phase, self.done_decoding = Phase.RUNNING, False

    def lookahead_ready(self, now=None):
        return self.ready

    def audio_ahead_s(self, now):
        return self.ahead_s


def select(*sessions):
    return [s.slot for s in Scheduler(max_lead_s=2.0).select(list(sessions), 0.0)]


def test_sessions_far_ahead_or_without_lookahead_sit_out():
    assert select(Stub(2, 0.5), Stub(0, 1.5), Stub(1, 2.5), Stub(3, 0.0, ready=False)) == [0, 2]
