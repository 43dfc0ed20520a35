"""`GuidanceBatch` (every slot's guidance as tensors) equals `GuidanceState` (one session's,
in Python) call for call: best prefixes, distance, progress, band, guiding sets, EOS."""
import json
import random

import pytest
import torch

from livespeech.models.graphemes import BLANK, EOS, SPACE, text_to_ids
from livespeech.models.guidance import GuidanceState
from livespeech.models.guidance_batch import GuidanceBatch


def _assert_same(batch: GuidanceBatch, states: list, slots: list[int]) -> None:
    idx = torch.tensor(slots)
    guide, barred = batch.guide(idx)
    for k, (s, st) in enumerate(zip(slots, states)):
        lo = int(batch.lo[s])
        best = [lo + c for c in batch.best[s].nonzero().flatten().tolist()]
        where = f"slot {s}: {st!r}"
        assert best == list(st.best_prefixes), where
        assert int(batch.best_ed[s]) == st.distance, where
        assert int(batch.progress[s]) == st.progress, where
        assert (lo, lo + int(batch.width[s]) - 1) == st.band_range, where
        assert int(batch.m[s]) == st.stream_length, where
        assert batch.transcript_length(s) == st.transcript_length, where
        assert guide[k].nonzero().flatten().tolist() == st.guiding_set(), where
        assert bool(barred[k]) == (not st.speech_may_end), where


def _noisy(rng: random.Random, text: list[int], alphabet: list[int]) -> list[int]:
    """Frames of a noisy reading of `text`: repeats, blanks, substitutions, insertions,
    deletions, now and then a jump ahead or back."""
    frames, i = [], 0
    while i < len(text):
        r = rng.random()
        if r < 0.03:
            i = max(0, i + rng.randint(-8, 8))
            continue
        g = rng.choice(alphabet) if r < 0.12 else text[i]
        frames.extend([g] * rng.randint(1, 3))
        if rng.random() < 0.08:
            frames.append(BLANK)
        if rng.random() < 0.9:
            i += 1
    return frames


@pytest.mark.parametrize("band", [4, 8, 32])
def test_batch_equals_per_session_state_call_for_call(band: int) -> None:
    """Six slots at once, each its own script: text chunks arriving ahead of and behind the
    speech, noisy and random frames (BLANK, EOS, repeats), the input ending, a slot reset
    and reused. After every call every slot equals its `GuidanceState`."""
    rng = random.Random(band)
    alphabet = [SPACE] + text_to_ids("abcdexyz")
    n_slots = 6
    batch = GuidanceBatch(n_slots, band=band, ring=256)
    states = [GuidanceState(band=band) for _ in range(n_slots)]
    slots = list(range(n_slots))
    texts = [[rng.choice(alphabet) for _ in range(rng.randint(0, 90))] for _ in slots]
    frames = [_noisy(rng, t, alphabet) if s % 3 else [rng.choice(alphabet + [BLANK, EOS]) for _ in range(120)]
              for s, t in zip(slots, texts)]
    given = [0] * n_slots
    _assert_same(batch, states, slots)
    for step in range(160):
        # text: chunks of 1-6 graphemes, some slots ahead of the speech, some behind
        chunks = {}
        for s in slots:
            if given[s] < len(texts[s]) and rng.random() < (0.5 if s % 2 else 0.2):
                k = rng.randint(1, 6)
                chunks[s] = texts[s][given[s]: given[s] + k]
                given[s] += k
        batch.extend(chunks)
        for s, c in chunks.items():
            states[s].extend_transcript(c)
        _assert_same(batch, states, slots)
        ended = [s for s in slots if given[s] >= len(texts[s]) and not states[s].input_complete]
        if ended and rng.random() < 0.3:
            batch.end_input(ended)
            for s in ended:
                states[s].end_input()
        # one frame for a random subset of slots (a decode step's batch)
        stepping = sorted(rng.sample(slots, rng.randint(1, n_slots)))
        g = [frames[s][step % len(frames[s])] if frames[s] else BLANK for s in stepping]
        batch.observe(torch.tensor(stepping), torch.tensor(g))
        for s, x in zip(stepping, g):
            states[s].observe(x)
        _assert_same(batch, states, slots)
        if step == 80:  # slot 0 ends and a new session takes it
            batch.reset([0])
            states[0], given[0] = GuidanceState(band=band), 0
            _assert_same(batch, states, slots)


def test_a_clean_long_reading_stays_equal_and_the_ring_wraps() -> None:
    """A 2,000-grapheme text read cleanly through a 128-token ring: the band follows the
    speech to the end and the ring reuses its room."""
    text = text_to_ids("the quick brown fox jumps over the lazy dog " * 45)
    batch = GuidanceBatch(2, band=16, ring=128)
    states = [GuidanceState(band=16), GuidanceState(band=16)]
    pos = 0
    for i, g in enumerate(text):
        if pos < len(text) and pos - i < 40:
            chunk = text[pos: pos + 20]
            batch.extend({0: chunk, 1: chunk})
            for st in states:
                st.extend_transcript(chunk)
            pos += 20
        batch.observe(torch.tensor([0, 1]), torch.tensor([g, BLANK if i % 7 == 0 else g]))
        states[0].observe(g)
        states[1].observe(BLANK if i % 7 == 0 else g)
    batch.end_input([0, 1])
    for st in states:
        st.end_input()
    _assert_same(batch, states, [0, 1])
    assert int(batch.lo[0]) > 4 * batch.ring  # the band moved on, the ring wrapped
    assert not bool(batch.guide(torch.tensor([0])).eos_barred[0])  # fully spoken: EOS allowed


def test_text_beyond_the_ring_is_refused() -> None:
    batch = GuidanceBatch(1, band=4, ring=16)
    batch.extend({0: text_to_ids("abababab")})
    with pytest.raises(ValueError, match="exceed"):
        batch.extend({0: text_to_ids("cdcdcdcdcd")})
    with pytest.raises(ValueError, match="out of range"):
        batch.extend({0: [EOS]})


def _script(batch: GuidanceBatch, steps: int = 120, seed: int = 0) -> list:
    """A fixed run of text chunks and frames over every slot; the progress after each step."""
    rng = random.Random(seed)
    alphabet = [SPACE] + text_to_ids("abcdexyz")
    slots = list(range(batch.slots))
    texts = [[rng.choice(alphabet) for _ in range(80)] for _ in slots]
    out = []
    for t in range(steps):
        if t % 10 == 0:
            batch.extend({s: texts[s][t // 2: t // 2 + 6] for s in slots})
        stepping = sorted(rng.sample(slots, rng.randint(1, len(slots))))
        g = [texts[s][min(t // 3 + rng.randint(-2, 2), 79)] if rng.random() < 0.9 else BLANK for s in stepping]
        batch.observe(torch.tensor(stepping, device=batch.device), torch.tensor(g, device=batch.device))
        out.append(batch.progress.tolist())
    return out


def test_the_state_stays_in_its_own_memory() -> None:
    """Every call writes the state tensors in place (what a recorded CUDA graph reads)."""
    batch = GuidanceBatch(3, band=8, ring=64)
    ptrs = {name: getattr(batch, name).data_ptr() for name in
            ("row", "hist_sym", "hist_val", "best", "lo", "width", "n", "m", "progress", "tokens")}
    _script(batch, steps=40)
    batch.end_input([0])
    batch.reset([1])
    assert {name: getattr(batch, name).data_ptr() for name in ptrs} == ptrs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_the_recorded_graph_observes_as_the_eager_calls() -> None:
    eager, graph = GuidanceBatch(4, band=8, ring=256, device="cuda"), GuidanceBatch(4, band=8, ring=256, device="cuda")
    graph.capture()
    assert _script(graph) == _script(eager)
    assert torch.equal(graph.row, eager.row) and torch.equal(graph.best, eager.best)


def test_the_guidance_benchmark_runs(capsys) -> None:
    from livespeech.loadtest import bench_step
    assert bench_step.main(["--guidance-only", "--batch", "2", "--steps", "5"]) == 0
    row = json.loads(capsys.readouterr().out.strip())
    assert row["batch"] == 2 and row["guidance_python_ms"] > 0 and row["guidance_tensors_ms"] > 0


def test_words_queued_and_extended_together_equal_words_extended_one_by_one() -> None:
    """`queue` (a word at a time, as text arrives) then one `extend` of every slot's words
    at the next `guide` or `observe` ends where extending word by word does, through noisy
    readings; an `extend` recentres every slot, so queued words cost one for all."""
    rng = random.Random(7)
    alphabet = text_to_ids("abcdexyz")
    n_slots, band = 5, 8
    batch = GuidanceBatch(n_slots, band=band, ring=512)
    states = [GuidanceState(band=band) for _ in range(n_slots)]
    slots = list(range(n_slots))
    words = {s: [[rng.choice(alphabet) for _ in range(rng.randint(1, 6))] for _ in range(30)] for s in slots}
    text = {s: [] for s in slots}
    extends = []
    real_extend = batch.extend
    batch.extend = lambda chunks: (extends.append(sorted(chunks)), real_extend(chunks))[1]
    for step in range(120):
        n_extends = len(extends)
        for s in slots:  # words arrive, each slot at its own pace
            while words[s] and rng.random() < 0.4:
                piece = ([SPACE] if text[s] else []) + words[s].pop(0)
                text[s] += piece
                batch.queue(s, piece)
                states[s].extend_transcript(piece)
        frames = {s: (text[s][min(len(text[s]) - 1, states[s].progress + rng.randint(-1, 1))]
                      if text[s] and rng.random() < 0.85 else rng.choice(alphabet + [BLANK])) for s in slots}
        batch.observe(torch.tensor(slots), torch.tensor([frames[s] for s in slots]))
        for s in slots:
            states[s].observe(frames[s])
        assert len(extends) <= n_extends + 1  # every slot's queued words in one call
        _assert_same(batch, states, slots)
    assert extends and max(len(e) for e in extends) > 1


def test_a_transcript_past_the_ring_fails_where_its_text_is_queued_and_spares_the_others() -> None:
    batch = GuidanceBatch(2, band=4, ring=16)
    batch.queue(1, text_to_ids("ab"))
    with pytest.raises(ValueError):
        for _ in range(20):
            batch.queue(0, text_to_ids("cd"))
    batch.flush()
    assert batch.transcript_length(1) == 2
