"""Caller-owned decoding state for batched, continuous inference.

`DecodeState` holds, for a fixed number of slots (one per session), everything a
decode step reads or writes: the Mamba conv/SSM states per layer, the cached unrotated
K/V of the enrollment and of the text chunks in memory, the text positions and chunk
ids (for the np/nf window), the next step's input tokens, and a small ring of frames
for undoing the delay pattern. Sessions join and leave between steps by slot; a step
runs on a `view` of any subset of slots (a plain slice when the slots are contiguous).
"""
from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import torch

from . import graphemes
from .attention import apply_rope, rope_angles
from .compiled import compiled, first_at_least
from .livespeech import LiveSpeech2
from .native_step import native_module
from .scripted import scripted
from .upload import Upload

NO_EOS = 1 << 40


@dataclass
class DecodeStateView:
    """The tensors one decode step reads or writes, batch = the sessions stepped."""
    conv: torch.Tensor  # [layers, B, d_inner, d_conv]
    ssm: torch.Tensor  # [layers, B, d_inner, d_state]
    # cross-attention memory [enrollment ; text]: keys [layers, B, H, N+L, 2*hd] with the
    # enrollment keys in the first half of the last dim and the *rotated* text keys in
    # the second (see CrossAttention.attend_step); values [layers, B, H, N+L, hd]
    mem_k: torch.Tensor
    mem_v: torch.Tensor
    txt_chunk: torch.Tensor  # [B, L] long, chunk id of each cached text token, -1 = empty
    inputs: torch.Tensor  # [B, K] next step's input tokens
    step: torch.Tensor  # [B] decode step (= query position)
    eos_frame: torch.Tensor  # [B] frame of the grapheme EOS, NO_EOS until sampled
    ring: torch.Tensor  # [B, R, K] sampled tokens by frame % R

    # which fields a step writes (scattered back after a gathered step)
    MUTABLE = ("conv", "ssm", "inputs", "step", "eos_frame", "ring")
    # tensors whose batch dim is 1 (the others: 0)
    LAYERED = ("conv", "ssm", "mem_k", "mem_v")


@dataclass
class StepResult:
    frames: torch.Tensor  # [B, K] codes of frame `frame_index` (grapheme first)
    frame_index: torch.Tensor  # [B] frame completed this step (-1: none yet)
    has_frame: torch.Tensor  # [B] bool: frames[b] is a real, complete frame
    done: torch.Tensor  # [B] bool: every frame before EOS has been emitted


class DecodeState(DecodeStateView):
    """All slots; also the unrotated text keys and the text positions, which only
    change when a chunk is added, evicted or re-placed (its rotation is applied when a
    window next sees the chunk; never inside a step)."""

    @classmethod
    def allocate(cls, model: LiveSpeech2, capacity: int, device=None, dtype=torch.float32,
                 text_tokens: Optional[int] = None, memory_dtype: Optional[torch.dtype] = None) -> "DecodeState":
        """Zeroed state for `capacity` slots, with room for `text_tokens` text tokens a
        slot (None: the model's max_text_tokens; 0 for the decoder without text that
        classifier-free guidance steps beside it). `memory_dtype` (None: `dtype`): that of
        the cross-attention memory (enrollment and text K/V), which a step reads whole
        for every session: bfloat16 halves those bytes (a GPU's bf16 matmuls, server/runner.py)."""
        cfg = model.cfg
        n_text = cfg.max_text_tokens if text_tokens is None else text_tokens
        n_layers = model.n_layers
        d_inner = cfg.expand * cfg.d_model
        hd = cfg.d_model // cfg.n_heads
        m = cfg.n_enroll + n_text
        z = lambda *shape, dt=dtype: torch.zeros(*shape, device=device, dtype=dt)  # noqa: E731
        st = cls(
            conv=z(n_layers, capacity, d_inner, cfg.d_conv),
            ssm=z(n_layers, capacity, d_inner, cfg.d_state),
            mem_k=z(n_layers, capacity, cfg.n_heads, m, 2 * hd, dt=memory_dtype or dtype),
            mem_v=z(n_layers, capacity, cfg.n_heads, m, hd, dt=memory_dtype or dtype),
            txt_chunk=torch.full((capacity, n_text), -1, dtype=torch.long, device=device),
            inputs=torch.tensor(model.none_ids(), device=device).repeat(capacity, 1),
            step=torch.zeros(capacity, dtype=torch.long, device=device),
            eos_frame=torch.full((capacity,), NO_EOS, dtype=torch.long, device=device),
            ring=torch.zeros(capacity, cfg.max_delay + 1, cfg.n_codebooks, dtype=torch.long, device=device),
        )
        st.model = model
        st.n_enroll = cfg.n_enroll
        st.head_dim = hd
        st.txt_k = z(n_layers, capacity, cfg.n_heads, n_text, hd)
        st.text_kv = TextKV(model)
        st.txt_pos = z(capacity, n_text, dt=torch.float32)
        st.delays = torch.tensor(cfg.delays, device=device)
        st.none = torch.tensor(model.none_ids(), device=device)
        # the chunk id of each cached text token (-1: none), mirrored on the host (txt_chunk),
        # so nothing about the text's layout is read back from the device; and how many a
        # slot caches (its first columns). Arrays, so that a step's bookkeeping over its
        # batch is a few numpy operations rather than a loop in Python a slot
        st.host_chunk = np.full((capacity, n_text), -1, np.int64)
        st.n_cached = np.zeros(capacity, np.int64)
        # each cached token's position where its key awaits rotation (NaN: rotated): a
        # chunk added (`append_chunk`) or re-placed, rotated by stage_rotations once a
        # window sees it (until then its keys are masked: a chunk far ahead moves at most
        # steps)
        st.unrotated = np.full((capacity, n_text), np.nan)
        st._slot_index = {}  # tuple of slots -> its index tensor (`slot_index`)
        # chunks cached on the host's side but not yet written to the device, as (slot,
        # first column, token ids, chunk): written all at once (`_stage_text`) before
        # anything reads the text memory, so a step's arriving words cost a few writes in
        # all rather than a few each
        st.pending_text = []
        # each slot's voice as a number, equal for the slots whose enrollment memory is a
        # copy of one tensor (`reset_slot`): a step may read that memory once for them
        # (models/native_step.py). Numbered by the tensor's identity while it lives
        st.voice = np.zeros(capacity, np.int64)
        st._voice_numbers = {}  # id(enrollment K/V) -> (a weak reference to it, its number)
        st._next_voice = 1  # numbers are never reused: a slot may still hold a gone voice's copy
        return st

    @property
    def capacity(self) -> int:
        return self.step.shape[0]

    # --- slots ------------------------------------------------------------------------
    def reset_slot(self, slot: int, enrollment_kv: torch.Tensor) -> None:
        """Start a session in `slot` with a voice's per-layer enrollment K/V
        ([layers, 2, H, N, hd], from `enrollment_kv`)."""
        n, hd = self.n_enroll, self.head_dim
        self.clear_recurrent(slot)
        self.mem_k[:, slot].zero_()
        self.mem_v[:, slot].zero_()
        self.mem_k[:, slot, :, :n, :hd] = enrollment_kv[:, 0]
        self.mem_v[:, slot, :, :n] = enrollment_kv[:, 1]
        self.voice[slot] = self._voice_number(enrollment_kv)
        self.txt_chunk[slot] = -1
        self.txt_pos[slot] = 0
        self.host_chunk[slot] = -1
        self.n_cached[slot] = 0
        self.unrotated[slot] = np.nan
        self.pending_text = [p for p in self.pending_text if p[0] != slot]
        self.inputs[slot] = self.none
        self.step[slot] = 0
        self.eos_frame[slot] = NO_EOS

    def _voice_number(self, enrollment_kv: torch.Tensor) -> int:
        """A number of its own for each enrollment K/V tensor while it lives (a tensor
        made later at the same address gets a new one)."""
        held = self._voice_numbers.get(id(enrollment_kv))
        if held is not None and held[0]() is enrollment_kv:
            return held[1]
        if len(self._voice_numbers) >= 1024:  # forget the voices gone
            self._voice_numbers = {k: v for k, v in self._voice_numbers.items() if v[0]() is not None}
        number, self._next_voice = self._next_voice, self._next_voice + 1
        self._voice_numbers[id(enrollment_kv)] = (weakref.ref(enrollment_kv), number)
        return number

    def view(self, slots: Sequence[int], skip: Sequence[str] = (),
             memory_slots: Optional[int] = None) -> DecodeStateView:
        """The batch of `slots` (a slice, not a copy, when they are contiguous). Fields
        in `skip` are left out (empty, and never written back): a caller that steps the
        model on the state's own rows (a CUDA graph's bucket, models/step_graph.py; a run
        of slots with gaps, server/runner.py) gathers no memory. `memory_slots`: a gathered
        view's memory holds only the first that many slots (enrollment, then text) of
        each row, those a step reads (`visible_length`): the memory is most of a
        session's state (1.6 MB for the default model)."""
        self.write_pending_text()
        sel = as_slice(slots)
        if sel is not None:
            pick = lambda name, t: t[:, sel] if name in DecodeStateView.LAYERED else t[sel]  # noqa: E731
        else:
            idx = self.slot_index(slots)

            def pick(name: str, t: torch.Tensor) -> torch.Tensor:
                if name in ("mem_k", "mem_v"):  # indexing copies only the columns kept (index_select ran ~2x slower)
                    return t[:, idx, :, :memory_slots]
                return t.index_select(1 if name in DecodeStateView.LAYERED else 0, idx)
        empty = lambda name, t: t[:, :0] if name in DecodeStateView.LAYERED else t[:0]  # noqa: E731
        v = DecodeStateView(**{f.name: (empty if f.name in skip else pick)(f.name, getattr(self, f.name))
                               for f in fields(DecodeStateView)})
        v.slots = list(slots)
        v.skipped = frozenset(skip)
        return v

    def slot_index(self, slots: Sequence[int]) -> torch.Tensor:
        """`slots` as an index tensor on the state's device, kept for the next step: a
        batch's slots stay the same from step to step, so a step copies none to the
        device (on a GPU each copy from the host waits for the queued kernels)."""
        key = tuple(slots)
        idx = self._slot_index.get(key)
        if idx is None:
            if len(self._slot_index) >= 256:  # batches come and go: keep the recent ones
                self._slot_index.clear()
            idx = self._slot_index[key] = torch.tensor(key, dtype=torch.long, device=self.step.device)
        return idx

    def clear_recurrent(self, slot: int) -> None:
        """Zero `slot`'s recurrent state (a slot left free)."""
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()

    @contextlib.contextmanager
    def recurrent_state_kept(self, slots: Optional[Sequence[int]] = None) -> Iterator[None]:
        """Steps run inside leave the recurrent state (conv, ssm) of `slots` (None: every
        slot) as it was: the rows a step runs only to keep its batch a slice of the state
        (the gaps in a run of slots, a CUDA graph's bucket), and the warm-up steps of a
        recording."""
        if slots is not None and not slots:
            yield
            return
        idx = None if slots is None else self.slot_index(slots)
        saved = [t.clone() if idx is None else t.index_select(1, idx) for t in (self.conv, self.ssm)]
        try:
            yield
        finally:
            for t, old in zip((self.conv, self.ssm), saved):
                if idx is None:
                    t.copy_(old)
                else:
                    t.index_copy_(1, idx, old)

    def write_back(self, view: DecodeStateView) -> None:
        """Scatter a gathered view's mutable tensors back (no-op for slices)."""
        if as_slice(view.slots) is not None:
            return
        idx = self.slot_index(view.slots)
        for name in DecodeStateView.MUTABLE:
            if name in view.skipped:
                continue
            dst = getattr(self, name)
            dst.index_copy_(1 if name in DecodeStateView.LAYERED else 0, idx, getattr(view, name))

    # --- text memory ----------------------------------------------------------------
    @property
    def text_capacity(self) -> int:
        """The tokens a slot's text memory holds."""
        return self.txt_chunk.shape[1]

    def text_room(self, slot: int) -> int:
        return self.text_capacity - int(self.n_cached[slot])

    def cached_chunks(self, slot: int) -> np.ndarray:
        """The chunk id of each token the slot caches, in order (chunks are cached in order)."""
        return self.host_chunk[slot, : self.n_cached[slot]]

    def _rotate(self, rows: Sequence[int], cols: Sequence[int], positions: Sequence[float]) -> None:
        """Give text keys (rows[i], cols[i]) = (slot, token) their positions and refresh
        their rotated copies, all in one go: a step re-rotates the chunks entering the
        windows of many sessions, and a call per chunk cost ~20 small ops."""
        up = Upload()
        staged = self._stage_text(up), self._stage_rotation(up, rows, cols, positions)
        self.apply_rotations(up.send(self.txt_pos.device), staged)

    def _stage_rotation(self, up: Upload, rows: Sequence[int], cols: Sequence[int],
                        positions: Sequence[float]) -> tuple[int, int, int]:
        return up.add(rows, torch.long), up.add(cols, torch.long), up.add(positions, self.txt_pos.dtype)

    def _stage_text(self, up: Upload) -> Optional[tuple[list[int], int, int, int]]:
        """The pending chunks' writes staged into `up` (None: none): (their token ids, and
        where their rows, columns and chunk ids are in the copy)."""
        if not self.pending_text:
            return None
        rows: list[int] = []
        cols: list[int] = []
        chunks: list[int] = []
        ids: list[int] = []
        for slot, a, token_ids, chunk in self.pending_text:
            n = len(token_ids)
            rows += [slot] * n
            cols += range(a, a + n)
            chunks += [chunk] * n
            ids += token_ids
        self.pending_text = []
        return ids, up.add(rows, torch.long), up.add(cols, torch.long), up.add(chunks, torch.long)

    def _write_text(self, sent: Sequence[torch.Tensor], staged: Optional[tuple[list[int], int, int, int]]) -> None:
        """The writes `_stage_text` staged: each token's unrotated key, value and chunk id."""
        if staged is None:
            return
        ids, r, c, chunk = staged[0], *(sent[i] for i in staged[1:])
        kv = self.text_kv(ids)  # [layers, 2, H, n, hd]
        # indices on dims 1 and 3 with a slice between: the indexed dim comes first, [n, layers, H, hd]
        self.txt_k[:, r, :, c] = kv[:, 0].permute(2, 0, 1, 3).to(self.txt_k.dtype)
        self.mem_v[:, r, :, self.n_enroll + c] = kv[:, 1].permute(2, 0, 1, 3).to(self.mem_v.dtype)
        self.txt_chunk[r, c] = chunk

    def write_pending_text(self) -> None:
        """Write the chunks cached since the last write to the device now (the step, a
        rotation or an eviction does it first; it is for readers of the tensors)."""
        if self.pending_text:
            up = Upload()
            staged = self._stage_text(up)
            self._write_text(up.send(self.txt_pos.device), staged)

    def apply_rotations(self, sent: Sequence[torch.Tensor], staged: tuple[Optional[tuple], Optional[tuple]]) -> None:
        """The text writes and rotations `stage_rotations` staged (either None: none), from
        what their `Upload` sent."""
        text, rotations = staged
        self._write_text(sent, text)
        if rotations is None:
            return
        r, c, pos = (sent[i] for i in rotations)
        e, hd = self.n_enroll, self.head_dim
        self.txt_pos[r, c] = pos
        cos, sin = rope_angles(pos, hd, self.model.cfg.rope_base)  # [n, hd/2]
        # indices on dims 1 and 3 with a slice between: the indexed dim comes first, [n, layers, H, hd]
        rotated = apply_rope(self.txt_k[:, r, :, c], cos[:, None, None], sin[:, None, None])
        self.mem_k[:, r, :, e + c, hd:] = rotated.to(self.mem_k.dtype)  # index_put does not cast

    def append_text(self, slot: int, token_ids: Sequence[int], positions: Sequence[float], chunk: int) -> None:
        """Cache a chunk's tokens (projected once: `TextKV`) at `positions`, their keys rotated
        now (caller makes room first)."""
        if token_ids:
            a = self._cache_text(slot, token_ids, chunk)
            self._rotate([slot] * len(token_ids), range(a, a + len(token_ids)), positions)

    def append_chunk(self, slot: int, token_ids: Sequence[int], first_position: float, chunk: int) -> None:
        """Cache a new chunk's tokens at first_position, first_position + 1, ...; their keys
        are rotated when a window first sees the chunk (`stage_rotations`, in the step's one
        copy from the host), as a re-placed chunk's are: a server adds text a word at a
        time, mostly far ahead of the speech, where the window's mask hides it, and a
        rotation of its own cost each word a copy and ~10 ops (caller makes room first)."""
        if (self.cached_chunks(slot) == chunk).any():
            raise ValueError(f"chunk {chunk} is cached already: append_text adds to it")
        if token_ids:
            a = self._cache_text(slot, token_ids, chunk)
            self.unrotated[slot, a : a + len(token_ids)] = first_position + np.arange(len(token_ids))

    def _cache_text(self, slot: int, token_ids: Sequence[int], chunk: int) -> int:
        """Cache a chunk's tokens after the slot's cached ones (their unrotated keys and
        values written with the other pending chunks': `pending_text`); returns the first
        one's column."""
        n, a = len(token_ids), int(self.n_cached[slot])
        if n > self.text_room(slot):
            raise ValueError("text memory full: evict past chunks first")
        self.pending_text.append((slot, a, list(token_ids), chunk))
        self.host_chunk[slot, a : a + n] = chunk
        self.n_cached[slot] = a + n
        return a

    def tokens_before(self, slot: int, chunk: int) -> int:
        """Cached tokens of chunks < `chunk` (chunks are cached in order)."""
        return int(np.searchsorted(self.cached_chunks(slot), chunk))

    def evict_chunks_before(self, slot: int, chunk: int) -> None:
        """Drop cached tokens of chunks < `chunk` (they left the np window for good)."""
        ids = self.cached_chunks(slot)
        if not len(ids) or ids[0] >= chunk:  # chunks are cached in order: nothing older is here
            return
        kept = np.flatnonzero(ids >= chunk)
        n, e = len(kept), self.n_enroll
        self.write_pending_text()
        keep = torch.from_numpy(kept).to(self.txt_chunk.device)
        self.txt_k[:, slot, :, :n] = self.txt_k[:, slot, :, keep].clone()
        for t in (self.mem_k, self.mem_v):
            t[:, slot, :, e : e + n] = t[:, slot, :, e + keep].clone()
            t[:, slot, :, e + n :] = 0
        for t, empty in ((self.txt_pos, 0.0), (self.txt_chunk, -1)):
            t[slot, :n] = t[slot, keep].clone()
            t[slot, n:] = empty
        for host, empty in ((self.host_chunk, -1), (self.unrotated, np.nan)):
            host[slot, :n] = host[slot, kept]
            host[slot, n:] = empty
        self.n_cached[slot] = n

    def visible_length(self, slots: Sequence[int], lo: Sequence[int], hi: Sequence[int]) -> int:
        """The text slots a step of `slots` with windows lo..hi must read: up to the last
        slot any row shows (`window_mask`'s last true column + 1), from the host's chunk
        spans, so cutting the mask there reads nothing back from the device."""
        return int(_visible_length(self.host_chunk, self.n_cached, np.asarray(slots, np.int64),
                                   np.asarray(lo, np.int64), np.asarray(hi, np.int64)))

    def set_chunk_positions(self, slots: Sequence[int], chunks: Sequence[int],
                            first_positions: Sequence[float]) -> None:
        """Re-place cached chunks on the speech timeline: chunks[i] of slots[i] from
        first_positions[i] on (chunks not cached: nothing). Their positions are written
        and their keys re-rotated (from the cached unrotated ones, nothing is
        re-projected) by `stage_rotations` once a step can see them: a chunk far ahead of
        the speech moves at almost every step, and while it is outside the np/nf window
        its keys are masked anyway. Here it is a write of host arrays."""
        _set_positions(self.host_chunk, self.n_cached, self.unrotated, np.asarray(slots, np.int64),
                       np.asarray(chunks, np.int64), np.asarray(first_positions, np.float64))

    def rotate_windows(self, slots: Sequence[int], windows: Sequence[tuple[int, int]]) -> None:
        """Bring the positions and keys of added or re-placed chunks up to date before a step
        in which slots[i] sees chunks windows[i] = (lo, hi)."""
        up = Upload()
        staged = self.stage_rotations(up, slots, *window_bounds(windows))
        if staged != (None, None):
            self.apply_rotations(up.send(self.txt_pos.device), staged)

    def stage_rotations(self, up: Upload, slots: Sequence[int], lo: np.ndarray,
                        hi: np.ndarray) -> tuple[Optional[tuple], Optional[tuple]]:
        """`rotate_windows` in two halves, so a step sends the rotations with its other
        inputs in one copy: the pending chunks' writes and the added or re-placed chunks'
        keys staged into `up` (each None: none), for `apply_rotations` once it is sent;
        slots[i] sees chunks lo[i]..hi[i] (`window_bounds`)."""
        text = self._stage_text(up)
        rows, cols, positions = _take_unrotated(self.host_chunk, self.n_cached, self.unrotated,
                                                np.asarray(slots, np.int64), lo, hi)
        if not len(rows):
            return text, None
        return text, self._stage_rotation(up, rows.tolist(), cols.tolist(), positions.tolist())

    def window_mask(self, view: DecodeStateView, lo: Union[Sequence[int], torch.Tensor],
                    hi: Union[Sequence[int], torch.Tensor]) -> torch.Tensor:
        """[B, L] keys of chunks lo[b]..hi[b] (the np/nf window); lo and hi as lists, or
        as tensors [B] on the state's device (sent with a step's other inputs)."""
        dev = view.txt_chunk.device
        if not isinstance(lo, torch.Tensor):
            up = Upload()
            up.add(lo, torch.long)
            up.add(hi, torch.long)
            lo, hi = up.send(dev)
        c = view.txt_chunk
        return (c >= 0) & (c >= lo.unsqueeze(1)) & (c <= hi.unsqueeze(1))

    # --- after sampling ---------------------------------------------------------------
    def commit(self, view: DecodeStateView, sampled: torch.Tensor) -> StepResult:
        """Record the tokens sampled at this step (sampled [B, K]); returns the frame that
        became complete, if any. Tokens at positions the delay pattern leaves empty are
        replaced by the none id, exactly as in training (models/delay.py)."""
        native = native_module() if sampled.device.type == "cpu" else None
        # on the CPU one native call (its ~15 TorchScript ops took 0.3 ms of a 16-session step)
        commit = native.commit if native is not None else _scripted_commit()
        frames, index, has, done = commit(view.step, view.eos_frame, view.ring, view.inputs, self.delays, self.none,
                                          sampled, graphemes.EOS, NO_EOS)
        return StepResult(frames=frames, frame_index=index, has_frame=has, done=done)

    def commit_first(self, b: int, sampled: torch.Tensor, active: torch.Tensor) -> StepResult:
        """`commit` for the first `b` slots, in place, where `active` [b] (the rows a
        step stepped: a recorded step over a bucket of slots runs every row of it); the
        other rows' state is left as it was."""
        view = self.view(range(b), skip=("conv", "ssm", "mem_k", "mem_v"))
        kept = view.step.clone(), view.eos_frame.clone(), view.ring.clone(), view.inputs.clone()
        res = self.commit(view, sampled)
        for t, old in zip((view.step, view.eos_frame, view.ring, view.inputs), kept):
            t.copy_(torch.where(active.view(-1, *[1] * (t.dim() - 1)), t, old))
        return res


def _commit(step: torch.Tensor, eos_frame: torch.Tensor, ring: torch.Tensor, inputs: torch.Tensor,
            delays: torch.Tensor, none: torch.Tensor, sampled: torch.Tensor, eos: int, no_eos: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`DecodeState.commit`'s tensor work; updates step, eos_frame, ring and inputs in place."""
    new_eos = (sampled[:, 0] == eos) & (eos_frame == no_eos)
    eos_frame.copy_(torch.where(new_eos, step, eos_frame))
    last = torch.cat((eos_frame[:, None], (eos_frame - 1)[:, None].expand(-1, sampled.shape[1] - 1)), 1)  # [B, K]
    frame = step.unsqueeze(1) - delays.unsqueeze(0)  # [B, K]
    valid = (frame >= 0) & (frame <= last)
    tokens = torch.where(valid, sampled, none.unsqueeze(0))
    r = ring.shape[1]
    b_idx = torch.arange(tokens.shape[0], device=tokens.device).unsqueeze(1)
    k_idx = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    ring[b_idx, frame % r, k_idx] = torch.where(valid, tokens, ring[b_idx, frame % r, k_idx])
    done_frame = step - delays[-1]
    frames = ring[torch.arange(tokens.shape[0], device=tokens.device), done_frame % r]
    has = (done_frame >= 0) & (done_frame <= eos_frame - 1)
    done = done_frame >= eos_frame - 1
    inputs.copy_(tokens)
    step.add_(1)
    return frames, done_frame, has, done


_scripted_commit = scripted(_commit)


def _visible_length(host_chunk, n_cached, slots, lo, hi):
    """`DecodeState.visible_length`: the most tokens of chunks <= hi cached by a row that
    shows one of chunks lo..hi (a row's cached chunk ids are sorted)."""
    length = 0
    for r in range(len(slots)):
        row, n = host_chunk[slots[r]], n_cached[slots[r]]
        end = first_at_least(row, n, hi[r] + 1)
        if first_at_least(row, n, lo[r]) < end:
            length = max(length, end)
    return length


def _take_unrotated(host_chunk, n_cached, unrotated, slots, lo, hi):
    """The tokens of chunks lo..hi whose keys await rotation, row by row: their slots,
    columns and positions, cleared from `unrotated`."""
    total = 0
    for r in range(len(slots)):
        row, n = host_chunk[slots[r]], n_cached[slots[r]]
        total += max(0, first_at_least(row, n, hi[r] + 1) - first_at_least(row, n, lo[r]))
    rows, cols, positions = np.empty(total, np.int64), np.empty(total, np.int64), np.empty(total)
    m = 0
    for r in range(len(slots)):
        s = slots[r]
        row, n = host_chunk[s], n_cached[s]
        for c in range(first_at_least(row, n, lo[r]), first_at_least(row, n, hi[r] + 1)):
            p = unrotated[s, c]
            if p == p:  # not NaN
                rows[m], cols[m], positions[m] = s, c, p
                unrotated[s, c] = np.nan
                m += 1
    return rows[:m], cols[:m], positions[:m]


def _set_positions(host_chunk, n_cached, unrotated, slots, chunks, first_positions):
    """`DecodeState.set_chunk_positions`, chunk after chunk."""
    for k in range(len(slots)):
        s = slots[k]
        row, n = host_chunk[s], n_cached[s]
        a, b = first_at_least(row, n, chunks[k]), first_at_least(row, n, chunks[k] + 1)
        for c in range(a, b):
            unrotated[s, c] = first_positions[k] + (c - a)


_visible_length = compiled(_visible_length)
_take_unrotated = compiled(_take_unrotated)
_set_positions = compiled(_set_positions)


def window_bounds(windows: Union[Sequence[tuple[int, int]], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Windows (lo, hi), pairs or a [B, 2] array, as the arrays of their first and last chunks."""
    lo, hi = np.asarray(windows, np.int64).reshape(-1, 2).T.copy()  # each a contiguous row
    return lo, hi


def as_slice(slots: Sequence[int]) -> Optional[slice]:
    """`slots` as the slice of the state's rows they are where they are consecutive and in
    order (a batch that is a view, not a copy), else None."""
    if not len(slots):
        return None
    first = int(slots[0])
    if int(slots[-1]) - first != len(slots) - 1 or any(b != a + 1 for a, b in zip(slots, slots[1:])):
        return None
    return slice(first, first + len(slots))


def enrollment_kv(model: LiveSpeech2, enroll: torch.Tensor) -> torch.Tensor:
    """Per-layer enrollment K/V for one voice: [N, D] -> [layers, 2, H, N, hd]."""
    return _stack_kv(model.project_enrollment(enroll.unsqueeze(0)))


def _stack_kv(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Per-layer ([1, H, n, hd], [1, H, n, hd]) -> [layers, 2, H, n, hd]."""
    return torch.stack([torch.stack((k[0], v[0])) for k, v in kv])


TEXT_KV_CAPACITY = 2048  # text tokens whose K/V a decode state keeps (`TextKV`)


class TextKV:
    """Text tokens' unrotated per-layer K/V, kept for the `capacity` tokens used last.
    A token's K/V depend on its id alone (its embedding, then each layer's projection),
    and projecting each arriving word through the spelling encoder and every layer cost
    the engine thread ~1.8 ms a word on the CPU default model (docs/loadtest.md); the
    words of running text are mostly a few thousand common tokens. It holds layers x 2 x
    d_model values a token: 20 MB for the default model, ~750 MB (float32) for the paper
    preset. The model's weights must not change while the cache lives (it belongs to one
    `DecodeState`)."""

    def __init__(self, model: LiveSpeech2, capacity: int = TEXT_KV_CAPACITY):
        self.model = model
        self.capacity = capacity
        self._kv: OrderedDict[int, torch.Tensor] = OrderedDict()  # token id -> [layers, 2, H, hd]

    def __len__(self) -> int:
        return len(self._kv)

    @torch.no_grad()
    def warm(self, token_ids: Sequence[int], batch: int = 256) -> None:
        """Project and keep `token_ids` now (at most `capacity` of them, in batches): a
        cold cache makes the first sessions' words cost the engine thread a projection
        each, where the text comes (docs/loadtest.md)."""
        ids = list(dict.fromkeys(token_ids))[: self.capacity]
        for i in range(0, len(ids), batch):
            self(ids[i: i + batch])

    @torch.no_grad()
    def __call__(self, token_ids: Sequence[int]) -> torch.Tensor:
        """[layers, 2, H, n, hd] for the n tokens, projecting only those not kept."""
        missing = [t for t in dict.fromkeys(token_ids) if t not in self._kv]
        if missing:
            device = next(self.model.parameters()).device
            kv = _stack_kv(self.model.project_text(torch.tensor([missing], device=device)))
            for j, t in enumerate(missing):
                self._kv[t] = kv[:, :, :, j].clone()
        for t in token_ids:
            self._kv.move_to_end(t)
        out = torch.stack([self._kv[t] for t in token_ids], dim=3)
        while len(self._kv) > self.capacity:
            self._kv.popitem(last=False)
        return out
