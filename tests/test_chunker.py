"""Token pieces -> whole words -> chunks."""
from livespeech.server.chunker import Chunker
from livespeech.api.session import ChunkingConfig


def words(chunks):
    return [c.words for c in chunks]


def test_partial_words_wait_for_whitespace():
    ch = Chunker(ChunkingConfig(min_words=2, max_words=3, first_max_words=3))
    assert ch.push("Hel", 0.0) == []
    assert ch.push("lo wor", 0.1) == []
    assert ch.pending_words == 1
    out = ch.push("ld how ", 0.2)
    assert words(out) == [["Hello", "world", "how"]]


def test_first_chunk_is_released_at_first_max_words():
    """Speech can start after the first min_words words (the default first_max_words);
    later chunks fill up to max_words."""
    ch = Chunker(ChunkingConfig(min_words=2, max_words=4))
    assert words(ch.push("one two three four five six seven eight ", 0.0)) == [
        ["one", "two"], ["three", "four", "five", "six"]]
    ch = Chunker(ChunkingConfig(min_words=2, max_words=4, first_max_words=3))
    assert words(ch.push("one two three four five six seven ", 0.0)) == [
        ["one", "two", "three"], ["four", "five", "six", "seven"]]
    # a one-word first chunk (speech may start at the second token) with later chunks of 2-4
    cfg = ChunkingConfig(min_words=2, max_words=4, first_max_words=1)
    cfg.validate()
    assert words(Chunker(cfg).push("one two three four five six ", 0.0)) == [["one"], ["two", "three", "four", "five"]]


def test_punctuation_flushes_and_indices_increase():
    ch = Chunker(ChunkingConfig(min_words=2, max_words=4))
    out = ch.push("Yes, I think so. Maybe ", 0.0)
    assert words(out) == [["Yes,"], ["I", "think", "so."]]
    assert [c.index for c in out] == [0, 1]
    assert words(ch.flush(1.0)) == [["Maybe"]]
    assert ch.flush(1.0) == []


def test_punctuation_flush_can_be_disabled():
    ch = Chunker(ChunkingConfig(min_words=1, max_words=3, flush_on_punctuation=False, first_max_words=3))
    assert words(ch.push("a, b. c d ", 0.0)) == [["a,", "b.", "c"]]


def test_timer_releases_pending_words():
    ch = Chunker(ChunkingConfig(min_words=2, max_words=4, timer_ms=300, first_max_words=4))
    ch.push("one two ", 0.0)
    assert ch.poll(0.2) == []
    assert ch.next_deadline() == 0.3
    assert words(ch.poll(0.31)) == [["one", "two"]]
    # a single word waits twice as long
    ch.push("three ", 1.0)
    assert ch.poll(1.4) == []
    assert words(ch.poll(1.61)) == [["three"]]


def test_client_flush_and_timestamps():
    ch = Chunker(ChunkingConfig(min_words=2, max_words=4))
    out = ch.push("hi there", 0.0, client_time_s=1.5, flush=True)
    assert words(out) == [["hi", "there"]] and out[0].client_time_s == 1.5


def test_waiting_speech_takes_min_words_at_once():
    """While the speech waits for text, min_words pending words go out as a chunk, not
    max_words; otherwise chunks fill up as before (or the timer releases them)."""
    ch = Chunker(ChunkingConfig(min_words=2, max_words=4, timer_ms=300))
    assert words(ch.push("one two ", 0.0)) == [["one", "two"]]
    assert ch.push("three ", 0.1) == []
    assert ch.poll(0.1, waiting=True) == []  # fewer than min_words
    assert ch.push("four ", 0.12) == []  # not max_words
    assert ch.poll(0.13) == []  # not waiting, the timer not due
    assert words(ch.poll(0.13, waiting=True)) == [["three", "four"]]
    assert words(ch.push("five six seven eight ", 0.2)) == [["five", "six", "seven", "eight"]]
    off = Chunker(ChunkingConfig(min_words=2, max_words=4, timer_ms=300, release_when_waiting=False))
    off.push("one two three four ", 0.0)
    assert off.poll(0.1, waiting=True) == []
    assert words(off.poll(0.4, waiting=True)) == [["three", "four"]]  # the timer's
