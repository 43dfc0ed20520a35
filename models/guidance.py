"""Semantic guidance (LiveSpeech 2, Sec. 4.2, Algorithm 1) and the top-k samplers.

The decoder emits one grapheme per frame (ids of `livespeech.models.graphemes`: BLANK=0, EOS=1,
SPACE=2, then characters). Guidance compares the CTC-collapsed grapheme stream with the
transcript and boosts the graphemes that keep the speech on the transcript.

Per session (pure Python, no tensors)
-------------------------------------
``GuidanceState(transcript_ids=(), band=32, input_complete=False)``
    ``.extend_transcript(ids)``  append grapheme ids (>= SPACE) as text chunks arrive;
                                 repeats are collapsed, across the join too. The caller
                                 puts the SPACE between chunks (server/session.py does).
    ``.end_input()`` / ``.input_complete``  no more text will arrive.
    ``.speech_may_end``          EOS is accepted: the input is complete and ``progress``
                                 has reached the end of the transcript.
    ``.observe(g)``              after every sampled frame (any id, BLANK/EOS included).
    ``.guiding_set() -> list[int]``  sorted guiding graphemes for the next frame.
    ``.progress``                how many tokens of the collapsed transcript the speech
                                 has covered: the smallest best prefix, capped by the
                                 largest prefix of least edit distance (CER alone jumps
                                 ahead on a wrong first grapheme: "w" vs "hello world"
                                 has its best CER at "helo w"). Equals the stream length
                                 while the stream follows the transcript (so it does not
                                 decrease); after errors it can step back. Record
                                 ``.transcript_length`` after each ``extend_transcript``
                                 to map chunks onto it (docs/design.md).
    ``.best_prefixes``, ``.distance``, ``.cer``, ``.stream_length``, ``.band_range``,
    ``.cells`` (DP cells computed so far, a cost counter), ``.retained`` (memory held).

Batched (tensors; only the guiding sets are per-session Python)
---------------------------------------------------------------
``sample_graphemes(logits[B, G], states, lambdas, top_ks, generators) -> LongTensor[B]``
``sample_top_k(logits[B, V] or [B, K, V], top_ks, generators) -> LongTensor[B] / [B, K]``
``sample_step(g_logits, a_logits, states, lambdas, top_ks, generators, grapheme_top_ks,
temperatures) -> (tokens[B, 1 + Q], bad[B])``  one decode step's sampling for B rows;
``states`` may be ``GuidingSets``: the guiding sets and EOS bars of guidance kept on the
device (`livespeech.models.guidance_batch.GuidanceBatch`, the same rules as tensors).
The caller observes each sampled grapheme itself (``state.observe(int(g))``).
``SlotSampling(capacity, n_graphemes, vocab, device)``  each slot's ``SamplingSettings``
(lambda, k, temperatures) as tensors, ``.set(slot, settings)`` once a session: the
runner's steps gather their rows on the device (``.rows(idx, sets).sample(...)``), as
``sample_step`` does for its B rows.

Rules
-----
* Transcript. Blanks inside speech are filled with the next non-blank in training data,
  so a doubled letter ("ll") cannot show up as two symbols in the collapsed stream. The
  stream is therefore matched against ``collapse_repeats(text_to_ids(transcript))`` (the
  server builds the same thing word by word from ``word_graphemes``); the state
  collapses whatever ids it is given. Stream: ``ctc_collapse`` of the frames (merge
  repeats, drop BLANK/EOS), maintained incrementally.
* Score. For prefix length i, CER_i = ED(stream, T[:i]) / i, compared exactly as
  fractions; the best set is every i with the minimum (ties all count, as in the paper).
  Empty prefix: CER_0 = 0 for an empty stream (so at the start the best prefix is 0 and
  the guide is the first transcript token), +inf otherwise (never best unless the
  transcript is empty).
* Guiding set = union over best i of {T[i-1] (stay, if i >= 1), T[i] (move forward, if
  i < N)}. At i = N ("transcript fully spoken"): while text may still arrive, nothing
  beyond the stay token (never EOS, never BLANK); once ``input_complete``, {BLANK, EOS}
  are added: BLANK because trailing silence is BLANK in the training targets, EOS so the
  model can stop. Empty transcript: {} (plain top-k), or {BLANK, EOS} when complete.
* Sampling is Algorithm 1 literally: p~ = p with guiding entries times (1 + lambda),
  renormalised, then top-k sampling from p~. Its support lies in T_guiding u T_topk;
  lambda = 0 is plain top-k sampling (same uniforms -> same tokens); lambda = inf
  (hard guidance) samples only guiding tokens (the top-k of them by p), falling back to
  plain top-k when the guiding set is empty or all its logits are -inf.
* Per-stream settings (``sample_step``). The grapheme has its own k (``grapheme_top_ks``:
  ~40 symbols want a far smaller k than ~1,024 codes) and each row three temperatures
  (``Temperatures``: grapheme, codebook 1, codebooks 2..Q). Logits are divided by the
  temperature before guidance and top-k; temperature 0 is greedy (k = 1: the most likely
  token after guidance, still one uniform drawn).
* End of speech. ``sample_step`` bars EOS (the best non-EOS token is sampled instead)
  until ``speech_may_end``: while text may still arrive, and while the stream has not
  covered the whole transcript, so a model that wants to stop early speaks on. The
  engine's runaway guard forces EOS where the stream never gets there.
* Randomness. Each sampled token consumes exactly one uniform float: from its session's
  generator (``torch.Generator().manual_seed(seed)``; ``sample_top_k`` on [B, K, V]
  draws K floats per session, codebook order), or given as a tensor of the draws. The
  server gives them as ``counter_uniforms(seeds, steps, 1 + Q)``: a hash of the
  session's seed, its decode step and the token's index, computed on the model's device
  with no generator state. Either way a session's samples do not depend on which other
  sessions share the batch. ``generators=None`` uses the global RNG (one
  ``torch.rand(B, n)``); a None entry uses the global CPU RNG for that row. Sampling is
  inverse-CDF over the sorted top-k probabilities (float32).

Band (cost O(band) per new stream symbol, O(1) per repeated frame)
------------------------------------------------------------------
Only the edit-distance row of the current stream length is kept, for transcript
positions [lo, hi], hi = min(N, lo + band), plus, for the last ``band + 1`` stream rows,
their symbol and their value at column hi. After each new symbol (and each transcript
extension) lo moves to max(lo, a - band // 4), a = min(progress, smallest position of
least edit distance); lo never moves back, so the far past (its DP cells and, amortised,
its transcript tokens) is forgotten. Columns entering on the right (lo moved, or text
arrived) are computed over the stored rows, so text that arrives after the speech that
matches it is still matched. Cells outside this region count as +inf: the values are
upper bounds of the full DP and equal to it whenever an optimal alignment stays inside
(in the tests: whenever the true best prefix is inside [lo, hi], for random streams and
for noisy copies of the transcript). Cost: band + 1 cells per new symbol plus band + 1
per entering column; in steady speech one column enters per symbol (2 * band + 2 cells),
a jump or a text chunk costs at most band * (band + 1).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Iterable, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from . import cpu_sampler
from .compiled import compiled, numba
from .graphemes import BLANK, EOS, SPACE, VOCAB_SIZE
from .scripted import scripted
from .upload import Upload

__all__ = ["GuidanceState", "GuidingSets", "SamplingSettings", "SlotSampling", "Temperatures", "sample_graphemes",
           "sample_step", "sample_top_k"]

_INF = float("inf")


def transcript_tokens(ids: Iterable[int], last: Optional[int]) -> list[int]:
    """Grapheme ids appended to a transcript that ends in `last` (None: empty), checked
    (>= SPACE) and with repeats collapsed, across the join too."""
    new: list[int] = []
    for g in ids:
        g = int(g)
        if not SPACE <= g < VOCAB_SIZE:
            raise ValueError(f"transcript grapheme id {g} out of range [{SPACE}, {VOCAB_SIZE})")
        if g != last:
            new.append(g)
            last = g
    return new


class GuidanceState:
    """Incremental best-prefix matcher of one session (see the module docstring)."""

    def __init__(self, transcript_ids: Iterable[int] = (), band: int = 32,
                 input_complete: bool = False) -> None:
        band = int(band)
        if band < 4:
            raise ValueError("band must be >= 4")
        self.band = band
        self._back = band // 4
        self._toks: list[int] = []  # collapsed transcript, token k at _toks[k - _base]
        self._base = 0
        self._n = 0
        self._lo = 0
        self._row: list = [0]  # ED(stream, T[:i]) for i in [lo, lo + len(row) - 1]
        self._m = 0  # collapsed stream length
        self._last_frame: Optional[int] = None
        # the last band + 1 stream rows: [symbol, ED at the band's right edge column]
        self._hist: deque = deque([[None, 0]])
        self._best: list[int] = [0]
        self._best_ed = 0
        self._anchor = 0
        self._progress = 0
        self._guide: Optional[list[int]] = None
        self._complete = bool(input_complete)
        self.cells = 0
        self.extend_transcript(transcript_ids)

    # ------------------------------------------------------------------ properties
    @property
    def input_complete(self) -> bool:
        return self._complete

    @input_complete.setter
    def input_complete(self, value: bool) -> None:
        self._complete = bool(value)
        self._guide = None

    def end_input(self) -> None:
        self.input_complete = True

    @property
    def speech_may_end(self) -> bool:
        """Whether EOS is accepted: no more text will arrive and the stream has covered
        the whole transcript (an empty one included)."""
        return self._complete and self._progress >= self._n

    @property
    def transcript_length(self) -> int:
        """Length N of the collapsed transcript received so far."""
        return self._n

    @property
    def transcript(self) -> list[int]:
        """The collapsed transcript received so far; once the band has moved far on, the
        tokens from `transcript_length` - len(transcript) (the spoken past is dropped)."""
        return list(self._toks)

    @property
    def stream_length(self) -> int:
        """Length of the collapsed grapheme stream observed so far."""
        return self._m

    @property
    def best_prefixes(self) -> tuple[int, ...]:
        return tuple(self._best)

    @property
    def progress(self) -> int:
        """min(smallest best prefix, largest prefix of least edit distance)."""
        return self._progress

    @property
    def distance(self) -> int:
        """Edit distance between the stream and the best prefixes (band values)."""
        return self._best_ed

    @property
    def cer(self) -> float:
        i = self._best[0]
        if i == 0:
            return 0.0 if self._best_ed == 0 else _INF
        return self._best_ed / i

    @property
    def retained(self) -> int:
        """Transcript tokens + DP values held: the unspoken text plus O(band), amortised."""
        return len(self._toks) + len(self._row) + len(self._hist)

    @property
    def band_range(self) -> tuple[int, int]:
        """Transcript positions [lo, hi] whose distances are kept."""
        return self._lo, self._lo + len(self._row) - 1

    def _tok(self, k: int) -> int:
        return self._toks[k - self._base]

    # ------------------------------------------------------------------ transcript
    def extend_transcript(self, ids: Iterable[int]) -> None:
        new = transcript_tokens(ids, self._toks[-1] if self._toks else None)
        if not new:
            return
        self._toks.extend(new)
        self._n += len(new)
        self._guide = None
        self._recenter()

    # ------------------------------------------------------------------ stream
    def observe(self, g: int) -> None:
        """Record one sampled frame (O(1) unless the collapsed stream grows)."""
        g = int(g)
        if g == self._last_frame:
            return
        self._last_frame = g
        if g <= EOS:
            return
        self._advance(g)

    def _advance(self, s: int) -> None:
        row, toks = self._row, self._toks
        off = self._lo - 1 - self._base  # toks[off + idx] is the token of column lo + idx
        new = [row[0] + 1]
        for idx in range(1, len(row)):
            diag = row[idx - 1] + (toks[off + idx] != s)
            v = row[idx] + 1
            if diag < v:
                v = diag
            h = new[idx - 1] + 1
            if h < v:
                v = h
            new.append(v)
        self.cells += len(row)
        self._row = new
        self._m += 1
        self._hist.append([s, new[-1]])
        if len(self._hist) > self.band + 1:
            self._hist.popleft()
        self._guide = None
        self._recenter()

    # ------------------------------------------------------------------ band upkeep
    def _grow_to_edge(self) -> bool:
        """Add columns hi+1..min(N, lo + band), computed over the stored rows."""
        top = min(self._n, self._lo + self.band)
        if top < self._lo + len(self._row):
            return False
        hist = self._hist
        for j in range(self._lo + len(self._row), top + 1):
            t = self._tok(j - 1)
            above = above_left = _INF  # row r-1 at columns j and j-1
            for h in hist:
                left = h[1]
                v = left + 1
                if above + 1 < v:
                    v = above + 1
                if above_left != _INF and above_left + (h[0] != t) < v:
                    v = above_left + (h[0] != t)
                above, above_left = v, left
                h[1] = v
            self.cells += len(hist)
            self._row.append(above)
        return True

    def _find_best(self) -> None:
        lo, best, be, bi = self._lo, [], _INF, 0  # best score be / bi
        emin, first, last = _INF, lo, lo  # positions of least edit distance
        for idx, e in enumerate(self._row):
            i = lo + idx
            if e < emin:
                emin, first, last = e, i, i
            elif e == emin:
                last = i
            if i == 0:
                if e == 0:  # empty stream vs empty prefix: CER 0, nothing beats it
                    best, be, bi = [0], 0, 1
                elif self._n == 0:
                    best, be, bi = [0], e, 1
                continue
            if not best:
                best, be, bi = [i], e, i
                continue
            lhs, rhs = e * bi, be * i
            if lhs < rhs:
                best, be, bi = [i], e, i
            elif lhs == rhs:
                best.append(i)
        self._best = best
        self._best_ed = be
        self._anchor = first
        self._progress = min(best[0], last)

    def _recenter(self) -> None:
        self._grow_to_edge()
        self._find_best()
        # anchor on the least-CER prefix, but never beyond the least-edit-distance one:
        # CER = ED / i favours long prefixes for a short or noisy stream (a wrong first
        # grapheme "w" against "hello world" has CER 6/7 at "helo w" < 1/1 at "h"), and
        # lo never moves back, so a spurious jump must not drag the band along.
        lo = max(self._lo, min(self._best[0], self._anchor) - self._back)
        if lo > self._lo:
            del self._row[: lo - self._lo]
            self._lo = lo
            if self._grow_to_edge():
                self._find_best()
        # forget transcript tokens nothing refers to any more (only T[lo-1:] is used)
        drop = self._lo - 1 - self._base
        if drop > 256 and 2 * drop > len(self._toks):
            del self._toks[:drop]
            self._base += drop

    # ------------------------------------------------------------------ guidance
    def guiding_set(self) -> list[int]:
        if self._guide is None:
            out = set()
            n = self._n
            for i in self._best:
                if i >= 1:
                    out.add(self._tok(i - 1))
                if i < n:
                    out.add(self._tok(i))
                elif self._complete:
                    out.add(BLANK)
                    out.add(EOS)
            self._guide = sorted(out)
        return list(self._guide)

    def __repr__(self) -> str:
        return (f"GuidanceState(N={self._n}, stream={self._m}, best={self._best}, "
                f"ed={self._best_ed}, band=[{self._lo}, {self._lo + len(self._row) - 1}], "
                f"complete={self._complete})")


# ---------------------------------------------------------------------- sampling
IntsLike = Union[int, Sequence[int], torch.Tensor]


def _row_ks(top_ks: Union[int, Sequence[int]], n_rows: int, vocab: int) -> list[int]:
    """Each row's k, clamped to [1, vocab]."""
    ks = [top_ks] * n_rows if isinstance(top_ks, int) else list(top_ks)
    if len(ks) != n_rows:
        raise ValueError(f"expected {n_rows} top_k values, got {len(ks)}")
    return [min(max(int(x), 1), vocab) for x in ks]


def _lambdas(lambdas: Union[float, Sequence[float]], n_rows: int) -> list[float]:
    """Each row's guidance lambda, checked: >= 0, inf for hard guidance."""
    lam = [float(lambdas)] * n_rows if isinstance(lambdas, (int, float)) else [float(x) for x in lambdas]
    if len(lam) != n_rows:
        raise ValueError(f"expected {n_rows} lambdas, got {len(lam)}")
    if any(not x >= 0.0 for x in lam):
        raise ValueError("guidance lambda must be >= 0 (inf for hard guidance)")
    return lam


def _guiding_cells(states: Sequence[Optional[GuidanceState]], guided: Sequence[bool]) -> tuple[list[int], list[int]]:
    """(rows, graphemes) of every guided row's guiding set (guided: lambda > 0): the cells
    of the guide mask."""
    if len(states) != len(guided):
        raise ValueError(f"expected {len(guided)} guidance states, got {len(states)}")
    rows: list[int] = []
    cols: list[int] = []
    for r, st in enumerate(states):
        if st is None or not guided[r]:
            continue
        gs = st.guiding_set()
        rows.extend([r] * len(gs))
        cols.extend(gs)
    return rows, cols


def _bonus_and_hard(lam: Sequence[float]) -> tuple[list[float], list[bool]]:
    """Each row's log(1 + lambda) and whether it is hard (lambda inf)."""
    hard = [math.isinf(x) for x in lam]
    return [0.0 if h else math.log1p(x) for x, h in zip(lam, hard)], hard


def _per_row_k(top_ks: IntsLike, n_rows: int, vocab: int, device) -> tuple[torch.Tensor, int]:
    """Per-row k as a LongTensor on `device` (clamped to [1, vocab]) and its max."""
    if isinstance(top_ks, torch.Tensor):
        k = top_ks.to(device=device, dtype=torch.long).reshape(-1)
        if k.numel() == 1:
            k = k.expand(n_rows)
        k = k.clamp(1, vocab)
        return k, int(k.max())
    ks = _row_ks(top_ks, n_rows, vocab)
    return torch.tensor(ks, dtype=torch.long, device=device), max(ks)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """PCG's output permutation of 32-bit words held in int64 (no product exceeds 62 bits)."""
    m = 0xFFFFFFFF
    state = (x * 747796405 + 2891336453) & m
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & m
    return ((word >> 22) ^ word) & m


def _counter_uniforms(seeds: torch.Tensor, counters: torch.Tensor, n: int) -> torch.Tensor:
    m = 0xFFFFFFFF
    j = torch.arange(n, device=seeds.device, dtype=torch.int64).unsqueeze(0)
    h = _hash32(j ^ _hash32(counters.unsqueeze(1) & m))
    h = _hash32(h ^ ((seeds.unsqueeze(1) >> 32) & m))
    h = _hash32(h ^ (seeds.unsqueeze(1) & m))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


_scripted_counter_uniforms = scripted(_counter_uniforms)
_hash32_word = compiled(_hash32, inline="always")  # the same permutation of one int64 word


def _counter_uniform_rows(seeds: np.ndarray, counters: np.ndarray, out: np.ndarray) -> None:
    """`_counter_uniforms` into out [B, n] (float32), a row and a draw at a time."""
    m = 0xFFFFFFFF
    for r in range(out.shape[0]):
        c = _hash32_word(counters[r] & m)
        hi, lo = (seeds[r] >> 32) & m, seeds[r] & m
        for j in range(out.shape[1]):
            out[r, j] = (_hash32_word(_hash32_word(_hash32_word(j ^ c) ^ hi) ^ lo) >> 8) * (1.0 / (1 << 24))


_counter_uniform_rows_compiled = compiled(_counter_uniform_rows)


def counter_uniforms(seeds: torch.Tensor, counters: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n] uniforms in [0, 1) (24-bit) that are a function of each row's seed (the 64
    bits of an int64), its counter (the session's decode step) and the draw's index alone: the
    same draws whatever else is in the batch, made where the tensors are, with no
    generator state on the host (so a step can be recorded as a CUDA graph). On the CPU
    one compiled loop makes them (numba; the graph's ~30 ops on a few rows took ~0.14 ms
    of a 16-session step), the same bits as the graph's."""
    if numba is None or seeds.device.type != "cpu":
        return _scripted_counter_uniforms()(seeds, counters, n)
    out = torch.empty(seeds.shape[0], n, dtype=torch.float32)
    # numpy views of CPU tensors: no device read (loadtest/host_reads.py's function modes off)
    with torch._C.DisableTorchFunction():
        _counter_uniform_rows_compiled(seeds.to(torch.int64).contiguous().numpy(),
                                       counters.to(torch.int64).contiguous().numpy(), out.numpy())
    return out


def _uniforms(generators: Union[Sequence[Optional[torch.Generator]], torch.Tensor, None], batch: int,
              n: int, device) -> torch.Tensor:
    """[batch, n] uniforms in [0, 1): n consecutive draws from each row's generator, or
    `generators` itself when it is a tensor of the draws (`counter_uniforms`)."""
    if generators is None:
        return torch.rand(batch, n, device=device)
    if isinstance(generators, torch.Tensor):
        if tuple(generators.shape) != (batch, n):
            raise ValueError(f"expected uniforms of shape {(batch, n)}, got {tuple(generators.shape)}")
        # no .to() for draws already there (loadtest/host_reads.py counts it as a copy on the CPU)
        return generators if generators.device == torch.device(device) else generators.to(device)
    if len(generators) != batch:
        raise ValueError(f"expected {batch} generators, got {len(generators)}")
    rows = [torch.rand(n) if g is None else torch.rand(n, generator=g, device=g.device)
            for g in generators]
    if all(r.device == rows[0].device for r in rows):
        return torch.stack(rows).to(device)
    return torch.stack([r.to(device) for r in rows])


def _sample_rows(scores: torch.Tensor, k: torch.Tensor, kmax: int, u: torch.Tensor) -> torch.Tensor:
    """Top-k inverse-CDF sampling. scores [N, V] float32 log-weights, k [N], u [N]."""
    v = scores.shape[-1]
    # torch's CPU top-k partial-sorts rows of at least 64 * k entries and runs nth_element
    # on shorter ones, which took 1.6-1.8x as long at k = 20 over 1,024 codes
    # (docs/loadtest.md, "Measured choices"): rows padded with -inf up to that length,
    # where it at most doubles them, take the fast path. A padded entry is never drawn
    # (probability 0) but by an all -inf row, whose token is clamped into the vocabulary.
    padded = not scores.is_cuda and v < 64 * kmax <= 2 * v
    if padded:
        scores = torch.cat((scores, scores.new_full((scores.shape[0], 64 * kmax - v), -math.inf)), 1)
    vals, idx = scores.topk(kmax, dim=-1)
    pos = torch.arange(kmax, device=scores.device)
    vals = vals.masked_fill(pos >= k[:, None], -math.inf)
    # a row whose every score is -inf: take its first candidate rather than NaN
    vals[:, 0] = torch.where(torch.isneginf(vals[:, 0]), torch.zeros_like(vals[:, 0]), vals[:, 0])
    cdf = torch.softmax(vals, dim=-1).cumsum(-1)
    x = u.to(cdf.dtype) * cdf[:, -1]
    j = (cdf < x[:, None]).sum(-1)
    j = torch.minimum(j, k - 1)
    out = idx.gather(-1, j[:, None]).squeeze(-1)
    return out.clamp_max(v - 1) if padded else out


def _guided(scores: torch.Tensor, guide: torch.Tensor, bonus: torch.Tensor, hard: torch.Tensor) -> torch.Tensor:
    """Algorithm 1's reweighting in log space: guiding entries (guide [N, V]) + log(1 +
    lambda) (bonus [N]); a hard row (lambda inf) keeps only them, unless none is finite."""
    hard = hard & (guide & ~torch.isneginf(scores)).any(-1)
    return torch.where(guide, scores + bonus[:, None], scores.masked_fill(hard[:, None], -math.inf))


def _step_scores(g_logits: torch.Tensor, a_logits: torch.Tensor, eos_barred: torch.Tensor, guide: torch.Tensor,
                 bonus: torch.Tensor, hard: torch.Tensor, k_g: torch.Tensor, kmax_g: int, k_a: torch.Tensor,
                 u: torch.Tensor, eos: int, inv_t: torch.Tensor, greedy: torch.Tensor,
                 scaled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sample_step`'s tensor work up to the acoustic codes' draw: (grapheme tokens [B],
    the codes' scores [B * Q, V] and k [B * Q], non-finite rows [B]). inv_t and greedy
    [B, 3]: 1 / temperature and temperature == 0 of (grapheme, codebook 1, codebooks
    2..Q); read only when `scaled` (some temperature is not 1)."""
    g, a = g_logits.float(), a_logits.float()
    # a row's sum is non-finite iff one of its logits is (finite logits are far from
    # overflowing it): two reductions instead of isfinite's passes over every logit
    bad = ~torch.isfinite(g.sum(-1) + a.flatten(1).sum(-1))
    g = g.masked_fill(bad[:, None], 0.0)
    # a bad row's codes are drawn from its logits as they are: the top-k sampler keeps
    # each row's token in the vocabulary whatever its scores, and the row fails anyway;
    # zeroing them was a copy of every acoustic logit a step (~0.13 ms at 16 sessions)
    b, q, v = a.shape
    k_rows = k_a[:, None].expand(b, q)
    if scaled:
        per_codebook = torch.cat((inv_t[:, 1:2], inv_t[:, 2:3].expand(b, q - 1)), 1)
        g = g * inv_t[:, :1]
        a = a * per_codebook[:, :, None]
        k_g = k_g.masked_fill(greedy[:, 0], 1)
        k_rows = k_rows.masked_fill(torch.cat((greedy[:, 1:2], greedy[:, 2:3].expand(b, q - 1)), 1), 1)
    g[:, eos] = g[:, eos].masked_fill(eos_barred, -math.inf)
    g_tok = _sample_rows(_guided(g, guide, bonus, hard), k_g, kmax_g, u[:, 0])
    return g_tok, a.reshape(b * q, v), k_rows.reshape(-1), bad


_scripted_sample_rows = scripted(_sample_rows)
_scripted_guided = scripted(_guided)
_scripted_step_scores = scripted(_step_scores)


def draw_rows(scores: torch.Tensor, k: torch.Tensor, kmax: int, u: torch.Tensor) -> torch.Tensor:
    """`_sample_rows`' draws: by the compiled CPU kernel where it applies
    (models/cpu_sampler.py), else by TorchScript."""
    if cpu_sampler.applies(scores, kmax):
        return cpu_sampler.draw(scores, k, u)
    return _scripted_sample_rows()(scores, k, kmax, u)


class GuidingSets(NamedTuple):
    """Guidance already on the device (`livespeech.models.guidance_batch.GuidanceBatch.guide`):
    each row's guiding graphemes and whether EOS is barred."""
    mask: torch.Tensor  # [B, G] bool
    eos_barred: torch.Tensor  # [B] bool


def _guidance_inputs(states: Sequence[Optional[GuidanceState]], lambdas: Union[float, Sequence[float]],
                     shape: tuple[int, int], device) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(guide [B, G] bool, bonus [B], hard [B]) for `_guided`; None when no row is guided."""
    b, g = shape
    lam = _lambdas(lambdas, b)
    rows, cols = _guiding_cells(states, [x != 0.0 for x in lam])
    if not rows:
        return None
    bonus, hard = _bonus_and_hard(lam)
    up = Upload()
    for values, dtype in ((rows, torch.long), (cols, torch.long), (bonus, torch.float32), (hard, torch.bool)):
        up.add(values, dtype)
    r, c, bonus_t, hard_t = up.send(device)
    return _guide_mask((b, g), r, c), bonus_t, hard_t


def _guide_mask(shape: tuple[int, int], rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[B, G] bool, True at the guiding cells (`_guiding_cells`, sent to the device)."""
    mask = torch.zeros(shape, dtype=torch.bool, device=rows.device)
    mask[rows, cols] = True
    return mask


def sample_top_k(logits: torch.Tensor, top_ks: IntsLike,
                 generators: Union[Sequence[Optional[torch.Generator]], torch.Tensor, None] = None) -> torch.Tensor:
    """Plain top-k sampling of [B, V] -> [B] or [B, K, V] -> [B, K] logits.

    top_ks: an int, B ints (a session's k for all its codebooks), or a tensor [B] or
    [B, K]. generators: B per-session generators (K draws each for [B, K, V]), the
    draws themselves ([B, K] uniforms, `counter_uniforms`), or None.
    """
    if logits.dim() not in (2, 3):
        raise ValueError("logits must be [B, V] or [B, K, V]")
    b, v = logits.shape[0], logits.shape[-1]
    kc = logits.shape[1] if logits.dim() == 3 else 1
    device = logits.device
    if isinstance(top_ks, torch.Tensor) and top_ks.dim() == 2:
        k, kmax = _per_row_k(top_ks.reshape(-1), b * kc, v, device)
    else:
        k, kmax = _per_row_k(top_ks, b, v, device)
        if kc > 1:
            k = k.repeat_interleave(kc)
    u = _uniforms(generators, b, kc, device).reshape(-1)
    out = draw_rows(logits.reshape(b * kc, v).float(), k, kmax, u)
    return out.reshape(b, kc) if logits.dim() == 3 else out


def sample_graphemes(logits: torch.Tensor, states: Sequence[Optional[GuidanceState]],
                     lambdas: Union[float, Sequence[float]], top_ks: IntsLike,
                     generators: Optional[Sequence[Optional[torch.Generator]]] = None) -> torch.Tensor:
    """Algorithm 1 for B sessions: [B, G] grapheme logits -> LongTensor[B].

    states[b] None (or lambdas[b] == 0) means no guidance for that row. lambdas: one
    float or B floats in [0, inf]; inf is hard guidance. Does not call `observe`.
    """
    if logits.dim() != 2:
        raise ValueError("grapheme logits must be [B, G]")
    b, g = logits.shape
    device = logits.device
    guide = _guidance_inputs(states, lambdas, (b, g), device)
    k, kmax = _per_row_k(top_ks, b, g, device)
    u = _uniforms(generators, b, 1, device).reshape(-1)
    scores = logits.float()
    if guide is not None:
        scores = _scripted_guided()(scores, *guide)
    return draw_rows(scores, k, kmax, u)


class Temperatures(NamedTuple):
    """One session's sampling temperatures (logits / T; 0 = greedy)."""
    grapheme: float = 1.0
    first_codebook: float = 1.0
    acoustic: float = 1.0  # codebooks 2..Q


class SamplingSettings(NamedTuple):
    """One session's sampling settings (`SlotSampling.set` checks them)."""
    guidance_lambda: float = 1.0  # >= 0; inf: hard guidance
    top_k: int = 20  # the acoustic codes' k
    grapheme_top_k: Optional[int] = None  # None: top_k
    temperatures: Temperatures = Temperatures()


class SlotSampling:
    """Each slot's sampling settings as tensors on `device`, written when a session takes
    the slot (`set`): a step gathers its rows there (`rows`) instead of sending them, so
    its host work does not grow with them. The host keeps what it decides before a step:
    the largest k of the step's rows (`kmax`), whether any of them has a temperature
    other than 1 (`scaled`) and which are guided (lambda > 0: `guided`)."""

    def __init__(self, capacity: int, n_graphemes: int, vocab: int, device) -> None:
        self.n_graphemes, self.vocab = n_graphemes, vocab

        def full(*shape, dtype=torch.long, value=1):
            return torch.full((capacity, *shape), value, dtype=dtype, device=device)
        # a slot never set samples with k 1, temperature 1 and no guidance
        self.bonus, self.hard = full(dtype=torch.float32, value=0.0), full(dtype=torch.bool, value=False)
        self.guided_rows = full(dtype=torch.bool, value=False)  # lambda > 0 (on the host: `guided`)
        self.k_g, self.k_a = full(), full()
        self.inv_t, self.greedy = full(3, dtype=torch.float32, value=1.0), full(3, dtype=torch.bool, value=False)
        self._guided = np.zeros(capacity, dtype=bool)
        self._ks = np.ones((capacity, 2), dtype=np.int64)  # (grapheme, acoustic) k
        self._scaled = np.zeros(capacity, dtype=bool)

    def set(self, slot: int, settings: SamplingSettings) -> None:
        """`slot`'s settings from now on, checked: lambda >= 0 (inf: hard guidance), k
        clamped to [1, vocabulary], temperatures finite and >= 0 (0: greedy)."""
        lam = _lambdas([settings.guidance_lambda], 1)
        k_a = _row_ks([settings.top_k], 1, self.vocab)[0]
        k_g = _row_ks([settings.top_k if settings.grapheme_top_k is None else settings.grapheme_top_k], 1,
                      self.n_graphemes)[0]
        t = tuple(float(x) for x in settings.temperatures)
        if len(t) != 3 or not all(0.0 <= x < math.inf for x in t):
            raise ValueError("temperatures must be (grapheme, codebook 1, codebooks 2..Q) triples "
                             "of finite values >= 0")
        bonus, hard = _bonus_and_hard(lam)
        up = Upload()
        for values, dtype in ((bonus, torch.float32), (hard, torch.bool), ([lam[0] != 0.0], torch.bool),
                              ([k_g], torch.long), ([k_a], torch.long),
                              ([1.0 if x == 0.0 else 1.0 / x for x in t], torch.float32),
                              ([x == 0.0 for x in t], torch.bool)):
            up.add(values, dtype)
        sent = up.send(self.bonus.device)
        for dst, row in zip((self.bonus, self.hard, self.guided_rows, self.k_g, self.k_a), sent):
            dst[slot] = row[0]
        self.inv_t[slot], self.greedy[slot] = sent[5], sent[6]
        self._guided[slot], self._ks[slot], self._scaled[slot] = lam[0] != 0.0, (k_g, k_a), any(x != 1.0 for x in t)

    def kmax(self, slots: Sequence[int]) -> tuple[int, int]:
        """The largest grapheme and acoustic k of `slots`."""
        g, a = self._ks[np.asarray(slots)].max(0)
        return int(g), int(a)

    def scaled(self, slots: Sequence[int]) -> bool:
        """Whether some row of `slots` has a temperature other than 1."""
        return bool(self._scaled[np.asarray(slots)].any())

    def guided(self, slots: Sequence[int]) -> np.ndarray:
        """Whether each of `slots` is guided (lambda > 0)."""
        return self._guided[np.asarray(slots)]

    def guide(self, idx: Union[torch.Tensor, slice], sets: GuidingSets) -> GuidingSets:
        """`sets` for the rows `idx` (the slots on the device, or a slice of them) with the
        unguided rows' (lambda 0) guiding graphemes dropped."""
        return GuidingSets(sets.mask & self.guided_rows[idx][:, None], sets.eos_barred)

    def rows(self, idx: Union[torch.Tensor, slice], sets: GuidingSets) -> "SamplingRows":
        """The rows `idx` as `SamplingRows`, their guiding sets `sets` (`guide`d already)."""
        return SamplingRows(sets.mask, sets.eos_barred, self.bonus[idx], self.hard[idx], self.k_g[idx],
                            self.k_a[idx], self.inv_t[idx], self.greedy[idx])


def stage_guiding_sets(up: Upload, states: Sequence[GuidanceState], guided: Sequence[bool]) -> tuple[int, int, int]:
    """The per-session guidance's guiding sets and EOS bars staged into `up` (the step's
    one copy: models/upload.py); `sent_guiding_sets` makes them `GuidingSets`."""
    rows, cols = _guiding_cells(states, guided)
    return up.add(rows, torch.long), up.add(cols, torch.long), up.add([not st.speech_may_end for st in states],
                                                                       torch.bool)


def sent_guiding_sets(sent: Sequence[torch.Tensor], staged: tuple[int, int, int], n_graphemes: int) -> GuidingSets:
    rows, cols, barred = (sent[i] for i in staged)
    return GuidingSets(_guide_mask((barred.shape[0], n_graphemes), rows, cols), barred)


class FirstCodeBias(NamedTuple):
    """The front end's bias of codebook 1's logits given each row's phone
    (models/front_end.py `first_code_bias`): `table` [P, V], and each row's row of it
    (`rows` [B] on the device; -1: none)."""
    table: torch.Tensor
    rows: torch.Tensor

    def add_to(self, acoustic: torch.Tensor) -> torch.Tensor:
        """acoustic [B, Q, V] with each row's bias added to codebook 1, in place (the step's
        logits are its own, read by nothing else, and a concatenation copied every code's
        logit)."""
        bias = self.table[self.rows.clamp_min(0)] * (self.rows >= 0).unsqueeze(1)
        acoustic[:, 0].add_(bias.to(acoustic.dtype))
        return acoustic


class SamplingRows(NamedTuple):
    """Each row's sampling settings as tensors on the device (`SlotSampling.rows`): what a
    step's sampling reads besides the logits and the draws."""
    guide: torch.Tensor  # [B, G] bool: the guiding graphemes
    eos_barred: torch.Tensor  # [B] bool
    bonus: torch.Tensor  # [B] float: log(1 + lambda)
    hard: torch.Tensor  # [B] bool: lambda inf
    k_g: torch.Tensor  # [B] long: the grapheme's top-k
    k_a: torch.Tensor  # [B] long: the acoustic codes' top-k
    inv_t: torch.Tensor  # [B, 3] float: 1 / temperature of (grapheme, codebook 1, codebooks 2..Q)
    greedy: torch.Tensor  # [B, 3] bool: temperature 0

    def sample(self, g_logits: torch.Tensor, a_logits: torch.Tensor, u: torch.Tensor, kmax_g: int, kmax_a: int,
               scaled: bool = True, first_code: Optional[FirstCodeBias] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B, 1 + Q], bad [B]); `kmax_*` at least every row's k (more draws the
        same tokens); `scaled` False skips the temperatures (when they are all 1);
        `first_code`: a bias added to codebook 1's logits first (in place here)."""
        if cpu_sampler.applies(a_logits, kmax_a):  # the CPU's: one native call
            return cpu_sampler.sample_step(g_logits, a_logits, self.eos_barred, self.guide, self.bonus, self.hard,
                                           self.k_g, self.k_a, u, EOS, self.inv_t, self.greedy, scaled,
                                           *(first_code or (None, None)))
        if first_code is not None:
            a_logits = first_code.add_to(a_logits)
        g_tok, a, k_rows, bad = _scripted_step_scores()(g_logits, a_logits, self.eos_barred, self.guide, self.bonus,
                                                        self.hard, self.k_g, kmax_g, self.k_a, u, EOS, self.inv_t,
                                                        self.greedy, scaled)
        a_tok = draw_rows(a, k_rows, kmax_a, u[:, 1:].reshape(-1))
        return torch.cat((g_tok[:, None], a_tok.view(g_tok.shape[0], -1)), 1), bad


def sample_step(g_logits: torch.Tensor, a_logits: torch.Tensor, states: Union[Sequence[GuidanceState], GuidingSets],
                lambdas: Sequence[float], top_ks: Sequence[int],
                generators: Union[Sequence[Optional[torch.Generator]], torch.Tensor],
                grapheme_top_ks: Optional[Sequence[int]] = None,
                temperatures: Optional[Sequence[Sequence[float]]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step's tokens for B sessions in one TorchScript call: the grapheme by
    `sample_graphemes`, then the acoustic codes by `sample_top_k`, from the same uniforms
    (so the same tokens). top_ks: each row's k for the acoustic codes; grapheme_top_ks:
    for the grapheme (None: top_ks). temperatures: each row's `Temperatures` (None: all
    1, the logits as they are); a temperature 0 samples that token greedily. EOS is
    barred until a row's `speech_may_end` (its text complete and spoken). A row with
    non-finite logits gets its grapheme from zeros and codes in the vocabulary, so the
    batch goes on. g_logits [B, G],
    a_logits [B, Q, V] -> (tokens [B, 1 + Q] grapheme first, bad [B] bool: the rows
    whose logits were not finite). states: each row's `GuidanceState`, or `GuidingSets`
    of guidance kept on the device. generators: each row's generator, or the step's
    draws [B, 1 + Q] (`counter_uniforms`). The rows' settings go through a
    `SlotSampling` of B slots, as a server's sessions' do."""
    b, g = g_logits.shape
    q, v = a_logits.shape[1:]
    device = g_logits.device
    lam, ks = _lambdas(lambdas, b), _row_ks(top_ks, b, v)
    gks = [None] * b if grapheme_top_ks is None else _row_ks(grapheme_top_ks, b, g)
    if temperatures is not None and len(temperatures) != b:
        raise ValueError(f"expected {b} temperature triples, got {len(temperatures)}")
    table = SlotSampling(b, g, v, device)
    for r in range(b):
        table.set(r, SamplingSettings(lam[r], ks[r], gks[r], Temperatures() if temperatures is None else temperatures[r]))
    rows = list(range(b))
    if not isinstance(states, GuidingSets):
        up = Upload()
        staged = stage_guiding_sets(up, states, table.guided(rows))
        states = sent_guiding_sets(up.send(device), staged, g)
    idx = torch.arange(b, device=device)
    u = _uniforms(generators, b, 1 + q, device)  # one draw per token, grapheme first
    return table.rows(idx, table.guide(idx, states)).sample(g_logits, a_logits, u, *table.kmax(rows),
                                                            table.scaled(rows))
