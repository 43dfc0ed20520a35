"""Semantic guidance for every slot of a batch as fixed-shape tensor work.

`GuidanceBatch` keeps the state of `livespeech.models.guidance.GuidanceState` (whose
docstring states the rules: collapsed stream, best prefixes by CER, progress, the band of
``band + 1`` transcript columns and the last ``band + 1`` stream rows) for all slots in
tensors on one device, so a decode step computes the guiding sets and observes the sampled
graphemes without reading the device back. Both give the same best prefixes, progress,
band and guiding sets after the same calls (tests/test_guidance_batch.py).

Per slot, in tensors (S slots, R = band + 1):
    row [S, R]        ED(stream, T[:lo + c]) for band column c < width (INF beyond)
    hist_sym / hist_val [S, R]  the last R stream rows (newest last): symbol, ED at the
                      band's right edge column (INF / -1 where the stream is shorter)
    tokens [S, C]     the collapsed transcript, a ring of C uint8 tokens: T[k] at k mod C
                      (C: room for a session's whole text, `ring_capacity`)
    lo, width, n, m, last_frame, progress, anchor, best_min, best_ed [S]; best [S, R]
Host side (text arrival is host-known): each slot's transcript length and last token, to
collapse repeats across chunks and place new tokens in the ring.

Every call runs in inference mode and computes over all S slots, changing the rows its
mask selects, so its shapes do not depend on the data: the band's entering columns are a
fixed loop of `band` steps, the edit-distance recurrences along a row or a column are a
cumulative minimum (v[c] = min over c' <= c of (x[c'] + c - c')), and CER comparisons are
exact integer cross-multiplications over the band's R x R column pairs.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from .graphemes import BLANK, EOS, VOCAB_SIZE
from .guidance import GuidingSets, transcript_tokens
from .scripted import scripted
from .step_graph import record_cuda_graph

__all__ = ["GuidanceBatch", "ring_capacity"]

INF = 1 << 40  # larger than any edit distance; sums with it stay far from overflow
_NONE = -1  # the symbol of stream row 0 and of rows not yet observed
# the per-slot tensors a call may replace (`GuidanceBatch._in_place` keeps them in place)
_STATE = ("row", "hist_sym", "hist_val", "best", "lo", "width", "n", "m", "last_frame", "progress", "anchor",
          "best_min", "best_ed")
if VOCAB_SIZE > 256:
    raise ImportError("grapheme ids must fit the transcript ring's uint8")


def ring_capacity(max_text_chars: int, band: int = 32) -> int:
    """A transcript ring with room for a whole text of `max_text_chars` characters (its
    collapsed graphemes are no more) and the band."""
    need = max(int(max_text_chars), 1) + band + 2
    return 1 << (need - 1).bit_length()


def _min_plus_distance(x: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """v[c] = min over c' <= c of x[c'] + (c - c'), along dim 1 (cols: arange of its width):
    the edit-distance recurrence along a row or a column of the band."""
    return torch.cummin(x - cols, 1).values + cols


def _grow_columns(row: torch.Tensor, width: torch.Tensor, hist_sym: torch.Tensor, hist_val: torch.Tensor,
                  ahead: torch.Tensor, count: torch.Tensor, cols: torch.Tensor,
                  inf: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` [S] columns (0 to band) entering each band on the right: column hi + 1 + k
    (its transcript token ahead[:, k]) over the stored stream rows, oldest first, from the
    rows' values at the edge column (hist_val). Returns (row, hist_val) with them added;
    inf: `INF` (TorchScript reads no globals)."""
    band = cols.shape[0] - 1
    cost = (hist_sym[:, None, :] != ahead[:, :, None]).long()  # [S, band, R]
    above = torch.full_like(hist_val[:, :1], inf)  # over the oldest stored row
    val = hist_val
    edge: list[torch.Tensor] = []
    for k in range(band):  # a band holds 1 to band + 1 columns
        diag = torch.cat((above, val[:, :-1]), 1) + cost[:, k]
        v = _min_plus_distance(torch.minimum(val + 1, diag), cols)
        val = torch.where((count > k)[:, None], v, val)
        edge.append(val[:, -1])
    entering = torch.stack(edge, 1)  # [S, band]: the newest row's value at column hi + 1 + k
    k = cols[None, :] - width[:, None]
    new = entering.gather(1, k.clamp(0, band - 1))
    row = torch.where((k >= 0) & (k < count[:, None]), new, row)
    return row.clamp_max(inf), val.clamp_max(inf)


_scripted_grow = scripted(_grow_columns)


class GuidanceBatch:
    """Guidance state of `slots` sessions on `device` (see the module docstring)."""

    @torch.inference_mode()
    def __init__(self, slots: int, band: int = 32, ring: int = 4096,
                 device: Optional[torch.device | str] = None) -> None:
        band = int(band)
        if band < 4:
            raise ValueError("band must be >= 4")
        if ring & (ring - 1) or ring < 2 * (band + 2):
            raise ValueError("ring must be a power of two >= 2 * (band + 2)")
        self.slots, self.band, self.ring = int(slots), band, int(ring)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        r, s, dev = band + 1, self.slots, self.device
        z = lambda: torch.zeros(s, dtype=torch.long, device=dev)  # noqa: E731
        self._cols = torch.arange(r, device=dev)
        self._all = torch.arange(s, device=dev)
        self.tokens = torch.zeros(s, self.ring, dtype=torch.uint8, device=dev)
        self.row = torch.full((s, r), INF, dtype=torch.long, device=dev)
        self.hist_sym = torch.full((s, r), _NONE, dtype=torch.long, device=dev)
        self.hist_val = torch.full((s, r), INF, dtype=torch.long, device=dev)
        self.best = torch.zeros(s, r, dtype=torch.bool, device=dev)
        self.lo, self.width, self.n, self.m = z(), z(), z(), z()
        self.last_frame, self.progress, self.anchor, self.best_min, self.best_ed = z(), z(), z(), z(), z()
        self.complete = torch.zeros(s, dtype=torch.bool, device=dev)
        self._active = torch.zeros(s, dtype=torch.bool, device=dev)  # `observe`'s inputs
        self._frame = torch.zeros(s, dtype=torch.long, device=dev)
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._host_n = [0] * s
        self._host_last: list[Optional[int]] = [None] * s
        self._queued: dict[int, list[int]] = {}  # `queue`d grapheme ids by slot, not yet extended
        self.reset(range(s))

    # ------------------------------------------------------------------ host calls
    def _mask(self, slots: Iterable[int]) -> torch.Tensor:
        m = torch.zeros(self.slots, dtype=torch.bool)
        m[list(slots)] = True
        return m.to(self.device)

    @torch.inference_mode()
    def reset(self, slots: Iterable[int]) -> None:
        """Start `slots` afresh: empty transcript and stream, input open."""
        slots = list(slots)
        if not slots:
            return
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.row[idx] = INF
        self.row[idx, 0] = 0
        self.hist_sym[idx] = _NONE
        self.hist_val[idx] = INF
        self.hist_val[idx, -1] = 0
        self.best[idx] = False
        self.best[idx, 0] = True
        for t in (self.lo, self.n, self.m, self.progress, self.anchor, self.best_min, self.best_ed):
            t[idx] = 0
        self.width[idx] = 1
        self.last_frame[idx] = _NONE
        self.complete[idx] = False
        for s in slots:
            self._host_n[s], self._host_last[s] = 0, None
            self._queued.pop(s, None)

    def queue(self, slot: int, ids: Sequence[int]) -> None:
        """`extend` `slot`'s transcript by `ids` at the next `guide` or `observe`, in one
        call with every slot's queued ids: an `extend` recentres the band of every slot
        (a few hundred ops over all of them), and text arrives a word at a time. Extending
        by several words at once ends in the same state as word by word
        (tests/test_guidance_batch.py)."""
        queued = self._queued.setdefault(slot, [])
        queued.extend(ids)
        if self._host_n[slot] + len(queued) + self.band + 2 > self.ring:
            # near the ring's room: `extend` checks it now, where the text came, and a
            # flush (of slots below it) cannot fail
            self.extend({slot: self._queued.pop(slot)})

    def flush(self) -> None:
        """`extend` by the ids `queue`d so far."""
        if self._queued:
            queued, self._queued = self._queued, {}
            self.extend(queued)

    @torch.inference_mode()
    def extend(self, chunks: dict[int, Sequence[int]]) -> None:
        """Append grapheme ids (>= SPACE) to each slot's transcript, repeats collapsed across
        the join too, as `GuidanceState.extend_transcript` (one chunk per slot a call)."""
        news = {s: new for s, chunk in chunks.items() if (new := transcript_tokens(chunk, self._host_last[s]))}
        for s, new in news.items():  # every slot checked before any changes
            n = self._host_n[s]
            # the ring holds T[lo - 1:], all a slot still reads; lo is read only near the limit
            if n + len(new) + 1 > self.ring and n + len(new) - int(self.lo[s]) + 1 > self.ring:
                raise ValueError(f"slot {s}: the unspoken transcript would exceed {self.ring} graphemes")
        slots, pos, ids = [], [], []
        for s, new in news.items():
            n = self._host_n[s]
            slots.extend([s] * len(new))
            pos.extend(range(n, n + len(new)))
            ids.extend(new)
            self._host_n[s], self._host_last[s] = n + len(new), new[-1]
        if not ids:
            return
        dev = self.device
        at = torch.tensor(pos, dtype=torch.long, device=dev) & (self.ring - 1)
        self.tokens[torch.tensor(slots, dtype=torch.long, device=dev), at] = torch.tensor(ids, dtype=torch.uint8, device=dev)
        touched = sorted(set(slots))
        self.n[torch.tensor(touched, dtype=torch.long, device=dev)] = torch.tensor(
            [self._host_n[s] for s in touched], dtype=torch.long, device=dev)
        rows = self._mask(touched)
        self._in_place(lambda: self._recenter(rows))

    @torch.inference_mode()
    def end_input(self, slots: Iterable[int]) -> None:
        self.complete[self._mask(slots)] = True

    def transcript_length(self, slot: int) -> int:
        self.flush()
        return self._host_n[slot]

    # ------------------------------------------------------------------ device calls
    @torch.inference_mode()
    def observe(self, slots: torch.Tensor, graphemes: torch.Tensor) -> None:
        """Record one sampled frame (any id) of each of `slots` ([B] long) on the device."""
        self.flush()
        self._active.zero_()
        self._active[slots] = True
        self._frame.fill_(_NONE - 1)
        # no .to() for tokens already here: on the CPU the count of copies from the host
        # (loadtest/host_reads.py) cannot tell it from one
        same = graphemes.device == self.device
        self._frame[slots] = graphemes.long() if same else graphemes.to(self.device, torch.long)
        if self._graph is not None:
            self._graph.replay()
        else:
            self._in_place(self._observe_all)

    def capture(self, warmup: int = 5) -> None:
        """Record `observe`'s tensor work as a CUDA graph (CUDA devices only), replayed
        from then on: one launch instead of a few hundred kernels. The warm-up runs let
        TorchScript's profiling executor settle before the recording."""
        self._active.zero_()  # no slot observes: the warm-up and the recording change nothing
        self._graph, _ = record_cuda_graph(lambda: self._in_place(self._observe_all), self.device, warmup)

    def _observe_all(self) -> None:
        active, g = self._active, self._frame
        changed = active & (g != self.last_frame)
        self.last_frame = torch.where(changed, g, self.last_frame)
        advance = changed & (g > EOS)
        self._advance(advance, g)
        # the band was full before the new row (every call ends by filling it), so the
        # recentering's first fill has nothing to add
        self._recenter(advance, filled=True)

    def _in_place(self, work) -> None:
        """Run `work` (which assigns new state tensors) and copy its results into the state's
        own tensors, whose memory stays put for a recorded graph and for later calls."""
        kept = {name: getattr(self, name) for name in _STATE}
        work()
        for name, t in kept.items():
            new = getattr(self, name)
            if new is not t:
                t.copy_(new)
                setattr(self, name, t)

    @torch.inference_mode()
    def guide(self, slots: torch.Tensor, vocab: int = VOCAB_SIZE) -> GuidingSets:
        """The guiding sets ([B, vocab] bool) and EOS bars of `slots` ([B] long), as
        `GuidanceState.guiding_set` and ``not speech_may_end``: `sample_step` takes them."""
        self.flush()
        best = self.best[slots]
        i = self.lo[slots, None] + self._cols
        n = self.n[slots, None]
        stay, fwd = self._tokens_at(slots[:, None], i - 1), self._tokens_at(slots[:, None], i)
        counts = torch.zeros(best.shape[0], vocab, dtype=torch.long, device=self.device)
        counts.scatter_add_(1, stay, (best & (i >= 1)).long())
        counts.scatter_add_(1, fwd, (best & (i < n)).long())
        end = (best & (i >= n)).any(1) & self.complete[slots]
        guide = counts > 0
        guide[:, BLANK] |= end
        guide[:, EOS] |= end
        barred = ~(self.complete[slots] & (self.progress[slots] >= self.n[slots]))
        return GuidingSets(guide, barred)

    # ------------------------------------------------------------------ tensor work
    def _tokens_at(self, rows: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """T[k] of each row's slot (k < 0 or not yet written: whatever the ring holds)."""
        return self.tokens[rows, k & (self.ring - 1)].long()

    def _advance(self, rows: torch.Tensor, g: torch.Tensor) -> None:
        """A new collapsed-stream symbol g for `rows`: the next DP row over the band."""
        cols = self._cols
        t = self._tokens_at(self._all[:, None], self.lo[:, None] + cols - 1)  # column c's T[lo + c - 1]
        inf = torch.full_like(self.row[:, :1], INF)
        diag = torch.cat((inf, self.row[:, :-1]), 1) + (t != g[:, None]).long()
        new = _min_plus_distance(torch.minimum(self.row + 1, diag), cols).clamp_max(INF)
        new = new.masked_fill(cols >= self.width[:, None], INF)
        edge = new.gather(1, (self.width - 1).clamp_min(0)[:, None])
        self.row = torch.where(rows[:, None], new, self.row)
        self.m = self.m + rows.long()
        self.hist_sym = torch.where(rows[:, None], torch.cat((self.hist_sym[:, 1:], g[:, None]), 1), self.hist_sym)
        self.hist_val = torch.where(rows[:, None], torch.cat((self.hist_val[:, 1:], edge), 1), self.hist_val)

    def _grow(self, rows: torch.Tensor) -> None:
        """Columns up to min(N, lo + band) for `rows`, computed over the stored stream rows."""
        hi = self.lo + self.width - 1
        count = torch.where(rows, (torch.minimum(self.n, self.lo + self.band) - hi).clamp_min(0), 0)
        ahead = self._tokens_at(self._all[:, None], hi[:, None] + self._cols[:-1])  # column hi + 1 + k's token
        self.row, self.hist_val = _scripted_grow()(self.row, self.width, self.hist_sym, self.hist_val, ahead, count,
                                                   self._cols, INF)
        self.width = self.width + count

    def _find_best(self, rows: torch.Tensor) -> None:
        """Best prefixes (least CER, ties all), progress and anchor for `rows`."""
        cols = self._cols
        valid = cols < self.width[:, None]
        i = self.lo[:, None] + cols
        e = self.row.masked_fill(~valid, INF)
        # CER as a fraction num / den; the empty prefix scores 0 against an empty stream,
        # e / 1 when the transcript is empty, otherwise never best (den 0: infinite)
        at0 = i == 0
        num = torch.where(at0 & (e > 0) & (self.n[:, None] > 0), torch.ones_like(e), e)
        den = torch.where(at0, (e == 0) | (self.n[:, None] == 0), i).long()
        num, den = num.masked_fill(~valid, 1), den.masked_fill(~valid, 0)
        # column x is best iff num_x / den_x <= num_y / den_y for every valid y
        le = num[:, :, None] * den[:, None, :] <= num[:, None, :] * den[:, :, None]
        best = valid & (le | ~valid[:, None, :]).all(2)
        big = torch.full_like(i, INF)
        best_min = torch.where(best, i, big).min(1).values
        emin = e.min(1).values
        at_min = valid & (e == emin[:, None])
        first = torch.where(at_min, i, big).min(1).values
        last = torch.where(at_min, i, -big).max(1).values
        best_ed = e.gather(1, (best_min - self.lo).clamp(0, self.band)[:, None]).squeeze(1)
        self.best = torch.where(rows[:, None], best, self.best)
        self.best_min = torch.where(rows, best_min, self.best_min)
        self.best_ed = torch.where(rows, best_ed, self.best_ed)
        self.anchor = torch.where(rows, first, self.anchor)
        self.progress = torch.where(rows, torch.minimum(best_min, last), self.progress)

    def _recenter(self, rows: torch.Tensor, filled: bool = False) -> None:
        """`GuidanceState._recenter` for `rows`: fill the band (unless `filled`: it is), find
        the best prefixes, move the band's start to them less a quarter band (never back),
        fill and find again."""
        if not filled:
            self._grow(rows)
        self._find_best(rows)
        target = torch.maximum(self.lo, torch.minimum(self.best_min, self.anchor) - self.band // 4)
        d = torch.where(rows, target - self.lo, torch.zeros_like(self.lo))
        src = self._cols + d[:, None]
        shifted = self.row.gather(1, src.clamp_max(self.band))
        self.row = shifted.masked_fill(src >= self.width[:, None], INF)
        self.width = self.width - d
        self.lo = self.lo + d
        self._grow(rows)
        self._find_best(rows)
