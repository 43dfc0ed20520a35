"""The sessions' per-step state as a table (server/session_table.py): the engine books a
step for the whole batch in array passes, a session's own rules run only where something
happens to it, and a session's fields stay its own once its slot is taken by another."""
import collections
import math
import threading

import numpy as np
import pytest
import torch
from conftest import numbered_words, random_bundle

from livespeech.api.session import SessionConfig
from livespeech.server.engine import Engine, EngineConfig
from livespeech.server.packets import PacketPlan, PacketPolicy, StepClock
from livespeech.server.session import EngineSession, Phase, SessionLimits
from livespeech.server.session_table import ENDED, RUNNING, WAITING, SessionTable, frames_for_ms

LIMITS = SessionLimits(1000, 100_000, 600.0, 5.0)


def add_frames(table: SessionTable, rows, frames) -> None:
    """Each row steps once with a completed frame (`frames`, a row of codes each)."""
    rows, frames = np.asarray(rows, np.int64), np.asarray(frames, np.int64)
    none = np.zeros(len(rows), np.int64)
    table.book_step(rows, none, np.ones(len(rows), np.bool_), frames, none.astype(np.bool_))


def table_sessions(n: int, rng: np.random.Generator) -> tuple[SessionTable, list[EngineSession]]:
    """`n` sessions bound to the rows of a table, in random packet states."""
    table = SessionTable(n, codebooks=2)
    sessions = []
    for row in range(n):
        cfg = SessionConfig(packet_ms=int(rng.choice([40, 80, 120])), min_packet_ms=20)
        s = EngineSession(f"s{row}", cfg, None, lambda ev: None, lambda *a: None, LIMITS, audio_lag_frames=8)
        s.bind_row(table, row)
        s.phase = Phase.WAITING if rng.random() < 0.2 else Phase.RUNNING
        s.clocked = bool(rng.random() < 0.7)
        s.done_decoding = bool(rng.random() < 0.1)
        s.frames_done = int(rng.choice([0, 3, 12, 60]))
        for _ in range(int(rng.integers(0, 20))):
            add_frames(table, np.array([row]), np.zeros((1, 2), np.int64))
        s.first_packet_at, s.audio_sent_s = 0.0, float(rng.uniform(0, 2))
        sessions.append(s)
    return table, sessions


@pytest.mark.parametrize("steps", range(0, 12))
def test_the_packet_clocks_rows_are_what_due_says_for_each(steps):
    """`PacketPolicy.clocked_rows` settles the rows on the packet clock from arrays; for
    each of them `due` itself says the same: no packet between ticks, a full clocked
    packet at a tick with a full packet pending."""
    rng = np.random.default_rng(steps)
    table, sessions = table_sessions(64, rng)
    clock = StepClock()
    clock.steps = steps
    policy = PacketPolicy(clock, low_water_steps=2.0, min_first_frames=1)
    rows = np.arange(len(sessions))
    steady, full = policy.clocked_rows(table, rows)
    assert steady.any() and (~steady).any()
    for s, on_clock, due_full in zip(sessions, steady.tolist(), full.tolist()):
        if not on_clock:
            continue
        plan = PacketPlan(frames_for_ms(s.config.packet_ms), False, clocked=True) if due_full else None
        assert policy.due(s, 1.0) == (True, plan)


def test_an_ended_sessions_fields_stay_its_own_when_its_slot_is_taken():
    table = SessionTable(2, codebooks=2)
    a = EngineSession("a", SessionConfig(), None, lambda ev: None, lambda *x: None, LIMITS, audio_lag_frames=8)
    a.step_count, a.frames_done = 5, 3  # before it is admitted: its own row
    a.bind_row(table, 1)
    assert (a.step_count, a.frames_done, a.phase) == (5, 3, Phase.WAITING)
    add_frames(table, np.array([1]), np.array([[7, 8]]))  # a step: its count moves on
    a.phase = Phase.ENDED
    a.unbind_row()
    assert table.phase[1] == ENDED and table.n_pending[1] == 0  # the row is free
    b = EngineSession("b", SessionConfig(), None, lambda ev: None, lambda *x: None, LIMITS, audio_lag_frames=8)
    b.bind_row(table, 1)
    b.step_count = 100
    assert (a.step_count, a.frames_done, a.n_pending, a.phase) == (6, 3, 1, Phase.ENDED)
    assert (b.step_count, b.frames_done, b.n_pending, b.phase) == (100, 0, 0, Phase.WAITING)
    assert table.phase[1] == WAITING


def test_a_sessions_pending_frames_stay_as_others_take_and_leave_their_rows():
    table = SessionTable(3, codebooks=2)
    add_frames(table, np.array([0]), np.array([[5, 6]]))
    add_frames(table, np.array([0]), np.array([[7, 8]]))
    for row in (1, 2):  # others admitted (a new session's own row holds no frames) and ended
        s = EngineSession(f"s{row}", SessionConfig(), None, lambda ev: None, lambda *x: None, LIMITS,
                          audio_lag_frames=8)
        s.bind_row(table, row)
        add_frames(table, np.array([row]), np.array([[row, row]]))
        s.phase = Phase.ENDED
        s.unbind_row()
        assert s.n_pending == 1
    assert table.n_pending.tolist() == [2, 0, 0]
    assert table.take_frames(np.array([0]), 2).tolist() == [[[5, 6], [7, 8]]]


def test_pending_frames_come_out_oldest_first_and_the_rows_grow():
    table = SessionTable(3, codebooks=2)
    rows = np.array([0, 2])
    for k in range(20):  # past the first capacity of 8
        add_frames(table, rows, np.array([[k, -k], [100 + k, 0]]))
    assert table.n_pending.tolist() == [20, 0, 20]
    got = table.take_frames(rows, 6)
    assert got.shape == (2, 6, 2)
    assert got[0, :, 0].tolist() == list(range(6)) and got[1, :, 0].tolist() == list(range(100, 106))
    assert table.n_pending.tolist() == [14, 0, 14] and table.frames_done.tolist() == [6, 0, 6]
    assert table.take_frames(np.array([0]), 14)[0, :, 1].tolist() == [-k for k in range(6, 20)]


def test_a_step_between_ticks_runs_no_sessions_own_rules_in_steady_state(monkeypatch):
    """The host's per-step work over sessions is array passes: once every session of a
    batch of 24 speaks on the packet clock with its text in memory, an engine step
    calls none of a session's per-step methods (start policy, runaway guard, listener's
    buffer, packet policy, start of a step), between the clock's ticks or at one (its full
    packets are due by the same arrays)."""
    torch.set_num_threads(1)
    n = 24
    monkeypatch.setattr(SessionTable, "audio_ahead_s",  # listeners far ahead: the ramps end at once
                        lambda self, rows, now: np.full(np.shape(rows), 50.0))
    eng = Engine(random_bundle(), EngineConfig(max_sessions=n, max_lead_s=100.0, codec_thread=False))
    calls: collections.Counter = collections.Counter()
    for cls, name in ((EngineSession, "lookahead_ready"),
                      (EngineSession, "audio_ahead_s"), (EngineSession, "begin_step"), (PacketPolicy, "due")):
        method = getattr(cls, name)

        def counted(*a, _m=method, _name=name, **k):
            calls[_name] += 1
            return _m(*a, **k)
        monkeypatch.setattr(cls, name, counted)
    counts: list[tuple[int, dict]] = []  # (engine step, calls during it)
    step = eng._step

    def watched(slots):
        before = dict(calls)
        steady = len(slots) == n and all(eng.table.clocked[slots]) and all(eng.table.phase[slots] == RUNNING)
        step(slots)
        if steady:
            during = {k: v - before.get(k, 0) for k, v in calls.items() if v > before.get(k, 0)}
            counts.append((eng.clock.steps, during))
        if len(counts) >= 12:
            done.set()
    done = threading.Event()
    eng._step = watched
    handles = []
    voice = eng.make_voice("v", (np.random.default_rng(0).standard_normal(24000) * 0.1).astype(np.float32), 24000)
    for i in range(n):
        h = eng.open_session(SessionConfig(guidance_lambda=math.inf, seed=i), voice,
                             lambda ev: None)
        h.push_text(" ".join(numbered_words(60)))
        h.end_input()
        handles.append(h)
    eng.start()
    try:
        assert done.wait(120), f"only {len(counts)} steady steps"
    finally:
        for h in handles:
            h.cancel()
        eng.stop()
    full = frames_for_ms(SessionConfig().packet_ms)
    assert {k % full == 0 for k, _ in counts} == {True, False}  # steps at the clock's ticks and between them
    assert all(c == {} for _, c in counts), counts
