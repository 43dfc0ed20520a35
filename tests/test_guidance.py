"""Semantic guidance (Algorithm 1): guiding sets, the banded incremental DP against a
from-scratch full DP, per-step cost, and the batched samplers."""
import math
import random
from fractions import Fraction

import pytest
import torch

from livespeech.models.graphemes import (BLANK, EOS, SPACE, VOCAB_SIZE, collapse_repeats, ctc_collapse,
                              ids_to_text, text_to_ids)
from livespeech.models.guidance import GuidanceState, sample_graphemes, sample_top_k

A, B, C = text_to_ids("abc")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only spin on a shared 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def ids(text):
    return text_to_ids(text)


def frames_of(text):
    """Frame ids of a literal stream ('_' = BLANK); no normalisation (spaces kept)."""
    return [BLANK if ch == "_" else (SPACE if ch == " " else text_to_ids(ch)[0]) for ch in text]


def state_after(transcript, frames, complete=False, band=32):
    st = GuidanceState(ids(transcript), band=band, input_complete=complete)
    for g in frames_of(frames):
        st.observe(g)
    return st


def gtext(st):
    return "".join("<blank>" if g == BLANK else "<eos>" if g == EOS else ids_to_text([g])
                   for g in st.guiding_set())


# --------------------------------------------------------------------- reference
def full_rows(stream, T):
    """ED(stream, T[:i]) for every i: the textbook full DP, from scratch."""
    prev = list(range(len(T) + 1))
    for r, s in enumerate(stream, 1):
        cur = [r]
        for i in range(1, len(T) + 1):
            cur.append(min(prev[i] + 1, cur[i - 1] + 1, prev[i - 1] + (s != T[i - 1])))
        prev = cur
    return prev


def ref_best(row, m):
    """Brute force over all prefixes: argmin of CER (exact fractions), module's i=0 rule."""
    n = len(row) - 1
    scores = {}
    for i, e in enumerate(row):
        if i == 0:
            if m == 0 or n == 0:
                scores[0] = Fraction(0) if m == 0 else Fraction(e)
        else:
            scores[i] = Fraction(e, i)
    lo = min(scores.values())
    return [i for i in sorted(scores) if scores[i] == lo]


def ref_progress(row, best):
    least = min(row)
    return min(best[0], max(i for i, e in enumerate(row) if e == least))


def ref_guide(best, T, complete):
    out = set()
    for i in best:
        if i >= 1:
            out.add(T[i - 1])
        if i < len(T):
            out.add(T[i])
        elif complete:
            out |= {BLANK, EOS}
    return sorted(out)


def test_reference_dp_matches_naive_levenshtein():
    def lev(a, b):
        if not a or not b:
            return len(a) + len(b)
        return min(lev(a[1:], b) + 1, lev(a, b[1:]) + 1, lev(a[1:], b[1:]) + (a[0] != b[0]))

    rng = random.Random(0)
    for _ in range(30):
        s = [rng.choice("abc") for _ in range(rng.randint(0, 5))]
        t = [rng.choice("abc") for _ in range(rng.randint(0, 5))]
        assert full_rows(s, t) == [lev(s, t[:i]) for i in range(len(t) + 1)]


# --------------------------------------------------------------------- worked examples
def test_paper_stream_collapses_to_abc():
    filled = "aaaaabbbbbbbbbbcc__"  # the paper's example after blank filling
    raw = "aa___bbbb______cc__"  # ... and before
    assert ctc_collapse(frames_of(filled)) == [A, B, C]
    assert ctc_collapse(frames_of(raw)) == [A, B, C]
    st = state_after("abc", filled)
    assert (st.stream_length, st.best_prefixes, st.distance) == (3, (3,), 0)
    assert st.guiding_set() == [C]  # fully spoken, more text may come: stay only
    st.end_input()
    assert st.guiding_set() == sorted([C, BLANK, EOS])


@pytest.mark.parametrize("frames, best, guide", [
    ("", (0,), "h"),  # empty stream: the empty prefix, move to the first token
    ("h", (1,), "eh"),
    ("hhheee", (2,), "el"),
    ("helo w", (6,), "ow"),
    ("hello w", (6,), "ow"),  # doubled letters collapse on both sides
    ("hxlo", (4,), " o"),  # substitution: CER 1/4 at "helo" beats 2/3 and 2/5
    ("hhhxxxlllooo", (4,), " o"),
    ("he_e", (3,), "lo"),  # BLANK between equal graphemes: a 2nd e, read as l->e (1/3 < 1/2)
    ("helo world", (10,), "d"),
    ("helo wrld", (10,), "d"),  # fully spoken despite a deletion
])
def test_guiding_set_examples(frames, best, guide):
    st = state_after("hello world", frames)
    assert st.best_prefixes == best
    assert gtext(st) == guide
    assert st.progress == best[0]


def test_eos_only_when_input_complete_and_fully_spoken():
    st = state_after("hello world", "helo wor")
    st.end_input()
    assert EOS not in st.guiding_set()  # not fully spoken yet
    for g in frames_of("ld"):
        st.observe(g)
    assert gtext(st) == "<blank><eos>d"
    st = state_after("hello world", "helo world", complete=False)
    assert EOS not in st.guiding_set() and BLANK not in st.guiding_set()


def test_empty_transcript():
    st = GuidanceState()
    assert st.guiding_set() == []  # nothing to guide: plain top-k
    st.observe(A)
    assert st.best_prefixes == (0,) and st.guiding_set() == []
    st.end_input()
    assert st.guiding_set() == [BLANK, EOS]


def test_transcript_is_collapsed_and_validated():
    st = GuidanceState(ids("hello"))
    assert st.transcript_length == 4  # "helo"
    st.extend_transcript([ids("o")[0], SPACE] + ids("oops"))  # 'o' merges across the join
    assert st.transcript_length == len(collapse_repeats(ids("hello oops")))
    with pytest.raises(ValueError):
        st.extend_transcript([BLANK])
    with pytest.raises(ValueError):
        st.extend_transcript([VOCAB_SIZE])
    with pytest.raises(ValueError):
        GuidanceState(band=2)


def test_wrong_first_grapheme_does_not_drag_the_band_away():
    text = "hello there my friend what a day"
    st = GuidanceState(ids(text), band=32)  # lookback 8
    st.observe(ids("w")[0])
    assert st.best_prefixes[0] > 10  # the paper's CER jumps to the first 'w' ...
    assert st.progress <= 1 and st.band_range[0] == 0  # ... progress and band do not
    for g in frames_of("hello there"):
        st.observe(g)
    assert st.progress == st.best_prefixes[0] == len(collapse_repeats(ids("hello there")))
    assert st.distance == 1


def test_speech_ahead_of_text_is_matched_when_text_arrives():
    st = state_after("hello", "hello world")  # the model ran ahead of the known text
    assert st.best_prefixes == (4,) and st.distance == 6
    st.extend_transcript([SPACE] + ids("world"))
    assert st.best_prefixes == (10,) and st.distance == 0


# --------------------------------------------------------------------- incremental == full DP
def _check(st, stream, T, complete):
    row = full_rows(stream, T)
    best = ref_best(row, len(stream))
    lo, hi = st.band_range
    in_band = lo <= best[0] and best[-1] <= hi
    if in_band:
        assert list(st.best_prefixes) == best, (stream, T)
        assert st.distance == row[best[0]]
        assert st.guiding_set() == ref_guide(best, T, complete)
        assert st.progress == ref_progress(row, best)  # (the band is the whole DP here)
    return in_band


def test_unbanded_equals_full_dp_on_random_streams():
    """Band wider than everything: must equal the full DP exactly, for any stream,
    with text chunks arriving before, during and after the speech they describe."""
    rng = random.Random(1)
    alphabet = [A, B, C, SPACE]
    for trial in range(12):
        full = collapse_repeats([rng.choice(alphabet) for _ in range(rng.randint(0, 45))])
        st = GuidanceState(band=1000)
        T, frames, known = [], [], 0
        complete = False
        while len(frames) < 120:
            if rng.random() < 0.12 and known < len(full):
                k = rng.randint(1, 8)
                chunk = full[known:known + k]
                known += len(chunk)
                st.extend_transcript(chunk)
                T = collapse_repeats(T + chunk)
            elif known == len(full) and not complete and rng.random() < 0.05:
                complete = True
                st.end_input()
            else:
                g = rng.choice(alphabet + [BLANK, BLANK])
                for _ in range(rng.randint(1, 3)):
                    frames.append(g)
                    st.observe(g)
            assert _check(st, ctc_collapse(frames), T, complete)


def _noisy_stream(rng, T, p_sub=0.05, p_del=0.04, p_ins=0.04):
    alphabet = [A, B, C, SPACE] + ids("xyz")
    out = []
    for t in T:
        r = rng.random()
        if r < p_del:
            continue
        out.append(rng.choice(alphabet) if r < p_del + p_sub else t)
        if rng.random() < p_ins:
            out.append(rng.choice(alphabet))
    return out


@pytest.mark.parametrize("mode", ["noisy", "random"])
def test_banded_equals_full_dp_when_best_prefix_in_band(mode):
    """Band of 16 over ~130-char transcripts revealed in chunks (sometimes after the
    speech that matches them): equal to the full DP whenever the full DP's best
    prefixes lie inside the band (always for noisy copies; often for random streams)."""
    rng = random.Random(2)
    band = 16
    checks = in_band = 0
    for trial in range(4):
        full = collapse_repeats([rng.choice([A, B, C, SPACE] + ids("de")) for _ in range(160)])
        if mode == "noisy":
            syms = _noisy_stream(rng, full)
        else:
            syms = [rng.choice([A, B, C, SPACE] + ids("dexy")) for _ in range(130)]
        st = GuidanceState(full[:5], band=band)
        T, known = list(full[:5]), 5
        frames, stream, row = [], [], full_rows([], full[:5])
        for s in syms:
            # text stays a little ahead of the speech, sometimes a few symbols behind
            target = min(len(full), len(stream) + rng.randint(-3, 20))
            if target > known:
                chunk = full[known:target]
                known = target
                st.extend_transcript(chunk)
                T = T + chunk
                row = full_rows(stream, T)  # from scratch
            for _ in range(rng.randint(1, 4)):
                frames.append(s)
                st.observe(s)
            if rng.random() < 0.1:
                frames.append(BLANK)
                st.observe(BLANK)
            new = ctc_collapse(frames)
            if len(new) > len(stream):  # one more full-DP row (textbook recurrence)
                s_new = new[-1]
                cur = [row[0] + 1]
                for i in range(1, len(T) + 1):
                    cur.append(min(row[i] + 1, cur[i - 1] + 1, row[i - 1] + (s_new != T[i - 1])))
                row, stream = cur, new
            best = ref_best(row, len(stream))
            lo, hi = st.band_range
            checks += 1
            if lo <= best[0] and best[-1] <= hi:
                in_band += 1
                assert list(st.best_prefixes) == best
                assert st.distance == row[best[0]]
                assert st.guiding_set() == ref_guide(best, T, False)
                least = [i for i, e in enumerate(row) if e == min(row)]
                if lo <= least[0] and least[-1] <= hi:
                    assert st.progress == ref_progress(row, best)
            # banded values are upper bounds of the full DP
            assert st.distance >= min(row[i] for i in st.best_prefixes)
        if mode == "noisy":
            assert len(full) - st.progress < 20  # it tracked the speech to the end
    assert in_band >= (0.95 if mode == "noisy" else 0.1) * checks


def test_progress_monotone_under_clean_stream():
    text = "the quick brown fox jumps over the lazy dog " * 6
    T = collapse_repeats(ids(text))
    st = GuidanceState(T[:12], band=16)
    known, last = 12, 0
    for n, s in enumerate(T, 1):
        if known < len(T) and known - n < 6:
            st.extend_transcript(T[known:known + 9])
            known = min(len(T), known + 9)
        for _ in range(3):
            st.observe(s)
            assert st.progress >= last
            last = st.progress
        assert st.progress == n and st.distance == 0
        assert st.guiding_set() == sorted({s} | ({T[n]} if n < len(T) else set()))
    st.end_input()
    assert EOS in st.guiding_set()


# --------------------------------------------------------------------- cost
def _run_clean(n_chars, band=32, chunk=0):
    rng = random.Random(3)
    T = collapse_repeats([rng.choice(ids("abcdefgh ")) for _ in range(n_chars)])
    st = GuidanceState(T if not chunk else T[:chunk], band=band)
    known = len(T) if not chunk else chunk
    per_step, per_extend = [], []
    for n, s in enumerate(T[:400], 1):
        if chunk and known < len(T) and known - n < chunk:
            c0 = st.cells
            st.extend_transcript(T[known:known + chunk])
            known += chunk
            per_extend.append(st.cells - c0)
        c0 = st.cells
        st.observe(s)
        per_step.append(st.cells - c0)
        c0 = st.cells
        st.observe(s)  # a repeated frame
        assert st.cells == c0
        st.guiding_set()
    return st, per_step, per_extend


def test_per_step_cost_independent_of_transcript_length():
    band = 32
    _, short, _ = _run_clean(500, band)
    st, long, _ = _run_clean(50_000, band)
    assert max(short) <= 2 * (band + 1) and max(long) <= 2 * (band + 1)
    assert sum(long) <= 1.05 * sum(short)
    assert st.progress == 400


def test_streaming_extension_cost_and_memory_bounded():
    band = 32
    st, per_step, per_extend = _run_clean(2_000, band, chunk=10)
    assert max(per_step) <= 2 * (band + 1)
    assert max(per_extend) <= (band + 1) * band + band
    st2, _, ext2 = _run_clean(20_000, band, chunk=10)
    assert max(ext2) <= (band + 1) * band + band
    assert st.retained < 800 and st2.retained < 800  # the far past is forgotten


# --------------------------------------------------------------------- sampling
def _gens(seed, n):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_lambda_zero_equals_plain_top_k():
    texts = ["hello world", "the cat sat", "abc"]
    states = [GuidanceState(ids(t)) for t in texts]
    top_ks = [1, 5, 40]
    g1, g2 = _gens(10, 3), _gens(10, 3)
    lg = torch.Generator().manual_seed(0)
    for step in range(120):
        logits = torch.randn(3, VOCAB_SIZE, generator=lg) * 3
        a = sample_graphemes(logits, states, [0.0] * 3, top_ks, g1)
        b = sample_top_k(logits, top_ks, g2)
        assert torch.equal(a, b)
        for st, g in zip(states, a.tolist()):
            st.observe(g)
    # and guidance does change something with the same draws
    g1, g2 = _gens(10, 3), _gens(10, 3)
    logits = torch.randn(3, VOCAB_SIZE, generator=lg)
    diff = 0
    for _ in range(50):
        diff += int((sample_graphemes(logits, states, 1e6, 40, g1) != sample_top_k(logits, 40, g2)).any())
    assert diff > 0


def test_hard_guidance_never_leaves_guiding_set():
    texts = ["hello world", "semantic guidance", "", "a b c"]
    states = [GuidanceState(ids(t), band=8) for t in texts]
    top_ks = [1, 3, 5, VOCAB_SIZE]
    gens = _gens(20, 4)
    lg = torch.Generator().manual_seed(1)
    for step in range(200):
        logits = torch.randn(4, VOCAB_SIZE, generator=lg) * 4
        guides = [st.guiding_set() for st in states]
        for r, gs in enumerate(guides):  # make the guiding tokens unlikely
            logits[r, gs] -= 6.0
        out = sample_graphemes(logits, states, math.inf, top_ks, gens).tolist()
        for r, (g, gs) in enumerate(zip(out, guides)):
            if gs:
                assert g in gs
                # top-k among the guiding tokens (the lambda -> inf limit)
                ranked = sorted(gs, key=lambda x: -logits[r, x].item())
                assert g in ranked[: top_ks[r]]
            states[r].observe(g)
        if step == 100:
            states[1].end_input()


def test_soft_guidance_distribution_matches_algorithm_1():
    st = state_after("hello world", "hel")  # guiding {l, o}
    guide = st.guiding_set()
    n, k, lam = 20000, 4, 1.0
    base = torch.randn(VOCAB_SIZE, generator=torch.Generator().manual_seed(5))
    base[guide[0]] = base.max() + 0.5  # one guiding token in the top-k ...
    base[guide[1]] = base.sort(descending=True).values[k] - 0.2  # ... one just outside
    p = torch.softmax(base, -1)
    pt = p.clone()
    pt[guide] *= 1 + lam
    pt /= pt.sum()
    keep = pt.topk(k).indices
    expect = torch.zeros_like(pt)
    expect[keep] = pt[keep] / pt[keep].sum()
    assert guide[1] in keep.tolist()  # upweighting pulled it into the top-k
    torch.manual_seed(0)
    out = sample_graphemes(base.expand(n, -1).clone(), [st] * n, lam, k, None)
    freq = torch.bincount(out, minlength=VOCAB_SIZE).float() / n
    assert set(out.unique().tolist()) <= set(keep.tolist())
    assert (freq - expect).abs().max() < 0.015


def test_sample_top_k_codebooks_per_row_k_and_batch_independence():
    b, kc, v = 3, 4, 64
    lg = torch.Generator().manual_seed(2)
    logits = torch.randn(b, kc, v, generator=lg)
    out = sample_top_k(logits, [1, 2, 10], _gens(30, b))
    assert out.shape == (b, kc) and out.dtype == torch.long
    assert torch.equal(out[0], logits[0].argmax(-1))
    top2 = logits[1].topk(2).indices
    assert all(out[1, j] in top2[j] for j in range(kc))
    # a session's draws do not depend on who else is in the batch
    alone = sample_top_k(logits[2:3], [10], _gens(32, 1))
    assert torch.equal(alone[0], out[2])
    # distribution of plain top-k, rows with different k in one batch
    n = 20000
    row = torch.randn(v, generator=lg)
    torch.manual_seed(1)
    s = sample_top_k(row.expand(2 * n, -1).clone(), [2, 6] * n)
    for k, part in ((2, s[0::2]), (6, s[1::2])):
        idx = row.topk(k).indices
        expect = torch.zeros(v)
        expect[idx] = torch.softmax(row[idx], -1)
        freq = torch.bincount(part, minlength=v).float() / n
        assert (freq - expect).abs().max() < 0.015


def test_sampler_edge_cases():
    st = state_after("hello", "he")
    logits = torch.zeros(2, VOCAB_SIZE)
    logits[0, st.guiding_set()] = -math.inf  # hard guidance cannot follow: plain top-k
    out = sample_graphemes(logits, [st, None], [math.inf, 1.0], [3, 3], _gens(0, 2))
    assert out.shape == (2,)
    with pytest.raises(ValueError):
        sample_graphemes(logits, [st, st], [-1.0, 0.0], 3)
    with pytest.raises(ValueError):
        sample_graphemes(logits, [st, st], [float("nan"), 0.0], 3)
    allneg = torch.full((1, VOCAB_SIZE), -math.inf)
    assert sample_top_k(allneg, 5).shape == (1,)


def test_sample_step_equals_the_two_samplers_with_the_same_draws():
    """The runner's one-call sampler: the grapheme as `sample_graphemes`, then the acoustic
    codes as `sample_top_k`, from each session's generator in that order; EOS barred until
    the text is complete and spoken; a row with non-finite logits flagged, its tokens in range."""
    from livespeech.models.guidance import sample_step
    from livespeech.models.graphemes import EOS

    texts = ["hello world", "the cat sat", "abc", ""]
    lams = [math.inf, 1.0, 0.0, math.inf]
    top_ks = [1, 5, 40, 20]
    states = [GuidanceState(ids(t)) for t in texts]
    states[1].end_input()  # EOS may be sampled here only
    g1, g2 = _gens(50, 4), _gens(50, 4)
    lg = torch.Generator().manual_seed(3)
    for step in range(60):
        g_logits = torch.randn(4, VOCAB_SIZE, generator=lg) * 3
        g_logits[:, EOS] += 4.0  # tempting
        a_logits = torch.randn(4, 3, 64, generator=lg) * 3
        may_end = [st.speech_may_end for st in states]
        tokens, bad = sample_step(g_logits, a_logits, states, lams, top_ks, g1)
        barred = g_logits.clone()
        for r, st in enumerate(states):
            if not may_end[r]:
                barred[r, EOS] = -math.inf
        g_want, a_want = [], []
        for r in range(4):  # one session at a time: draws are per session, grapheme first
            g_want.append(sample_graphemes(barred[r:r + 1], states[r:r + 1], lams[r], top_ks[r], g2[r:r + 1]))
            a_want.append(sample_top_k(a_logits[r:r + 1], top_ks[r], g2[r:r + 1]))
        assert tokens.shape == (4, 4) and not bad.any()
        assert torch.equal(tokens[:, 0], torch.cat(g_want)) and torch.equal(tokens[:, 1:], torch.cat(a_want))
        assert all(t != EOS for r, t in enumerate(tokens[:, 0].tolist()) if not may_end[r])
        for st, g in zip(states, tokens[:, 0].tolist()):
            st.observe(g)
    a_logits[2, 1, 5] = float("nan")
    tokens, bad = sample_step(g_logits, a_logits, states, lams, top_ks, g1)
    assert bad.tolist() == [False, False, True, False] and 0 <= int(tokens[2, 2]) < 64


@pytest.mark.parametrize("bad_value", [math.nan, math.inf, -math.inf])
def test_a_row_with_non_finite_logits_leaves_the_others_tokens_as_they_were(bad_value):
    """A row whose codes' logits are not finite is flagged, its tokens stay in the
    vocabulary (it fails, the batch goes on), and every other row draws what it draws
    with that row finite."""
    from livespeech.models.guidance import sample_step

    lg = torch.Generator().manual_seed(5)
    states = [GuidanceState(ids(t)) for t in ("hello", "the cat", "abc", "dog")]
    lams, top_ks = [math.inf, 1.0, 0.0, math.inf], [1, 5, 40, 20]
    for _ in range(5):
        g_logits = torch.randn(4, VOCAB_SIZE, generator=lg) * 3
        a_logits = torch.randn(4, 3, 64, generator=lg) * 3
        u = torch.rand(4, 4, generator=lg)
        want, ok = sample_step(g_logits, a_logits, states, lams, top_ks, u)
        broken = a_logits.clone()
        broken[2, 0, :7] = bad_value  # several codes of one codebook: the row's top-k sees them
        got, bad = sample_step(g_logits, broken, states, lams, top_ks, u)
        assert not ok.any() and bad.tolist() == [False, False, True, False]
        assert torch.equal(got[[0, 1, 3]], want[[0, 1, 3]])
        assert ((got[2, 1:] >= 0) & (got[2, 1:] < 64)).all()


def test_the_samplers_run_as_torchscript():
    """A silent fallback to Python would cost every step its speed, not its results."""
    from livespeech.models import guidance, inference

    for get in (guidance._scripted_step_scores, guidance._scripted_sample_rows, guidance._scripted_guided,
                inference._scripted_commit):
        assert isinstance(get(), torch.jit.ScriptFunction)


@pytest.mark.parametrize("k", [1, 5, 17, 20, 32, 50])
def test_top_k_sampling_draws_as_a_full_sort_would(k):
    """`sample_top_k` against a reference that sorts the whole row: the same token from
    the same generator state, for k where the sampler pads rows for torch's faster top-k
    (17-32 over 1,024 codes) and where it does not; rows with -inf entries included, and
    an all -inf row still gets a token inside the vocabulary."""
    v, n = 1024, 64
    torch.manual_seed(k)
    logits = torch.randn(n, v) * 3
    logits[1, 10:] = -math.inf  # fewer finite entries than k for k > 10
    logits[2] = -math.inf
    got = sample_top_k(logits, k, _gens(7, n))
    u = torch.stack([torch.rand(1, generator=g) for g in _gens(7, n)]).reshape(-1)
    vals, idx = logits.sort(dim=-1, descending=True, stable=True)
    vals, idx = vals[:, :k], idx[:, :k]
    vals[:, 0] = torch.where(torch.isneginf(vals[:, 0]), torch.zeros_like(vals[:, 0]), vals[:, 0])
    cdf = vals.softmax(-1).cumsum(-1)
    j = (cdf < (u * cdf[:, -1])[:, None]).sum(-1).clamp_max(k - 1)
    want = idx.gather(-1, j[:, None]).squeeze(-1)
    assert 0 <= int(got[2]) < v
    keep = torch.arange(n) != 2  # the all -inf row's token is arbitrary
    assert torch.equal(got[keep], want[keep])


def test_speech_may_end_once_the_complete_transcript_is_covered():
    st = GuidanceState(ids("hi yo"))
    for g in frames_of("hi y"):
        st.observe(g)
    assert not st.speech_may_end  # text still open, and "o" not spoken
    st.end_input()
    assert not st.speech_may_end  # complete, but not covered
    st.observe(ids("o")[0])
    assert st.speech_may_end
    st.extend_transcript([SPACE] + ids("x"))  # more text: not covered any more
    assert not st.speech_may_end
    assert GuidanceState(input_complete=True).speech_may_end  # nothing to say


def test_sample_step_bars_eos_until_the_transcript_is_spoken():
    """A model that knows the text but wants to stop at once (nearly all mass on EOS,
    the rest on the next grapheme of the text) under soft guidance: EOS is not sampled
    while the stream has not covered the complete transcript (the best non-EOS token
    is), and is once it has."""
    from livespeech.models.guidance import sample_step

    text = "hi yo"
    want = collapse_repeats(ids(text))
    states = [GuidanceState(ids(text), input_complete=True) for _ in range(2)]
    gens = _gens(5, 2)
    a_logits = torch.zeros(2, 2, 8)
    stream = []
    for _ in range(40):
        g_logits = torch.zeros(2, VOCAB_SIZE)
        g_logits[:, EOS] = 30.0
        for r, st in enumerate(states):
            if st.progress < len(want):
                g_logits[r, want[st.progress]] = 10.0
        tokens, _ = sample_step(g_logits, a_logits, states, [1.0, 1.0], [1, 20], gens)
        stream.append(tokens[:, 0].tolist())
        if EOS in tokens[:, 0].tolist():
            break
        for st, g in zip(states, tokens[:, 0].tolist()):
            st.observe(g)
    rows = list(zip(*stream))
    greedy = rows[0]  # k = 1: the guided forward token each step, then EOS
    assert ctc_collapse(list(greedy[:-1])) == want and greedy[-1] == EOS
    assert states[0].speech_may_end
    assert all(t != EOS for t in rows[1][:-1])


def _guided_scores(g_logits, states, lams, may_end):
    """Algorithm 1's log-weights, EOS barred as `sample_step` does (reference)."""
    out = g_logits.clone().float()
    for r, st in enumerate(states):
        if not may_end[r]:
            out[r, EOS] = -math.inf
        gs = st.guiding_set()
        if math.isinf(lams[r]):
            keep = torch.full_like(out[r], -math.inf)
            keep[gs] = out[r, gs]
            out[r] = keep
        else:
            out[r, gs] += math.log1p(lams[r])
    return out


def test_grapheme_top_k_one_and_temperature_zero_are_greedy():
    """grapheme_top_k 1 picks the most likely grapheme after guidance, whatever the
    draw; so does grapheme temperature 0 at any k; acoustic temperature 0 (codebook 1
    and codebooks 2..Q apart) picks each codebook's most likely code."""
    from livespeech.models.guidance import Temperatures, sample_step

    texts = ["hello world", "the cat sat", "abc"]
    lams = [1.0, 3.0, math.inf]
    states = [GuidanceState(ids(t), input_complete=True) for t in texts]
    lg = torch.Generator().manual_seed(11)
    gens = _gens(100, 3)
    for _ in range(30):
        g_logits = torch.randn(3, VOCAB_SIZE, generator=lg) * 2
        a_logits = torch.randn(3, 4, 64, generator=lg) * 2
        may_end = [st.speech_may_end for st in states]
        want_g = _guided_scores(g_logits, states, lams, may_end).argmax(-1)
        by_k, _ = sample_step(g_logits, a_logits, states, lams, [20] * 3, gens, [1] * 3)
        by_t, _ = sample_step(g_logits, a_logits, states, lams, [20] * 3, gens, [20] * 3,
                              [Temperatures(0.0, 0.0, 1.0), Temperatures(0.0, 1.0, 0.0), Temperatures(0.0, 0.0, 0.0)])
        assert torch.equal(by_k[:, 0], want_g) and torch.equal(by_t[:, 0], want_g)
        best_codes = a_logits.argmax(-1)
        assert torch.equal(by_t[0, 1], best_codes[0, 0]) and torch.equal(by_t[1, 2:], best_codes[1, 1:])
        assert torch.equal(by_t[2, 1:], best_codes[2])
        for st, g in zip(states, by_k[:, 0].tolist()):
            st.observe(g)


def test_sample_step_per_stream_k_and_temperatures_equal_the_samplers_on_scaled_logits():
    """Each row's grapheme k apart from its acoustic k, and logits / T per stream
    (grapheme, codebook 1, codebooks 2..Q): the same tokens as `sample_graphemes` and
    `sample_top_k` given the scaled logits and the same draws."""
    from livespeech.models.guidance import Temperatures, sample_step

    texts = ["hello world", "the cat sat", "abc"]
    lams = [1.0, 0.0, math.inf]
    g_ks, a_ks = [3, 2, 5], [20, 7, 40]
    temps = [Temperatures(0.5, 2.0, 0.7), Temperatures(1.0, 1.0, 1.0), Temperatures(3.0, 0.2, 1.5)]
    states = [GuidanceState(ids(t)) for t in texts]
    g1, g2 = _gens(9, 3), _gens(9, 3)
    lg = torch.Generator().manual_seed(4)
    for _ in range(40):
        g_logits = torch.randn(3, VOCAB_SIZE, generator=lg) * 3
        a_logits = torch.randn(3, 3, 64, generator=lg) * 3
        tokens, _ = sample_step(g_logits, a_logits, states, lams, a_ks, g1, g_ks, temps)
        for r, t in enumerate(temps):
            scaled_g = g_logits[r:r + 1] / t.grapheme
            scaled_g[0, EOS] = -math.inf  # text open: EOS barred
            want_g = sample_graphemes(scaled_g, states[r:r + 1], lams[r], g_ks[r], g2[r:r + 1])
            inv = torch.tensor([1 / t.first_codebook, 1 / t.acoustic, 1 / t.acoustic])
            want_a = sample_top_k(a_logits[r:r + 1] * inv[None, :, None], a_ks[r], g2[r:r + 1])
            assert int(tokens[r, 0]) == int(want_g) and torch.equal(tokens[r, 1:], want_a[0])
        for st, g in zip(states, tokens[:, 0].tolist()):
            st.observe(g)
    with pytest.raises(ValueError):
        sample_step(g_logits, a_logits, states, lams, a_ks, g1, g_ks, [Temperatures(-1.0, 1.0, 1.0)] * 3)
    with pytest.raises(ValueError):
        sample_step(g_logits, a_logits, states, lams, a_ks, g1, g_ks, [(1.0, math.nan, 1.0)] * 3)


def test_counter_draws_depend_on_the_seed_and_step_alone_and_look_uniform():
    """`counter_uniforms`, the server's draws: a session's row is the same alone or in any
    batch, in [0, 1); over many steps the draws fill [0, 1) evenly and neither consecutive
    steps nor neighbouring seeds are correlated."""
    from livespeech.models.guidance import counter_uniforms

    seeds = torch.tensor([5, 2**62 + 7, -1])  # -1: the bits of the uint64 seed 2**64 - 1
    steps = torch.tensor([3, 0, 2**40])
    both = counter_uniforms(seeds, steps, 9)
    for r in range(3):
        assert torch.equal(counter_uniforms(seeds[r:r + 1], steps[r:r + 1], 9), both[r:r + 1])
    n = 100_000
    u = counter_uniforms(torch.full((n,), 12345), torch.arange(n), 2)
    assert 0 <= float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u[:, 0], bins=20, min=0, max=1)
    assert float((counts - n / 20).abs().max()) < 6 * math.sqrt(n / 20)  # 6 sigma
    corr = lambda a, b: float(torch.corrcoef(torch.stack((a, b)))[0, 1])  # noqa: E731
    assert abs(corr(u[:-1, 0], u[1:, 0])) < 0.02  # step t and t + 1
    assert abs(corr(u[:, 0], u[:, 1])) < 0.02  # the grapheme's draw and codebook 1's
    v = counter_uniforms(torch.full((n,), 12346), torch.arange(n), 1)
    assert abs(corr(u[:, 0], v[:, 0])) < 0.02  # seed and seed + 1
    assert not torch.equal(u[:, :1], v)


def test_counter_draws_on_the_cpu_are_the_graphs_bits():
    """On the CPU `counter_uniforms` runs as one compiled loop; its draws are the bits the
    TorchScript graph (what a GPU runs) makes, for any int64 seed and counter."""
    from livespeech.models import guidance

    if guidance.numba is None:
        pytest.skip("numba is not installed: the CPU runs the graph itself")
    gen = torch.Generator().manual_seed(0)
    for b in (1, 5, 300):
        seeds = torch.randint(-2**63, 2**63 - 1, (b,), dtype=torch.int64, generator=gen)
        steps = torch.randint(0, 2**45, (b,), dtype=torch.int64, generator=gen)
        for n in (1, 9, 40):
            assert torch.equal(guidance.counter_uniforms(seeds, steps, n),
                               guidance._scripted_counter_uniforms()(seeds, steps, n))


def test_sample_step_takes_the_draws_as_a_tensor():
    """Given as a tensor, the draws are used as a generator's would be: the same tokens."""
    from livespeech.models.guidance import sample_step

    states = [GuidanceState(ids("hello")) for _ in range(3)]
    lg = torch.Generator().manual_seed(4)
    g_logits, a_logits = torch.randn(3, VOCAB_SIZE, generator=lg) * 3, torch.randn(3, 2, 64, generator=lg) * 3
    gens, copies = _gens(9, 3), _gens(9, 3)
    u = torch.stack([torch.rand(3, generator=g) for g in copies])
    want, _ = sample_step(g_logits, a_logits, states, [1.0] * 3, [5] * 3, gens)
    got, _ = sample_step(g_logits, a_logits, states, [1.0] * 3, [5] * 3, u)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="uniforms of shape"):
        sample_step(g_logits, a_logits, states, [1.0] * 3, [5] * 3, u[:, :2])


def test_slot_sampling_keeps_each_slots_settings_until_set_again():
    """A slot's settings, set once, sample every step of its rows as `sample_step` does
    with the same settings given per row; a bad setting raises and leaves the slot's
    settings as they were; the host's view (largest k, temperatures, guided) follows."""
    from livespeech.models.guidance import (SamplingSettings, SlotSampling, Temperatures, sample_step,
                                            sent_guiding_sets, stage_guiding_sets)
    from livespeech.models.upload import Upload

    table = SlotSampling(4, VOCAB_SIZE, 64, "cpu")
    settings = {1: SamplingSettings(1.0, 5, 2, Temperatures(1.0, 0.5, 1.0)),
                3: SamplingSettings(math.inf, 9, None, Temperatures(0.0, 1.0, 2.0)),
                0: SamplingSettings(0.0, 200, 1)}
    for slot, s in settings.items():
        table.set(slot, s)
    with pytest.raises(ValueError, match="temperatures"):
        table.set(3, SamplingSettings(1.0, 5, 2, Temperatures(1.0, -1.0, 1.0)))
    with pytest.raises(ValueError, match="lambda"):
        table.set(1, SamplingSettings(-1.0))
    assert table.kmax([1, 3]) == (9, 9) and table.kmax([0]) == (1, 64)  # k clamped to the vocabulary
    assert table.scaled([1]) and table.scaled([3]) and not table.scaled([0])
    assert table.guided([3, 0, 1]).tolist() == [True, False, True]
    slots = [3, 0, 1]
    lg = torch.Generator().manual_seed(2)
    for step in range(5):
        states = [GuidanceState(ids("hello there")) for _ in slots]
        g_logits, a_logits = torch.randn(3, VOCAB_SIZE, generator=lg) * 3, torch.randn(3, 2, 64, generator=lg) * 3
        u = torch.rand(3, 3, generator=lg)
        up = Upload()
        staged = stage_guiding_sets(up, states, table.guided(slots))
        sets = sent_guiding_sets(up.send(torch.device("cpu")), staged, VOCAB_SIZE)
        idx = torch.tensor(slots)
        got, _ = table.rows(idx, table.guide(idx, sets)).sample(g_logits, a_logits, u, *table.kmax(slots),
                                                                table.scaled(slots))
        per_row = [settings[s] for s in slots]
        want, _ = sample_step(g_logits, a_logits, states, [s.guidance_lambda for s in per_row],
                              [s.top_k for s in per_row], u, [s.grapheme_top_k or s.top_k for s in per_row],
                              [s.temperatures for s in per_row])
        assert torch.equal(got, want), step
