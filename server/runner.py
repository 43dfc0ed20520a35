"""Model runner: every tensor the engine needs, behind plain-Python calls.

The engine decides which sessions run (scheduler) and what their windows are; the
runner owns the model, the per-slot `DecodeState`, the streaming codec state, and
sampling (semantic guidance and a small top-k for graphemes, top-k for acoustic codes,
each with the session's temperatures). Nothing here
knows about gRPC, timers or text chunking.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

from livespeech.api.session import SessionConfig
from livespeech.models import graphemes
from livespeech.models.derived import INT8, cpu_has_bf16_dot, cpu_has_int8_matmuls
from livespeech.models.guidance import (FirstCodeBias, GuidanceState, GuidingSets, SamplingSettings, SlotSampling,
                                        Temperatures, counter_uniforms, sample_step, sent_guiding_sets,
                                        stage_guiding_sets)
from livespeech.models.guidance_batch import GuidanceBatch, ring_capacity
from livespeech.models.inference import (DecodeState, DecodeStateView, StepResult, as_slice, enrollment_kv,
                                         window_bounds)
from livespeech.models.livespeech import StepLogits, text_guided
from livespeech.models.loading import ModelBundle
from livespeech.models.scripted import kernel_fusion
from livespeech.models.native_step import NativeStep
from livespeech.models.step_graph import (CapturedCodecStep, CapturedStep, FrozenCodecStep, FrozenStep, NativeCodecStep,
                                          OnnxCodecStep, frozen_or_eager)
from livespeech.models.upload import Upload
from livespeech.server.session_table import frames_for_ms
from livespeech.server.config import CODEC_RUNTIMES

log = logging.getLogger(__name__)


# The step's widest matmuls' weights by `EngineConfig.matmul_weights` (models/derived.py)
MATMUL_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "int8": INT8}

# On the CPU, the batch size from which the step graph with these weights runs: bf16's
# against float32 measured 0.77x at batch 1, 1.11x at 2, 1.58x at 4 and 1.39x at 16 (AMD
# EPYC with AVX512-BF16, one thread); int8's ran faster than float32 from one session
# (docs/loadtest.md, "Measured choices"). On a GPU from one session: a lone session's
# step reads every weight too.
LOW_PRECISION_FROM_BATCH = {"bfloat16": 2, "int8": 1}

# A batch whose slots are not a slice of the state steps the run of slots from its first
# to its last instead of a gathered copy while the run has at most this many rows a
# session of the batch (`ModelRunner._span`; measured in docs/loadtest.md, "Measured choices")
SPAN_MAX_ROWS_PER_SESSION = 1.5

# What a batch's view leaves out where the model step reads the state's own rows (a
# CUDA graph's bucket, a span of slots)
STEPPED_ELSEWHERE = ("conv", "ssm", "mem_k", "mem_v")

# The top-k sizes (grapheme, acoustic) the CUDA graphs record a step's sampling with: the
# sessions' defaults. A step with a session asking for more runs eagerly.
RECORDED_TOP_K = (SessionConfig().grapheme_top_k, SessionConfig().top_k)


def matmul_weights(setting: str, device: str) -> str:
    """The weights of the step's widest matmuls (`ServerConfig.matmul_weights`): the
    setting, or for "auto" int8 on an x86 CPU where fbgemm runs (`cpu_has_int8_matmuls`),
    else bfloat16 where the CPU has bf16 dot products (`cpu_has_bf16_dot`) or the CUDA
    device bfloat16, else float32. On a GPU bfloat16 halves the bytes of the weights a
    step reads and runs on tensor cores: in float32 the paper preset's compute bound at
    256 sessions alone is 12.2 ms of the 13.3 a frame allows (docs/loadtest.md)."""
    if setting != "auto":
        return setting
    kind = torch.device(device).type
    if kind == "cuda":
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    if kind == "cpu" and cpu_has_int8_matmuls():
        return "int8"
    return "bfloat16" if kind == "cpu" and cpu_has_bf16_dot() else "float32"


def codec_runtime(setting: str, device: str) -> str:
    """What runs the streaming codec (`ServerConfig.codec_runtime`): on the CPU the setting,
    "native" for "auto" (one native call, models/native/codec.cpp; where it cannot be
    built the runner falls back to ONNX Runtime, then torch); on a GPU "torch" (its CUDA
    graphs where the runner records them)."""
    if setting not in CODEC_RUNTIMES:
        raise ValueError(f"codec_runtime must be one of {', '.join(CODEC_RUNTIMES)}, got {setting!r}")
    if torch.device(device).type != "cpu":
        return "torch"
    return "native" if setting == "auto" else setting


@dataclass
class SlotStep:
    """What one session got from one decode step."""
    grapheme: int  # sampled at this step (frame = step)
    frame: Optional[list[int]]  # acoustic codes of a completed frame, if one completed
    frame_index: int
    done: bool  # all frames before EOS emitted
    failed: bool = False  # non-finite logits: the session must end, the others go on


@dataclass(eq=False)
class StepResults:
    """What the sessions of one decode step got, row i for its i-th slot, as arrays read
    from the device in one copy: the engine books them without an object a session."""
    grapheme: np.ndarray  # [B] sampled at this step (frame = step)
    frame_index: np.ndarray  # [B]
    has_frame: np.ndarray  # [B] bool: a frame completed
    done: np.ndarray  # [B] bool: all frames before EOS emitted
    failed: np.ndarray  # [B] bool: non-finite logits: the session must end, the others go on
    frames: np.ndarray  # [B, Q] the completed frame's acoustic codes (where has_frame)
    progress: np.ndarray  # [B] the guidance's progress after the step (transcript characters spoken)

    def __len__(self) -> int:
        return len(self.grapheme)

    def __getitem__(self, i: int) -> SlotStep:
        return SlotStep(int(self.grapheme[i]), self.frames[i].tolist() if self.has_frame[i] else None,
                        int(self.frame_index[i]), bool(self.done[i]), bool(self.failed[i]))


class SlotGuidance:
    """A session's guidance kept in the runner's `GuidanceBatch` (on the model's device):
    what the server calls on a `GuidanceState`. The runner observes each step's grapheme
    on the device and hands the progress back with the step's tokens."""

    def __init__(self, batch: GuidanceBatch, slot: int) -> None:
        self._batch, self._slot = batch, slot
        self._complete = False
        self.progress = 0

    def extend_transcript(self, ids: Sequence[int]) -> None:
        self._batch.queue(self._slot, ids)

    @property
    def input_complete(self) -> bool:
        return self._complete

    @input_complete.setter
    def input_complete(self, value: bool) -> None:
        if not value:
            raise ValueError("the end of input cannot be taken back")
        self._batch.end_input([self._slot])
        self._complete = True


@dataclass
class Voice:
    voice_id: str
    enrollment: torch.Tensor  # [N, D] speech-encoder output
    kv: torch.Tensor  # per-layer enrollment K/V, computed once per voice
    engine: int = 0  # the front end's synthesiser engine the voice sounds most like (models/front_end.py)


def _step_result(tokens: torch.Tensor, bad: torch.Tensor, forced: Optional[torch.Tensor],
                 force_eos: Optional[torch.Tensor], commit: Callable[[torch.Tensor], StepResult]) -> torch.Tensor:
    """The letter schedule's graphemes (`forced`, -1: sampled) and the runaway guard's EOS
    (`force_eos`) over a step's sampled tokens (None: none), then `commit(tokens)`; the
    step's result [B, 5 + Q]: grapheme, frame index, has frame, done, bad, the frame's codes."""
    if forced is not None:
        tokens[:, 0] = torch.where(forced >= 0, forced, tokens[:, 0])
    if force_eos is not None:
        tokens[:, 0] = tokens[:, 0].masked_fill(force_eos, graphemes.EOS)
    res = commit(tokens)
    return torch.cat((tokens[:, :1], res.frame_index[:, None], res.has_frame[:, None], res.done[:, None],
                      bad[:, None], res.frames[:, 1:]), 1)


class _StepRows:
    """Per slot, what a step recorded with its sampling and commit reads besides the
    state and the slots' `SlotSampling` (`ModelRunner._sample_and_commit`): the step fills
    the rows of its slots, and `active` says which those are."""

    def __init__(self, capacity: int, n_graphemes: int, device: torch.device):
        # a row never filled is sampled too (its result unused)
        def full(*shape, dtype=torch.long, value=0):
            return torch.full((capacity, *shape), value, dtype=dtype, device=device)
        self.active = full(dtype=torch.bool)
        self.forced, self.force_eos, self.bias_row = full(value=-1), full(dtype=torch.bool), full(value=-1)
        self.sets = GuidingSets(full(n_graphemes, dtype=torch.bool), full(dtype=torch.bool))

    def fill(self, idx: torch.Tensor, sets: GuidingSets, forced: Optional[torch.Tensor],
             force_eos: Optional[torch.Tensor], bias_row: Optional[torch.Tensor]) -> None:
        """The rows `idx` (the step's slots) from its guiding sets, forced graphemes, EOS
        and bias rows; None: none forced / no bias."""
        self.active.zero_()
        self.active[idx] = True
        for buf, rows in zip(self.sets, sets):
            buf.index_copy_(0, idx, rows)
        for buf, rows, none in ((self.forced, forced, -1), (self.force_eos, force_eos, False),
                                (self.bias_row, bias_row, -1)):
            if rows is None:
                buf.fill_(none)
            else:
                buf.index_copy_(0, idx, rows)


class ModelRunner:
    def __init__(self, bundle: ModelBundle, capacity: int, cuda_graphs: bool = False, frozen_step: bool = True,
                 native_step: bool = True,
                 matmul_weights: str = "float32", codec_runtime: str = "torch", device_guidance: bool = False,
                 max_text_chars: int = 100_000, text_cfg_scale: float = 0.0, warm_text_tokens: int = 0,
                 low_precision_from_batch: Optional[int] = None, compile_step: bool = False):
        if bundle.model.cfg.n_phones and (cuda_graphs or text_cfg_scale > 0):
            raise ValueError("a decoder with a phone input runs without CUDA graphs and text CFG")
        self.bundle = bundle
        self.model = bundle.model
        self.codec = bundle.codec
        self.device = bundle.device
        self.capacity = capacity
        self.span_max_rows_per_session = SPAN_MAX_ROWS_PER_SESSION  # `_span`; 0: every gapped batch gathered
        # the widest matmuls with bfloat16 or int8 weights: on the CPU from
        # LOW_PRECISION_FROM_BATCH sessions (the evaluation asks for them from one, to hear
        # what a busy server's sessions sound like), on a GPU from one, with the text memory
        # in bfloat16 too (on the CPU its float32 reads fit the cache at the lengths a server
        # reaches, and ran faster); int8 on the CPU only (fbgemm)
        if matmul_weights not in MATMUL_DTYPES:
            raise ValueError(f"matmul_weights must be one of {', '.join(MATMUL_DTYPES)}, got {matmul_weights!r}")
        if matmul_weights == "int8" and self.device.type != "cpu":
            raise ValueError("int8 matmul weights run on the CPU only")
        if codec_runtime not in ("native", "onnx", "torch"):  # as `codec_runtime` resolves the setting
            raise ValueError(f"codec_runtime must be native, onnx or torch, got {codec_runtime!r}")
        self.low_precision = MATMUL_DTYPES[matmul_weights]
        self.low_precision_from_batch = (
            low_precision_from_batch if low_precision_from_batch is not None
            else LOW_PRECISION_FROM_BATCH.get(matmul_weights, 1) if self.device.type == "cpu" else 1)
        memory_dtype = self._memory_dtype()
        self.state = DecodeState.allocate(self.model, capacity, device=self.device, memory_dtype=memory_dtype)
        if self.device.type == "cuda":
            kernel_fusion(False)  # no kernel compiled mid-service for a new batch size
        # on the CPU, the model step as one native call (where it builds) or a frozen
        # TorchScript graph, and the streaming codec as `codec_runtime` says (`_codec_step`);
        # the eager calls elsewhere
        frozen = frozen_step and self.device.type == "cpu"
        self.model_step, self.codec_step = self.model.step, self.codec.decode_step
        if frozen and not cuda_graphs:
            self.model_step = self._cpu_model_step(native_step, memory_dtype)
        # whether the model step is one native call (models/native_step.py), which takes the
        # rows' voices; kept, so that a wrapped step (a profiler's) still gets them
        self.native = isinstance(self.model_step, NativeStep)
        # with the CUDA graphs, the codec's too, for the packet most calls decode (the
        # sessions' default packet_ms)
        self.steady_packet_frames = frames_for_ms(SessionConfig().packet_ms)
        self.codec_step = self._codec_step(frozen, codec_runtime if self.device.type == "cpu" else "torch",
                                           self.steady_packet_frames if cuda_graphs else 0)
        # what decodes (the server logs it)
        self.codec_runtime = {NativeCodecStep: "native", OnnxCodecStep: "ONNX Runtime", FrozenCodecStep: "frozen graph",
                              CapturedCodecStep: "CUDA graphs"}.get(type(self.codec_step), "eager")
        self.codec_state = self.codec.streaming_state(capacity)
        # on CUDA the codec runs on a stream of its own, so its calls (on the codec thread,
        # server/codec_worker.py) overlap the model steps; every use of its streaming
        # state is on that stream, which starts after the state's allocation
        self._codec_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self._codec_stream is not None:
            self._codec_stream.wait_stream(torch.cuda.current_stream(self.device))
        # every slot's guidance as tensors on the device (models/guidance_batch.py): no
        # per-session Python and no read of the device for it in a step
        self.guidance = (GuidanceBatch(capacity, ring=ring_capacity(max_text_chars), device=self.device)
                         if device_guidance else None)
        if self.guidance is not None and cuda_graphs and self.device.type == "cuda":
            self.guidance.capture()
        # each slot's seed: its draws are `counter_uniforms` of the seed and the decode
        # step, made on the device (no generator state on the host)
        self.seeds = torch.zeros(capacity, dtype=torch.long, device=self.device)
        cfg = self.model.cfg
        self.sampling = SlotSampling(capacity, cfg.n_graphemes, cfg.codebook_size, self.device)
        # codebook 1's logits at a frame of each phone, for the letter schedule (models/front_end.py)
        self.first_code_bias = (bundle.front_end.first_code_bias().to(self.device)
                                if bundle.front_end is not None else None)
        self.bias_phones = bundle.front_end.bias_phones().to(self.device) if bundle.front_end is not None else None
        # classifier-free guidance on the text (`text_guided`): the decoder without text
        # steps beside every session, on a recurrent state of its own with no text memory
        self.text_cfg_scale = text_cfg_scale
        self.unconditioned = (DecodeState.allocate(self.model, capacity, device=self.device, text_tokens=0,
                                                   memory_dtype=memory_dtype)
                              if text_cfg_scale > 0 else None)
        # the model step over the smallest bucket of slots holding the batch, replayed
        # from a CUDA graph (eagerly off CUDA, which only tests use), its matmuls' dtype
        # recorded with it, at every batch size, and with it the step's sampling and
        # commit (`_sample_and_commit`; not with text CFG, whose logits come from two
        # steps); `compile_step`: the model step the graphs record is torch.compile's
        self._rows = (_StepRows(capacity, self.model.cfg.n_graphemes, self.device)
                      if cuda_graphs and self.unconditioned is None else None)
        self._kmax = RECORDED_TOP_K  # the top-k sizes `_sample_and_commit` runs with
        self.captured = (self._captured_step(self.state, compile_step,
                                             self._sample_and_commit if self._rows is not None else None)
                         if cuda_graphs else None)
        if self.captured is not None and self.captured.after is None:
            self._rows = None
        self.captured_unconditioned = (self._captured_step(self.unconditioned, compile_step)
                                       if cuda_graphs and self.unconditioned is not None else None)
        self._voice_lock = threading.Lock()
        self._warm_up(warm_text_tokens)

    def _captured_step(self, state: DecodeState, compiled: bool,
                       after: Optional[Callable[[StepLogits, int], torch.Tensor]] = None) -> CapturedStep:
        """The bucketed step over `state` (with `after` recorded after it), compiled by
        torch.compile when asked. Where that fails (no Triton, a step it cannot trace),
        the uncompiled one; where recording `after` fails, the model step alone (the
        sampling and commit then run call by call). Each fallback only costs speed."""
        def make(c: bool, a) -> CapturedStep:
            return CapturedStep(self.model, state, capture=self.device.type == "cuda",
                                matmul_dtype=self.low_precision, compiled=c, after=a)

        def name(c: bool, a) -> str:
            return ("compiled" if c else "uncompiled") + (" with its sampling and commit" if a else "")

        tries = [(compiled, after)] + [(False, after)] * compiled + [(False, None)] * (after is not None)
        for (c, a), then in zip(tries, tries[1:]):
            try:
                return make(c, a)
            except Exception as e:  # noqa: BLE001 - see above
                log.warning("recording the step %s failed (%s: %s); recording it %s", name(c, a),
                            type(e).__name__, e, name(*then))
        return make(*tries[-1])

    def _cpu_model_step(self, native: bool, memory_dtype: Optional[torch.dtype]):
        """The native step (models/native_step.py) when asked and where it builds, for a
        float32 memory; else the frozen graph, else the eager step."""
        if native and memory_dtype in (None, torch.float32):
            try:
                return NativeStep(self.model, matmul_dtype=self.low_precision)
            except Exception as e:  # noqa: BLE001 - any failure here only costs speed
                log.warning("the model step runs as a frozen graph: the native step failed (%s: %s)",
                            type(e).__name__, e)
        return frozen_or_eager(lambda: FrozenStep(self.model, matmul_dtype=self.low_precision), self.model.step)

    def _memory_dtype(self) -> Optional[torch.dtype]:
        """The text memory's dtype: bfloat16 on a GPU with bf16 matmul weights, else float32 (None)."""
        return self.low_precision if self.device.type == "cuda" else None

    @torch.inference_mode()
    def _warm_up(self, text_tokens: int) -> None:
        """Compile the TorchScript sampler and commit now: their first calls cost ~0.1 s,
        which would otherwise land in the first session's first packet. Project the
        `text_tokens` lowest token ids into the text K/V cache."""
        self.state.text_kv.warm(range(text_tokens))
        view = self.state.view([0, 0])  # a gathered copy: the state itself is not written
        cfg = self.model.cfg
        g = torch.zeros(2, cfg.n_graphemes, device=self.device)
        a = torch.zeros(2, cfg.n_acoustic_codebooks, cfg.codebook_size, device=self.device)
        for i in range(4):  # with and without temperatures (a branch of the sampler)
            tokens, _ = sample_step(g, a, [GuidanceState(), GuidanceState()], [1.0, 1.0], [1, 1],
                                    [torch.Generator(device=self.device)] * 2, [1, 1],
                                    None if i % 2 else [Temperatures(0.5, 0.0, 2.0)] * 2)
            self.state.commit(view, tokens)

    @property
    def frozen(self) -> bool:
        """Whether the model step runs as a frozen graph (tracing may have fallen back)."""
        return self.model_step != self.model.step

    @property
    def model_step_runtime(self) -> str:
        """What runs the model step (the server logs it, as `codec_runtime` for the codec)."""
        if self.native:
            return "native"
        return "frozen graph" if self.frozen else "CUDA graphs" if self.captured is not None else "eager"

    # --- voices (called from executor threads, not the engine loop) ---------------------
    @torch.no_grad()
    def make_voice(self, voice_id: str, audio: np.ndarray, sample_rate: int) -> Voice:
        codes = self.bundle.encode_audio(audio, sample_rate)  # [Q, T]
        with self._voice_lock:
            enroll = self.model.encode_enrollment(codes.unsqueeze(0).to(self.device))[0]
            engine = self.bundle.front_end.voice_engine(codes[0]) if self.bundle.front_end is not None else 0
            return Voice(voice_id, enroll, enrollment_kv(self.model, enroll), engine)

    # --- session slots --------------------------------------------------------------------
    def admit(self, slot: int, voice: Voice, seed: Optional[int], guidance: Optional[GuidanceState] = None,
              sampling: SamplingSettings = SamplingSettings()) -> Union[GuidanceState, SlotGuidance, None]:
        """Start `slot` for a session sampling with `sampling`; returns the guidance its
        steps take from now on: its own `guidance`, or with device guidance the slot's,
        holding the same transcript (which must not have observed a step yet)."""
        self.sampling.set(slot, sampling)  # first: bad settings leave the slot as it was
        self.state.reset_slot(slot, voice.kv)
        if self.unconditioned is not None:
            self.unconditioned.reset_slot(slot, voice.kv)
        with self._on_codec_stream():
            self.codec_state.update([slot], self.codec.streaming_state(1))
        seed = seed if seed is not None else torch.seed()
        # a uint64 seed (the wire's) as the int64 with its bits (counter_uniforms hashes bits)
        self.seeds[slot] = seed - (1 << 64) if seed >= 1 << 63 else seed
        if self.guidance is None:
            return guidance
        guidance = guidance if guidance is not None else GuidanceState()
        if guidance.stream_length:
            raise ValueError("a session's guidance moves to the device before its first step")
        self.guidance.reset([slot])
        on_device = SlotGuidance(self.guidance, slot)
        on_device.extend_transcript(guidance.transcript)
        if guidance.input_complete:
            on_device.input_complete = True
        return on_device

    def release(self, slot: int) -> None:
        """`slot` is free: its recurrent state zeroed, so that a step over a run of slots
        that spans it (`_span_step`) reads finite numbers there (a session that failed on
        non-finite logits leaves them; with int8 matmuls one activation scale serves the
        whole batch). Called on either thread: a free slot's rows feed no session's result."""
        self.state.clear_recurrent(slot)

    def set_sampling(self, slot: int, sampling: SamplingSettings) -> None:
        """`slot`'s sampling settings from its next step on (`admit` sets them first)."""
        self.sampling.set(slot, sampling)

    def flush_transcripts(self) -> None:
        """With device guidance, extend its transcripts by the text that arrived since the
        last call, every slot in one call (`GuidanceBatch.queue`), before a step copies its
        inputs; its steps would do it themselves."""
        if self.guidance is not None:
            self.guidance.flush()

    def add_chunk(self, slot: int, token_ids: Sequence[int], tau: int, chunk: int) -> None:
        self.state.append_chunk(slot, token_ids, float(tau), chunk)

    def place_chunks(self, slots: Sequence[int], chunks: Sequence[int], taus: Sequence[int]) -> None:
        """Re-place cached chunks: chunks[i] of slots[i] at taus[i]."""
        self.state.set_chunk_positions(slots, chunks, taus)

    def evict_chunks_before(self, slot: int, chunk: int) -> None:
        self.state.evict_chunks_before(slot, chunk)

    @property
    def text_capacity(self) -> int:
        """The tokens a slot's text memory holds (the server counts them itself:
        server/text_memory.py)."""
        return self.state.text_capacity

    # --- one decode step for a batch of sessions ------------------------------------------
    @torch.inference_mode()
    def step(
        self,
        slots: Sequence[int],
        windows: Union[Sequence[tuple[int, int]], np.ndarray],
        guidance: Sequence[Union[GuidanceState, SlotGuidance]],
        force_eos: Sequence[bool],
        forced_graphemes: Optional[Sequence[int]] = None,
        first_code_rows: Optional[Sequence[int]] = None,
    ) -> StepResults:
        """One step of `slots`, each sampling with its slot's settings (`admit`,
        `set_sampling`). windows: each row's first and last visible chunk, as (lo, hi)
        pairs or a [B, 2] array (`window_bounds`). force_eos: the runaway guard's EOS, over whatever was sampled.
        forced_graphemes: each row's grapheme from its letter schedule (-1: sampled);
        first_code_rows: the front end's `first_code_bias` row of each row's codebook-1
        frame (its phone, or its phone in context: `FrontEnd.bias_row`; -1: none), given
        which codebook 1 is sampled. Each session's guidance observes its grapheme (on the
        device with device guidance). With the CUDA graphs the model step, the sampling
        and the commit are one replay (`_sample_and_commit`); otherwise they run call by
        call (`_sample_and_commit_batch`)."""
        # every host-side input of the step goes to the device in one copy (models/upload.py)
        on_device = self.guidance is not None
        up = Upload()
        lo, hi = window_bounds(windows)
        rotations = self.state.stage_rotations(up, slots, lo, hi)
        lo_hi = up.add(lo.tolist(), torch.long), up.add(hi.tolist(), torch.long)
        cfg = self.model.cfg
        slot_rows = np.asarray(slots)  # the host's per-slot settings are read through it
        host_sets = None if on_device else stage_guiding_sets(up, guidance, self.sampling.guided(slot_rows))
        # where each of these is in the copy (None: no row has one)
        forced_at = (up.add(forced_graphemes, torch.long)
                     if forced_graphemes is not None and max(forced_graphemes) >= 0 else None)
        eos_at = up.add(force_eos, torch.bool) if any(force_eos) else None
        bias_at = (up.add(first_code_rows, torch.long)
                   if first_code_rows is not None and max(first_code_rows) >= 0 else None)
        sent = up.send(self.device)
        self.state.apply_rotations(sent, rotations)
        n_visible = span = None
        if self.captured is not None:  # it reads the whole state itself: its view gathers no memory
            view = self.state.view(slots, skip=STEPPED_ELSEWHERE)
        else:
            # the attention reads no text slot past the last one any row shows (past chunks
            # are evicted from the front, so the windows sit near the memory's start)
            n_visible = self.state.visible_length(slots, lo, hi)
            span = self._span(slots)
            view = (self.state.view(slots, skip=STEPPED_ELSEWHERE) if span is not None
                    else self.state.view(slots, memory_slots=self.model.cfg.n_enroll + n_visible))
        mask = self.state.window_mask(view, sent[lo_hi[0]], sent[lo_hi[1]])
        idx = self.state.slot_index(slots)
        # the per-slot settings of a run of consecutive slots (a full batch's) are read as
        # a slice: views, where each gather by an index tensor took ~20 us on the CPU
        rows = as_slice(slots) or idx
        sets = self.sampling.guide(rows, self.guidance.guide(idx, cfg.n_graphemes) if on_device
                                   else sent_guiding_sets(sent, host_sets, cfg.n_graphemes))
        forced, eos, bias_rows = (None if at is None else sent[at] for at in (forced_at, eos_at, bias_at))
        kmax = self.sampling.kmax(slot_rows)
        if self._rows is not None:  # the sampling and commit recorded with the model step
            self._rows.fill(idx, sets, forced, eos, bias_rows)
            replay = kmax[0] <= RECORDED_TOP_K[0] and kmax[1] <= RECORDED_TOP_K[1]
            self._kmax = RECORDED_TOP_K if replay else kmax
            out = self.captured(slots, view.inputs, view.step, mask, replay=replay)
        else:
            out = self._sample_and_commit_batch(slots, rows, view, mask, n_visible, span, sets, kmax,
                                                self.sampling.scaled(slot_rows), forced, eos, bias_rows)
        # out [B, 5 + Q]: grapheme, frame index, has frame, done, bad, the frame's codes
        if on_device:
            self.guidance.observe(idx, out[:, 0])
            out = torch.cat((out[:, :5], self.guidance.progress[idx][:, None], out[:, 5:]), 1)
        # one read of the device for the whole batch
        res = out.numpy(force=True)
        head = 6 if on_device else 5
        if on_device:
            progress = np.ascontiguousarray(res[:, head - 1])
            for g, p in zip(guidance, progress.tolist()):
                g.progress = p
        else:
            for g, x in zip(guidance, res[:, 0].tolist()):
                g.observe(x)
            progress = np.fromiter((g.progress for g in guidance), np.int64, len(guidance))
        # rows of their own (the engine's compiled passes read them)
        return StepResults(res[:, 0], res[:, 1], res[:, 2] != 0, res[:, 3] != 0, res[:, 4] != 0,
                           np.ascontiguousarray(res[:, head:]), progress)

    def _sample_and_commit_batch(self, slots, idx, view, mask, n_visible, span, sets, kmax, scaled, forced, eos,
                                 bias_rows) -> torch.Tensor:
        """`step`'s model step, sampling and commit call by call (the CPU's, and a GPU's
        with text CFG); `_sample_and_commit`'s result for the batch. idx: the slots' rows
        of their settings (an index tensor, or a slice: `as_slice`). span: the run of
        slots the model steps for the batch (`_span`), or None to step its view; sets: the
        rows' `GuidingSets`; kmax: their largest (grapheme, acoustic) k; scaled: whether
        one has a temperature other than 1; forced, eos, bias_rows: the rows' tensors on
        the device, or None where no row has one."""
        dtype = self.low_precision if len(slots) >= self.low_precision_from_batch else None
        if self.captured is not None:
            logits = self.captured(slots, view.inputs, view.step, mask)
        else:
            visible = mask[:, :n_visible]
            phone_in = None  # the phone input of a decoder that reads one (-1: none)
            if self.model.cfg.n_phones:
                phone_in = (self._phone_of_row(bias_rows) if bias_rows is not None
                            else torch.full((len(slots),), -1, device=self.device))
            if span is None:
                logits = self.model_step(view.inputs, view.step, view, visible, dtype, phones=phone_in,
                                         **self._voices(slots))
            else:
                logits = self._span_step(slots, span, visible, dtype, phone_in)
        if self.unconditioned is not None:
            logits = text_guided(logits, self._step_without_text(slots, view, dtype), self.text_cfg_scale)
        # a row with non-finite logits fails alone (`bad`); its tokens stay in range, so the batch goes on
        tokens, bad = self.sampling.rows(idx, sets).sample(logits.graphemes, logits.acoustic,
                                                           self.uniforms(idx, view.step), *kmax, scaled,
                                                           self._first_code(bias_rows))

        def commit(tokens: torch.Tensor) -> StepResult:
            res = self.state.commit(view, tokens)
            self.state.write_back(view)
            return res
        return _step_result(tokens, bad, forced, eos, commit)

    def _span(self, slots: Sequence[int]) -> Optional[range]:
        """The run of slots from the batch's first to its last, where the model steps it
        whole rather than gathering the batch (None: the batch is a slice already, or the
        run is too long, or text CFG steps a second state). A gathered batch copies every
        row's text memory, most of a session's state: at 15 of 16 sessions on 2 cores
        the runner step took 1.3-1.5x as long gathered as over the run of 16, while at 2
        slots a session the run was the slower by ~10 % (docs/loadtest.md, "Measured
        choices"); the engine gives sessions the lowest free slots, so a batch with
        sessions sitting out is mostly gaps in a short run."""
        first, last = min(slots), max(slots)
        n = last - first + 1
        if n == len(slots) or n > self.span_max_rows_per_session * len(slots) or self.unconditioned is not None:
            return None
        return range(first, last + 1)

    def _voices(self, rows: Sequence[int]) -> dict:
        """The native step's `voices` argument for the state's `rows` (which of them hold
        one voice's enrollment memory); nothing for the other steps."""
        if not self.native:
            return {}
        return {"voices": torch.from_numpy(self.state.voice[np.asarray(rows)])}

    def _span_step(self, slots: Sequence[int], span: range, visible: torch.Tensor, dtype: Optional[torch.dtype],
                   phones: Optional[torch.Tensor]) -> StepLogits:
        """The model step of `slots` run over `span`, a slice of the state: the span's
        other rows are stepped with their text masked and their recurrent state put back
        (`release` keeps a free slot's finite); the batch's rows of the logits."""
        rows = self.state.slot_index([s - span.start for s in slots])
        whole = self.state.view(span)
        mask = visible.new_zeros(len(span), visible.shape[1]).index_copy_(0, rows, visible)
        if phones is not None:
            phones = phones.new_full((len(span),), -1).index_copy_(0, rows, phones)
        stepped = set(slots)
        with self.state.recurrent_state_kept([s for s in span if s not in stepped]):
            logits = self.model_step(whole.inputs, whole.step, whole, mask, dtype, phones=phones, **self._voices(span))
        return StepLogits(graphemes=logits.graphemes.index_select(0, rows),
                          acoustic=logits.acoustic.index_select(0, rows))

    def _sample_and_commit(self, logits: StepLogits, b: int) -> torch.Tensor:
        """What the CUDA graphs record after the model step over the first `b` slots:
        codebook 1's bias, the sampling, the letter schedule's graphemes and the runaway
        guard's EOS, and the commit, from the slots' `SlotSampling` and the per-slot
        rows the step filled (`_StepRows`); the slots not stepped are left as they were.
        [b, 5 + Q] as `_sample_and_commit_batch`'s."""
        r = self._rows
        u = self.uniforms(slice(b), self.state.step[:b])
        sets = GuidingSets(*(t[:b] for t in r.sets))
        first_code = self._first_code(r.bias_row[:b]) if self.first_code_bias is not None else None
        tokens, bad = self.sampling.rows(slice(b), sets).sample(logits.graphemes, logits.acoustic, u, *self._kmax,
                                                                first_code=first_code)
        return _step_result(tokens, bad, r.forced[:b], r.force_eos[:b],
                            lambda tokens: self.state.commit_first(b, tokens, r.active[:b]))

    def _codec_step(self, frozen: bool, runtime: str, graph_frames: int):
        """What decodes packets: with `graph_frames`, CUDA graphs for packets of that many
        frames (eagerly off CUDA, which only tests use); on the CPU `runtime`'s step (native:
        one native call, else ONNX Runtime's; onnx: ONNX Runtime's), else the frozen graph
        (where one fails to build, the next, with a warning; each gives the same audio),
        else the eager one."""
        n_codebooks = self.model.cfg.n_acoustic_codebooks
        if graph_frames:
            try:
                return CapturedCodecStep(self.codec, n_codebooks, self.capacity, graph_frames,
                                         capture=self.device.type == "cuda")
            except Exception as e:  # noqa: BLE001 - any failure here only costs speed
                log.warning("the codec runs eagerly: recording its CUDA graphs failed (%s: %s)", type(e).__name__, e)
                return self.codec.decode_step
        makers = {"native": NativeCodecStep, "onnx": functools.partial(OnnxCodecStep, threads=torch.get_num_threads())}
        for name in {"native": ("native", "onnx"), "onnx": ("onnx",), "torch": ()}[runtime]:
            try:
                return makers[name](self.codec, n_codebooks)
            except Exception as e:  # noqa: BLE001 - any failure here only costs speed
                log.warning("the codec does not run %s (%s: %s)", name, type(e).__name__, e)
        if frozen:
            return frozen_or_eager(lambda: FrozenCodecStep(self.codec, n_codebooks), self.codec.decode_step)
        return self.codec.decode_step

    def _phone_of_row(self, row: torch.Tensor) -> torch.Tensor:
        """The phone of each `first_code_bias` row (row [B] on the device; -1 stays -1)."""
        return torch.where(row >= 0, self.bias_phones[row.clamp_min(0)], row)

    def _first_code(self, rows: Optional[torch.Tensor]) -> Optional[FirstCodeBias]:
        """The front end's bias rows (rows [B] on the device, -1: none) for the sampler to
        add to codebook 1's logits; None without rows."""
        if rows is None:
            return None
        if self.first_code_bias is None:
            raise ValueError("first_code_rows needs a bundle with a front end")
        return FirstCodeBias(self.first_code_bias, rows)

    def uniforms(self, slots: Union[torch.Tensor, slice], steps: torch.Tensor) -> torch.Tensor:
        """[B, 1 + Q] the draws of `slots` (a tensor on the device, or a slice) at their decode
        `steps`, one a token, grapheme first: a function of each session's seed and step."""
        return counter_uniforms(self.seeds[slots], steps, self.model.cfg.n_codebooks)

    def _step_without_text(self, slots: Sequence[int], view: DecodeStateView,
                           dtype: Optional[torch.dtype]) -> StepLogits:
        """The decoder without its text for `slots`, on the inputs of the sessions' `view`
        (taken before the step commits): their state without text advances with them."""
        no_text = torch.zeros(len(slots), 0, dtype=torch.bool, device=self.device)
        if self.captured_unconditioned is not None:
            return self.captured_unconditioned(slots, view.inputs, view.step, no_text)
        state = self.unconditioned.view(slots)
        logits = self.model_step(view.inputs, view.step, state, no_text, dtype)
        self.unconditioned.write_back(state)
        return logits

    # --- codec ------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, slots: Sequence[int], frames: Sequence[Sequence[Sequence[int]]]) -> list[np.ndarray]:
        """Streaming-decode each slot's new frames (same count for every slot) into 24 kHz
        float32 samples; the codec state carries over so packets join seamlessly.

        A stream's first packet shorter than the codec's `min_first_frames` (the engine
        sends one only when the whole speech was that short) is padded with its last
        frame, and its audio cut back to its own frames."""
        with self._on_codec_stream():
            return self._decode(list(slots), frames)

    def _decode(self, slots: list[int], frames: Sequence[Sequence[Sequence[int]]]) -> list[np.ndarray]:
        # frames [B][F][Q] (rows of `StepResults.frames`, or lists) -> codes [B, Q, F]
        codes = np.ascontiguousarray(np.asarray(frames, dtype=np.int64).transpose(0, 2, 1))
        codes = torch.from_numpy(codes).to(self.device)
        n, pad = codes.shape[-1], self.codec.min_first_frames - codes.shape[-1]
        fresh = (self.codec_state.frames[slots] == 0).tolist() if pad > 0 else [False] * len(slots)
        out: list[np.ndarray] = [np.empty(0, np.float32)] * len(slots)
        for padded in (False, True):
            rows = [i for i, f in enumerate(fresh) if f is padded]
            if not rows:
                continue
            c = codes[rows]
            if padded:
                c = torch.cat((c, c[..., -1:].expand(-1, -1, pad)), dim=-1)
            wav = self._decode_step([slots[i] for i in rows], c)[:, 0].float().cpu().numpy()
            for i, w in zip(rows, wav):
                out[i] = w[: len(w) * n // c.shape[-1]]
        return out

    def _on_codec_stream(self):
        return torch.cuda.stream(self._codec_stream) if self._codec_stream is not None else contextlib.nullcontext()

    def _decode_step(self, slots: list[int], codes: torch.Tensor) -> torch.Tensor:
        sub = self.codec_state.select(slots)
        wav = self.codec_step(codes, sub)  # [B, 1, F * hop]
        self.codec_state.update(slots, sub)
        return wav

    @property
    def min_first_frames(self) -> int:
        return self.codec.min_first_frames
