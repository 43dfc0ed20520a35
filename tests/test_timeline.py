"""Chunk placement on the speech timeline (docs/design.md, "Chunks to speech time")."""
import pytest

from livespeech.server.timeline import SpeechTimeline


def test_fast_text_is_not_crammed():
    tl = SpeechTimeline(frames_per_char=5.0)
    assert tl.add(10, arrival_frame=0) == 0
    # arrives at once but must follow the first chunk's natural end (10 chars * 5)
    assert tl.add(8, arrival_frame=1) == 50
    assert tl.add(4, arrival_frame=2) == 90


def test_late_text_is_not_placed_before_arrival():
    tl = SpeechTimeline(frames_per_char=5.0)
    tl.add(4, 0)
    assert tl.add(4, arrival_frame=200) == 200


def test_progress_replaces_future_chunks():
    tl = SpeechTimeline(frames_per_char=5.0)
    tl.add(10, 0)
    tl.add(10, 0)
    tl.add(10, 0)
    # speech reached the second chunk early, at frame 30
    changed = dict(tl.replace(spoken_chars=11, frame=30))
    assert tl.tau(1) == 30 and changed[1] == 30
    assert tl.current_chunk(30) == 1
    # the third follows from the rate measured so far, never in the past
    assert tl.tau(2) > 30
    # speech lagging: chunk 2 is pushed later, not started early
    before = tl.tau(2)
    tl.replace(spoken_chars=12, frame=before + 5)
    assert tl.tau(2) > before + 5


def test_client_speech_time_is_honoured():
    tl = SpeechTimeline(client_speech_time=True)
    assert tl.add(5, 0, client_time_s=0.0) == 0
    assert tl.add(5, 0, client_time_s=2.0) == 150
    tl.replace(spoken_chars=1, frame=10)
    assert tl.tau(1) == 150


def _timeline(sizes, frames_per_char=5.0):
    tl = SpeechTimeline(frames_per_char=frames_per_char)
    for n in sizes:
        tl.add(n, arrival_frame=0)
    return tl


def test_replace_within_its_horizon_equals_a_full_replace():
    """Re-placing only the next chunks that move gives them the taus a walk over every
    chunk gives, step after step, and so the same current chunk at the frames a step reads."""
    import random
    rng = random.Random(7)
    sizes = [rng.randint(1, 12) for _ in range(60)]
    near, full = _timeline(sizes), _timeline(sizes)
    spoken = 0
    for frame in range(1, 2000, 3):
        spoken = min(sum(sizes), max(0, spoken + rng.choice((-1, 0, 1, 1, 2))))
        near.replace(spoken, frame, horizon=4)
        full.replace(spoken, frame, horizon=10**9)
        upto = near.placed_through
        assert near.taus[: upto + 1] == full.taus[: upto + 1]
        assert near.frames_per_char == full.frames_per_char
        for t in (frame, frame - 8):
            assert near.current_chunk(t) == full.current_chunk(t)
        assert near.last_tau() in (None, full.taus[-1])


def test_text_far_ahead_is_not_walked_at_every_step():
    """A whole long answer sent at once: a step re-places the chunks it reaches and the
    next `horizon`, not all of them; the end of the text is not 'passed' meanwhile."""
    tl = _timeline([6] * 5000)
    changed = tl.replace(spoken_chars=13, frame=400, horizon=4)
    assert changed and max(i for i, _ in changed) <= 2 + 4
    assert tl.last_tau() is None  # the runaway guard cannot see the end as passed
    near_end = tl.replace(spoken_chars=6 * 4998, frame=90000, horizon=4)
    assert near_end and tl.last_tau() == tl.taus[-1] > 90000


def test_current_chunk_equals_the_walk_over_every_chunk():
    """The current chunk found without walking the chunks already spoken is the one a walk
    from the first chunk finds (models.attention.current_chunk), at the frames a step
    reads (the frame, and the audio's 8 frames back), while chunks arrive, are spoken
    early or late, and some carry the client's speech time."""
    import random

    from livespeech.models.attention import current_chunk

    for seed in range(20):
        rng = random.Random(seed)
        tl = SpeechTimeline(frames_per_char=rng.choice((2.0, 5.0, 9.0)), client_speech_time=seed % 3 == 0)
        spoken = 0
        for frame in range(0, 1500):
            if rng.random() < 0.08:
                t = rng.uniform(0, frame / 75 + 2) if rng.random() < 0.5 else None
                tl.add(rng.randint(1, 12), frame, t)
            if tl.n_chars:
                spoken = min(tl.n_chars, max(0, spoken + rng.choice((-1, 0, 0, 1, 1, 2))))
                tl.replace(spoken, frame, horizon=rng.choice((2, 4, 10**9)))
            for t in (frame, max(0, frame - 8), frame + 3):
                assert tl.current_chunk(t) == current_chunk(t, tl.taus), (seed, frame, t)


class _Reference:
    """The placement rule chunk by chunk in plain Python, as the module docstring states
    it, for one timeline: what `SpeechTimelines` computes for a batch of rows."""

    def __init__(self, fpc: float, client: bool):
        self.fpc, self.client, self.tau, self.start, self.n, self.fixed = fpc, client, [], [], [], []
        self.placed_through = -1

    def add(self, n_chars, frame, t=None):
        start = self.start[-1] + self.n[-1] if self.tau else 0
        if self.client and t is not None:
            tau, fixed = max(int(round(t * 75)), self.tau[-1] if self.tau else 0), True
        else:
            tau = max(frame, self.tau[-1] + int(round(self.n[-1] * self.fpc))) if self.tau else 0
            fixed = False
        self.tau.append(tau), self.start.append(start), self.n.append(n_chars), self.fixed.append(fixed)
        return tau

    def current_chunk(self, frame):
        c = 0
        for i, tau in enumerate(self.tau):
            if tau > frame:
                break
            c = i
        return c

    def replace(self, spoken, frame, horizon):
        if not self.tau:
            return []
        if spoken > 0 and frame > 0:
            self.fpc = min(12.0, max(3.0, 0.9 * self.fpc + 0.1 * (frame / spoken)))
        changed = []
        cur = max(i for i in range(len(self.tau)) if self.start[i] <= spoken) if self.start[0] <= spoken else 0
        for i in range(cur + 1):
            if not self.fixed[i] and i > 0 and self.tau[i] > frame:
                self.tau[i] = frame
                changed.append((i, frame))
            self.fixed[i] = self.fixed[i] or self.tau[i] <= frame
        expected = frame + max(0, self.start[cur] + self.n[cur] - spoken) * self.fpc
        i, moving = cur + 1, 0
        while i < len(self.tau) and moving < horizon:
            if not self.fixed[i]:
                tau = max(int(round(expected)), frame + 1)
                if tau != self.tau[i]:
                    self.tau[i] = tau
                    changed.append((i, tau))
                moving += 1
            expected = self.tau[i] + self.n[i] * self.fpc
            i += 1
        self.placed_through = i - 1
        return changed


@pytest.mark.parametrize("loops", ["compiled", "python"])
def test_a_batch_of_timelines_replaced_together_follows_the_rule_chunk_by_chunk(loops, monkeypatch):
    """Rows re-placed in one `SpeechTimelines.replace` each get what the rule gives it alone
    (`_Reference`): the same taus, speaking rate, chunks moved (in order), current chunks
    and last tau, while chunks arrive (some with the client's speech time, some with no
    characters), progress moves on, stalls and steps back, rows sit steps out, and the
    table grows its rows; with the loops compiled (numba) and as Python (without it)."""
    import random

    import numpy as np

    from livespeech.server import timeline
    from livespeech.server.timeline import SpeechTimelines

    if loops == "python":
        for name in ("_current_chunk", "_current_chunks", "_replace_rows"):
            monkeypatch.setattr(timeline, name, getattr(getattr(timeline, name), "py_func", getattr(timeline, name)))

    rng = random.Random(3)
    slots = 9
    table = SpeechTimelines(slots, chunks=4)
    refs, views, spoken = [], [], [0] * slots
    for s in range(slots):
        fpc, client = rng.choice((2.0, 4.3, 9.0)), s % 3 == 0
        views.append(table.bind(s, client_speech_time=client, frames_per_char=fpc))
        refs.append(_Reference(fpc, client))
    for frame in range(0, 900):
        for s in range(slots):
            if rng.random() < 0.06:
                n, t = rng.choice((0, 1, 3, 5, 12)), (rng.uniform(0, frame / 75 + 2) if rng.random() < 0.3 else None)
                assert views[s].add(n, frame, t) == refs[s].add(n, frame, t)
        rows = [s for s in range(slots) if rng.random() < 0.8]
        for s in rows:
            total = refs[s].start[-1] + refs[s].n[-1] if refs[s].tau else 0
            spoken[s] = min(total, max(0, spoken[s] + rng.choice((-2, 0, 0, 1, 1, 2, 5))))
        horizon = [rng.choice((1, 4, 10**9)) for _ in rows]
        moved = table.replace(np.array(rows, np.int64), np.array([spoken[s] for s in rows], np.int64),
                              np.full(len(rows), frame, np.int64), np.array(horizon, np.int64))
        got = [[] for _ in rows]
        for at, chunk, tau in zip(moved.at.tolist(), moved.chunk.tolist(), moved.tau.tolist()):
            got[at].append((chunk, tau))
        for k, s in enumerate(rows):
            assert got[k] == refs[s].replace(spoken[s], frame, horizon[k]), (frame, s)
        for s in range(slots):
            ref, view = refs[s], views[s]
            assert view.taus == ref.tau and view.frames_per_char == ref.fpc, (frame, s)
            for t in (frame, max(0, frame - 8)):
                assert view.current_chunk(t) == ref.current_chunk(t)
            if s in rows:
                assert view.placed_through == ref.placed_through
        frames = np.array([max(0, frame - rng.choice((0, 8))) for _ in range(slots)], np.int64)
        assert table.current_chunks(np.arange(slots), frames).tolist() == [
            refs[s].current_chunk(int(frames[s])) for s in range(slots)]
    assert table.width > 4  # the rows grew


def test_rows_a_long_session_widened_narrow_once_it_has_left():
    """One session's long text widens every row of the table; the next session bound
    where no row needs a quarter of that width narrows them again, the other rows'
    chunks kept."""
    from livespeech.server.timeline import SpeechTimelines

    table = SpeechTimelines(4, chunks=8)
    short, long = table.bind(0), table.bind(1)
    for n in (3, 4, 5):
        short.add(n, 0)
    before = short.taus
    for _ in range(1000):
        long.add(2, 0)
    assert table.width == 1024
    table.bind(2)  # the long session still speaks: nothing narrows
    assert table.width == 1024
    table.bind(1)  # it ended; its slot takes a new session
    assert table.width == 8 and short.taus == before and short.n_chars == 12
    assert short.add(1, 0) == before[-1] + round(5 * short.frames_per_char)


@pytest.mark.parametrize("loops", ["compiled", "python"])
def test_a_batch_of_windows_shows_the_np_and_nf_text_chunks_around_each_current_chunk(loops, monkeypatch):
    """`SpeechTimelines.windows` of a batch: for each row, the first chunk of the text
    chunk np before its current chunk's, the last chunk in memory of the text chunk nf
    after it, and that text chunk, as the text chunks' first chunks give them (text
    chunks without a chunk among them, unbounded np, rows without chunks); compiled and
    as Python."""
    import random

    import numpy as np

    from livespeech.models.attention import window_chunk_range
    from livespeech.server import timeline
    from livespeech.server.timeline import SpeechTimelines

    if loops == "python":
        for name in ("_window", "_windows", "first_at_least", "_window_chunk_range"):
            monkeypatch.setattr(timeline, name, getattr(getattr(timeline, name), "py_func", getattr(timeline, name)))

    rng = random.Random(5)
    slots = 12
    for trial in range(40):
        table = SpeechTimelines(slots, chunks=4)
        starts = [[] for _ in range(slots)]  # each text chunk's first chunk
        for s in range(slots):
            table.bind(s, n_past=rng.choice((-1, 0, 1, 4)), n_future=rng.choice((0, 1, 3)))
            n = 0
            for _ in range(rng.choice((0, 1, 5, 20))):
                table.begin_text_chunk(s)
                starts[s].append(n)
                for _ in range(rng.choice((0, 1, 1, 2, 4))):
                    table.add(s, 3, 0)
                    n += 1
            table.in_memory[s] = rng.randint(0, n)
        rows = np.array(rng.sample(range(slots), rng.randint(1, slots)), np.int64)
        current = np.array([rng.randrange(max(1, int(table.count[s]))) for s in rows], np.int64)
        got = table.windows(rows, current)
        for r, s in enumerate(rows.tolist()):
            n = int(table.count[s])
            if n == 0:
                want = (0, -1, -1)
            else:
                k = int(table.text_chunk[s, current[r]])
                past = int(table.n_past[s])
                first, last = window_chunk_range(k, None if past < 0 else past, int(table.n_future[s]),
                                                 len(starts[s]))
                end = starts[s][last + 1] if last + 1 < len(starts[s]) else n
                want = (starts[s][first], min(end, int(table.in_memory[s])) - 1, last)
            assert (got.lo[r], got.hi[r], got.last_text_chunk[r]) == want, (trial, s)
            assert table.window(s, int(current[r])) == want
