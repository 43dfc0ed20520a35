"""Which sessions run a step: the lookahead and the lead cap."""
import numpy as np

from livespeech.server.scheduler import Scheduler


def select(*sessions):
    """sessions: (audio ahead s, ready, clocked) of each row; the rows that run."""
    ahead, ready, clocked = (np.array(x) for x in zip(*sessions))
    return np.flatnonzero(Scheduler(max_lead_s=2.0, yield_lead_s=0.5).select(ready, ahead, clocked)).tolist()


def steady(ahead_s, ready=True):
    return ahead_s, ready, True


def starting(ahead_s, ready=True):
    return ahead_s, ready, False


def test_sessions_far_ahead_or_without_lookahead_sit_out():
    assert select(steady(0.5), steady(1.5), steady(2.5), steady(0.0, ready=False)) == [0, 1]


def test_while_a_session_starts_those_well_ahead_sit_out():
    rows = [steady(0.2), steady(0.6), steady(1.5)]
    assert select(*rows) == [0, 1, 2]
    # a starting session (not yet on the packet clock) in the batch: only those under 0.5 s step with it
    assert select(*rows, starting(0.0)) == [0, 3]
    # one that is not ready (waiting for text) makes no one sit out
    assert select(*rows, starting(0.0, ready=False)) == [0, 1, 2]
    # several starting at once all step, whatever their buffers
    assert select(starting(0.7), starting(0.0), steady(1.0)) == [0, 1]
