"""Chunk placement on the speech timeline (docs/design.md, "Chunks to speech time")."""
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
    assert tl.chunks[1].tau == 30 and changed[1] == 30
    assert tl.current_chunk(30) == 1
    # the third follows from the rate measured so far, never in the past
    assert tl.chunks[2].tau > 30
    # speech lagging: chunk 2 is pushed later, not started early
    before = tl.chunks[2].tau
    tl.replace(spoken_chars=12, frame=before + 5)
    assert tl.chunks[2].tau > before + 5


def test_client_speech_time_is_honoured():
    tl = SpeechTimeline(client_speech_time=True)
    assert tl.add(5, 0, client_time_s=0.0) == 0
    assert tl.add(5, 0, client_time_s=2.0) == 150
    tl.replace(spoken_chars=1, frame=10)
    assert tl.chunks[1].tau == 150


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
        upto = near._placed_through
        assert [c.tau for c in near.chunks[: upto + 1]] == [c.tau for c in full.chunks[: upto + 1]]
        assert near.frames_per_char == full.frames_per_char
        for t in (frame, frame - 8):
            assert near.current_chunk(t) == full.current_chunk(t)
        assert near.last_tau() in (None, full.chunks[-1].tau)


def test_text_far_ahead_is_not_walked_at_every_step():
    """A whole long answer sent at once: a step re-places the chunks it reaches and the
    next `horizon`, not all of them; the end of the text is not 'passed' meanwhile."""
    tl = _timeline([6] * 5000)
    changed = tl.replace(spoken_chars=13, frame=400, horizon=4)
    assert changed and max(i for i, _ in changed) <= 2 + 4
    assert tl.last_tau() is None  # the runaway guard cannot see the end as passed
    near_end = tl.replace(spoken_chars=6 * 4998, frame=90000, horizon=4)
    assert near_end and tl.last_tau() == tl.chunks[-1].tau > 90000


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
            if tl.chunks:
                spoken = min(tl.n_chars, max(0, spoken + rng.choice((-1, 0, 0, 1, 1, 2))))
                tl.replace(spoken, frame, horizon=rng.choice((2, 4, 10**9)))
            for t in (frame, max(0, frame - 8), frame + 3):
                assert tl.current_chunk(t) == current_chunk(t, (ch.tau for ch in tl.chunks)), (seed, frame, t)
