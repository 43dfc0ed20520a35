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
