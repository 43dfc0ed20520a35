"""Released text chunks in the model's memory: a chunk a word, the np/nf window and the
start policy counted in the text chunks the chunker released."""
import pytest
from conftest import numbered_words

from livespeech.api.session import ChunkingConfig, SessionConfig
from livespeech.models.tokenizer import get_tokenizer
from livespeech.server.chunker import TextChunk
from livespeech.server.metrics import Metrics
from livespeech.server.session import EngineSession, SessionLimits
from livespeech.server.text_memory import TextMemory

TEXT_CHUNKS = [["Hello", "there", "my"], ["good", "friend,"], ["how", "are", "you"], ["today?"]]


class MemoryRecorder:
    """The part of `ModelRunner` the text memory calls: records the chunks added."""

    text_capacity = 10_000

    def __init__(self):
        self.added: list[tuple[list[int], int, int]] = []  # (token ids, tau, chunk)

    def add_chunk(self, slot, token_ids, tau, chunk):
        self.added.append((list(token_ids), tau, chunk))

    def place_chunks(self, slots, chunks, taus):
        pass

    def evict_chunks_before(self, slot, chunk):
        pass


def session(n_past: int, n_future: int, start_future: int = 0) -> EngineSession:
    config = SessionConfig(n_past_chunks=n_past, n_future_chunks=n_future, start_future_chunks=start_future,
                           chunking=ChunkingConfig(min_words=1, max_words=3))
    limits = SessionLimits(max_text_piece_chars=1000, max_session_text_chars=10_000, max_session_s=60,
                           max_overrun_s=5)
    s = EngineSession("s", config, None, None, lambda *a: None, limits, audio_lag_frames=0)
    s.slot = 0
    return s


def release(s: EngineSession, memory: TextMemory, text_chunks) -> None:
    memory.release(s, [TextChunk(s.timeline.text_chunks + i, words, 0.0) for i, words in enumerate(text_chunks)])


def test_each_word_is_a_chunk_of_the_memory_at_its_own_frame():
    runner, tok = MemoryRecorder(), get_tokenizer()
    s = session(n_past=1, n_future=1)
    release(s, TextMemory(runner, tok, 64, Metrics()), TEXT_CHUNKS)
    words = [w for chunk in TEXT_CHUNKS for w in chunk]
    assert [chunk for _, _, chunk in runner.added] == list(range(len(words)))
    # the same ids as the whole text tokenized at once: ids do not depend on chunking
    assert [i for ids, _, _ in runner.added for i in ids] == tok.encode_words(words, first_in_text=True)
    taus = [tau for _, tau, _ in runner.added]
    assert taus == sorted(taus) and len(set(taus)) == len(taus)
    assert [c.text_chunk for c in s.chunks] == [0, 0, 0, 1, 1, 2, 2, 2, 3]


def test_a_written_number_is_said_in_words_while_the_written_word_is_the_one_timed():
    from livespeech.models import graphemes

    runner, tok = MemoryRecorder(), get_tokenizer()
    s = session(n_past=4, n_future=2)
    release(s, TextMemory(runner, tok, 64, Metrics()), [["It", "costs", "$42.50,", "ok?"]])
    said = ["It", "costs", "forty", "two", "dollars", "and", "fifty", "cents,", "ok?"]
    # the model's memory holds a chunk for each word said, tokenized as that word
    assert [ids for ids, _, _ in runner.added] == [tok.encode_words([w], first_in_text=i == 0)
                                                  for i, w in enumerate(said)]
    # the transcript the graphemes follow is the words said; the words timed and
    # summed up are the written ones, "$42.50," spanning all six of its words
    assert s.guidance.transcript == graphemes.collapse_repeats(
        graphemes.text_to_ids("it costs forty two dollars and fifty cents ok"))
    assert [w.text for w in s.words] == ["It", "costs", "$42.50,", "ok?"]
    span = s.words[2]
    assert s.guidance.transcript[span.char_start:span.char_end] == graphemes.collapse_repeats(
        graphemes.text_to_ids("forty two dollars and fifty cents"))
    # and without the spoken form, the model reads "$42.50," as written
    plain, runner2 = session(n_past=4, n_future=2), MemoryRecorder()
    release(plain, TextMemory(runner2, tok, 64, Metrics(), spoken_form=False), [["It", "costs", "$42.50,", "ok?"]])
    assert len(runner2.added) == 4 and [w.text for w in plain.words] == ["It", "costs", "$42.50,", "ok?"]


def test_the_window_counts_released_text_chunks_not_words():
    s = session(n_past=1, n_future=1)
    release(s, TextMemory(MemoryRecorder(), get_tokenizer(), 64, Metrics()), TEXT_CHUNKS)
    tau = s.timeline.taus
    seen = {}
    for word in (0, 4, 5, 8):  # "Hello", "friend,", "how", "today?"
        s.step_count = tau[word]
        seen[word] = s.window()
    # the words of the text chunk before the current word's, its own, and the one after
    assert seen == {0: (0, 4), 4: (0, 7), 5: (3, 8), 8: (5, 8)}


def test_the_start_waits_for_whole_text_chunks_of_lookahead():
    s = session(n_past=4, n_future=1, start_future=1)
    memory = TextMemory(MemoryRecorder(), get_tokenizer(), 64, Metrics())
    release(s, memory, TEXT_CHUNKS[:1])
    # three words in memory, but no text chunk after the first
    assert len(s.chunks) == 3 and not s.lookahead_ready()
    release(s, memory, TEXT_CHUNKS[1:2])
    assert s.lookahead_ready()


class RoomRecorder(MemoryRecorder):
    """A memory of `capacity` tokens, cached chunk by chunk in order, like `DecodeState`'s."""

    def __init__(self, capacity: int):
        super().__init__()
        self.text_capacity = capacity
        self.cached: list[tuple[int, int]] = []  # (chunk, tokens)
        self.evicted: list[int] = []  # tokens freed by each eviction that freed any

    def text_room(self, slot):
        return self.text_capacity - sum(n for _, n in self.cached)

    def add_chunk(self, slot, token_ids, tau, chunk):
        super().add_chunk(slot, token_ids, tau, chunk)
        assert len(token_ids) <= self.text_room(slot)
        self.cached.append((chunk, len(token_ids)))

    def evict_chunks_before(self, slot, chunk):
        if freed := self.tokens_before(slot, chunk):
            self.evicted.append(freed)
            self.cached = [(c, n) for c, n in self.cached if c >= chunk]

    def tokens_before(self, slot, chunk):
        return sum(n for c, n in self.cached if c < chunk)


def test_text_far_ahead_of_the_speech_is_evicted_in_batches_and_the_window_always_has_its_chunks():
    from livespeech.server.text_memory import EVICT_MIN_TOKENS

    words = numbered_words(200)
    runner = RoomRecorder(capacity=4 * EVICT_MIN_TOKENS)
    s = session(n_past=2, n_future=2)
    memory = TextMemory(runner, get_tokenizer(), 64, Metrics())
    release(s, memory, [[w] for w in words])  # the whole text at once, as an LLM far ahead sends it
    assert len(s.chunks) == len(words) and 0 < s.n_in_memory < len(words)
    tau = s.timeline.taus
    for frame in range(tau[-1] + 1):  # the speech moves along every frame of the text
        s.step_count = frame
        memory.evict_past(s)
        lo, hi = s.window()
        cached = [c for c, _ in runner.cached]
        # every chunk of the np/nf window is in memory, and the next one
        assert set(range(lo, min(hi + 2, len(words)))) <= set(cached), frame
    assert [c for _, _, c in runner.added] == list(range(len(words)))
    # a word the window passed did not cost an eviction of its own
    assert runner.evicted and min(runner.evicted) >= EVICT_MIN_TOKENS


@pytest.mark.parametrize("capacity", [64, 14])
def test_a_session_whose_memory_has_no_work_is_told_so(capacity):
    """`TextMemory.due` says, from the timeline's counts, which sessions `evict_past` has
    work for: where it says none, `evict_past` would neither evict nor move a chunk in;
    with text far ahead of the speech that is most steps, and the counts agree with
    the memory's own. At 14 tokens the memory holds little more than the window, and
    chunks are evicted for the window's next one before EVICT_MIN_TOKENS of them left."""
    import numpy as np

    words = numbered_words(200)
    runner = RoomRecorder(capacity=capacity)
    s = session(n_past=2, n_future=2)
    memory = TextMemory(runner, get_tokenizer(), 64, Metrics())
    release(s, memory, [[w] for w in words])
    table, rows = s.timeline.table, np.array([s.timeline.slot])
    tau, due_at = s.timeline.taus, []
    for frame in range(tau[-1] + 1):
        s.step_count = frame
        due = memory.due(table, rows, table.windows(rows, table.current_chunks(rows, np.array([frame]))))[0]
        before = (len(runner.added), len(runner.evicted), list(runner.cached))
        memory.evict_past(s)
        if not due:
            assert (len(runner.added), len(runner.evicted), runner.cached) == before, frame
        due_at += [frame] * bool(due)
        assert s.timeline.cached_tokens() == sum(n for _, n in runner.cached)
        assert s.n_in_memory == len(runner.added)
    assert 0 < len(due_at) < (tau[-1] + 1) / 4


def test_words_the_model_cannot_say_and_words_still_held_are_reported_unspoken():
    runner, tok = MemoryRecorder(), get_tokenizer()
    s = session(n_past=4, n_future=2)
    memory = TextMemory(runner, tok, 64, Metrics())
    release(s, memory, [["Привет", "мир", "my", "—", "👍", "friend", "你好."]])
    assert [w.text for w in s.words] == ["my", "friend"]
    # in order, where they were; punctuation and emoji say nothing
    assert s.unspoken_words() == ["Привет", "мир", "my", "friend", "你好."]
    # so is a word the chunker still holds (no space after it yet), in any script
    s.chunker.push("and Привет", 0.0, None, False)
    assert s.chunker.held_words()[-1] == "Привет"
    assert s.unspoken_words()[-1] == "Привет"
