"""Where one batched decode step spends its time, and how far it is from the machine's limits.

    python -m livespeech.loadtest.profile_step --model-path random:tiny --batch 1 16 --steps 200 --json profile.json
    python -m livespeech.loadtest.profile_step --batch 1 16 --trace runs/trace    # + torch.profiler chrome traces
    python -m livespeech.loadtest.profile_step --batch 16 --trace runs/trace --trace-shapes   # + ops by input shape

The real engine (server/engine.py) runs B sessions in-process (no gRPC; the sessions
never yield for playback lead, so every step carries all B, and a finished session is
replaced at once). Timing wrappers are installed around the runner's and the model's
pieces *from outside* (instance attributes and, for the run only, a few module/class
attributes that are restored afterwards); the code under test is not modified and
behaves the same. Each scope's exclusive time is reported per step:

    engine.step            Engine._step: per-session Python (timeline, words, chunk memory)
      runner.step          ModelRunner.step: state gather/mask/commit/tolist
        model.step         LiveSpeech2.step: embeddings, RoPE, window bias, residual adds
          mamba            MambaBlock.step (every layer)
          cross-attention  CrossAttention.attend_step (every layer)
          layernorm        norm1/norm2 and the group norms
          heads            the output projections (one stacked matmul per codebook group)
        sampling           SamplingRows.sample: semantic guidance and top-k for the grapheme
                           and the acoustic codes (one TorchScript call)
          guidance.set     GuidanceState.guiding_set (Python)
        state.*            DecodeState view / window_mask / commit / write_back
      guidance.observe     GuidanceState.observe (Python)
      words/timeline       EngineSession.track_words (Python), SpeechTimelines.replace (the batch's)
      text.add/place/evict ModelRunner.add_chunk (projects a chunk's K/V) / place_chunks
                           (re-rotates cached keys) / evict_chunks_before, via the
                           engine's TextMemory.fill / evict_past
      codec                ModelRunner.decode (tensor prep) > codec.decode_step (the codec)
      audio.encode         AudioEncoder.push (PCM packets)
    engine.commands/select the loop's command queue and scheduler
    engine.loop-other      the rest of the loop iteration (chunk timers, idle checks)

Run once without the fine wrappers too (`step_ms_plain`), so their overhead is visible;
that run times the runner's step and the codec's calls only, and the step less those is
the engine's own work (`engine_own_ms_plain`: its per-session Python, the text memory's
calls and the audio's delivery; `engine_own_ms_median`: the median over the steps of each
step's own, steadier than the mean where a few steps deliver the audio of many sessions).

Cost model: FLOPs and bytes of one step are counted from the model's parameter shapes
(weights read once per step; per-session MACs; per-session state read/written),
cross-checked with torch's FlopCounterMode, and compared with this machine's sgemm
throughput and memcpy bandwidth, both measured in the same run with the same thread
count: `roofline_fraction` = max(FLOPs / peak FLOP/s, bytes / peak B/s) / measured time
(`roofline_fraction_plain`: against the uninstrumented run's step).
A step with bfloat16 or int8 matmul weights (`--matmul-weights`; bfloat16 from batch 2 on
the CPU) counts the matmuls it runs in that precision at the measured bf16 gemm (or int8
dynamically quantised linear) throughput and their weights at 2 (or 1) bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from livespeech.server.config import CODEC_RUNTIMES, MATMUL_WEIGHTS
from livespeech.server.runner import codec_runtime, matmul_weights

# ------------------------------------------------------------------ scopes


class Scopes:
    """Inclusive/exclusive wall time of nested named scopes, on one thread."""

    def __init__(self, record_function: bool = False, per_call: tuple[str, ...] = ()) -> None:
        self.thread: Optional[int] = None
        # scopes whose every call's exclusive time is kept, not only their sum
        self.per_call: dict[str, list[float]] = {name: [] for name in per_call}
        self.enabled = False
        self.incl: dict[str, float] = {}
        self.excl: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.parent: dict[str, str] = {}
        self.stack: list[list] = []  # [name, t0, child_time]
        self.record_function = record_function
        self.sync: Optional[Callable[[], None]] = None

    def reset(self) -> None:
        self.incl.clear()
        self.excl.clear()
        self.calls.clear()
        for times in self.per_call.values():
            times.clear()

    def wrap(self, name: str, fn: Callable) -> Callable:
        scopes = self

        def wrapper(*a, **kw):
            if not scopes.enabled or threading.get_ident() != scopes.thread:
                return fn(*a, **kw)
            if scopes.sync is not None:
                scopes.sync()
            frame = [name, time.perf_counter(), 0.0]
            if scopes.stack:
                scopes.parent.setdefault(name, scopes.stack[-1][0])
            scopes.stack.append(frame)
            ctx = torch.profiler.record_function(name) if scopes.record_function else contextlib.nullcontext()
            try:
                with ctx:
                    return fn(*a, **kw)
            finally:
                if scopes.sync is not None:
                    scopes.sync()
                dt = time.perf_counter() - frame[1]
                scopes.stack.pop()
                scopes.incl[name] = scopes.incl.get(name, 0.0) + dt
                scopes.excl[name] = scopes.excl.get(name, 0.0) + dt - frame[2]
                if name in scopes.per_call:
                    scopes.per_call[name].append(dt - frame[2])
                scopes.calls[name] = scopes.calls.get(name, 0) + 1
                if scopes.stack:
                    scopes.stack[-1][2] += dt

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper


class Patches:
    """Attribute patches, undone in reverse order."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, bool, Any]] = []

    def set(self, obj: Any, attr: str, value: Any) -> None:
        had = attr in getattr(obj, "__dict__", {})
        self._undo.append((obj, attr, had, obj.__dict__.get(attr) if had else None))
        setattr(obj, attr, value)

    def wrap(self, scopes: Scopes, name: str, obj: Any, attr: str) -> None:
        self.set(obj, attr, scopes.wrap(name, getattr(obj, attr)))

    def undo(self) -> None:
        for obj, attr, had, old in reversed(self._undo):
            if had:
                setattr(obj, attr, old)
            else:
                try:
                    delattr(obj, attr)
                except AttributeError:
                    pass
        self._undo.clear()


CATEGORIES = {
    "Mamba": ("mamba",),
    "cross-attention": ("cross-attention",),
    "heads": ("heads",),
    "layernorm": ("layernorm",),
    "model other (embeddings, RoPE, window bias, residuals)": ("model.step",),
    "guidance + sampling": ("sampling", "guidance.set", "guidance.observe"),
    "decode-state bookkeeping (gather, mask, commit, tolist)": ("runner.step", "state.view", "state.window_mask",
                                                                "state.commit", "state.write_back"),
    "text memory (chunk K/V projection, re-rotation, eviction)": ("text.add", "text.place", "text.evict",
                                                                  "engine.fill_memory", "engine.evict_past"),
    "codec": ("codec", "codec.decode_step"),
    "audio encode (PCM packets)": ("audio.encode",),
    "engine Python (sessions, words, timeline, queue, scheduler, loop)": (
        "engine.step", "words.track", "timeline.replace", "engine.emit_audio", "engine.commands", "engine.select",
        "engine.loop-other"),
}


def install(scopes: Scopes, engine, fine: bool) -> Patches:
    from livespeech.models.guidance import GuidanceState, SamplingRows
    from livespeech.server.audio import AudioEncoder
    from livespeech.server.session import EngineSession
    from livespeech.server.timeline import SpeechTimelines

    p = Patches()
    p.wrap(scopes, "engine.step", engine, "_step")
    r = engine.runner
    # a few calls a step even uninstrumented: the engine step less these two is the
    # engine's own work (`engine_own_ms_plain`)
    p.wrap(scopes, "runner.step", r, "step")
    p.wrap(scopes, "codec", r, "decode")
    if not fine:
        return p
    p.wrap(scopes, "engine.commands", engine, "_apply_commands")
    p.wrap(scopes, "engine.select", engine.scheduler, "select")
    p.wrap(scopes, "codec.decode_step", r, "codec_step")  # the frozen graph or `decode_step`
    p.wrap(scopes, "text.add", r, "add_chunk")
    p.wrap(scopes, "text.place", r, "place_chunks")
    p.wrap(scopes, "text.evict", r, "evict_chunks_before")
    p.wrap(scopes, "engine.fill_memory", engine.memory, "fill")
    p.wrap(scopes, "engine.evict_past", engine.memory, "evict_past")
    p.wrap(scopes, "engine.emit_audio", EngineSession, "send_audio")
    p.wrap(scopes, "words.track", EngineSession, "track_words")
    p.wrap(scopes, "timeline.replace", SpeechTimelines, "replace")
    for name in ("view", "window_mask", "commit", "write_back"):
        p.wrap(scopes, f"state.{name}", r.state, name)
    m = r.model
    # the step the runner calls: `model.step`, or the frozen graph, whose layers are one scope
    p.wrap(scopes, "model.step", r, "model_step")
    for layer in m.layers:
        p.wrap(scopes, "mamba", layer.mamba, "step")
        p.wrap(scopes, "cross-attention", layer.xattn, "attend_step")
        p.wrap(scopes, "layernorm", layer.norm1, "forward")
        p.wrap(scopes, "layernorm", layer.norm2, "forward")
    for gn in m.group_norms:
        p.wrap(scopes, "layernorm", gn, "forward")
    p.wrap(scopes, "heads", m, "_fused_heads")  # the step's heads: one matmul per codebook group
    p.wrap(scopes, "sampling", SamplingRows, "sample")
    p.wrap(scopes, "guidance.set", GuidanceState, "guiding_set")
    p.wrap(scopes, "guidance.observe", GuidanceState, "observe")
    p.wrap(scopes, "audio.encode", AudioEncoder, "push")
    return p


# ------------------------------------------------------------------ the workload


TEXT = ("The quick brown fox jumps over the lazy dog, and then it runs back into the forest. "
        "She sells sea shells by the sea shore, while the waves roll in under a grey sky. ")


def _engine_run(bundle, batch: int, steps: int, warmup: int, fine: bool, record_function: bool = False,
                trace_dir: Optional[Path] = None, text_chars: int = 160, timeout_s: float = 600.0,
                paths: Optional[dict] = None, trace_shapes: bool = False) -> dict:
    """Run the engine on `batch` sessions of `text_chars` characters each (all sent at
    once, like an LLM far ahead of the speech; a finished session is replaced at once)
    and time `steps` steps after `warmup`. paths: `EngineConfig` fields picking the
    step's paths (cuda_graphs, frozen_step, native_step, matmul_weights, codec_runtime,
    device_guidance).
    trace_shapes: the trace's op table by input shapes as well (recording them slows the
    ops it times)."""
    from livespeech.server.engine import Engine, EngineConfig
    from livespeech.api.session import SessionConfig

    # the codec on the engine thread, so its share of a step is timed (the server overlaps
    # it with the next steps on a codec thread, where these scopes do not see it)
    engine = Engine(bundle, EngineConfig(max_sessions=batch, max_lead_s=1e6, max_session_s=3600.0,
                                         codec_thread=False, **(paths or {})))
    voice = engine.make_voice("profile", noise_reference(), 24000)
    text_chars = text_chars or 160
    text = (TEXT * (text_chars // len(TEXT) + 1))[:text_chars]
    text = text[: text.rfind(" ")] + "."
    scopes = Scopes(record_function, per_call=("engine.step",))
    if bundle.device.type == "cuda":
        scopes.sync = torch.cuda.synchronize
    frozen, native = engine.runner.frozen, engine.runner.native  # before the wrappers replace its step
    patches = install(scopes, engine, fine)
    n_steps = [0]
    batch_sizes: list[int] = []
    step_starts: list[float] = []
    done = threading.Event()
    inner_step = engine._step  # the wrapped one

    def counting_step(b):
        if scopes.thread is None:
            scopes.thread = threading.get_ident()
        n_steps[0] += 1
        if n_steps[0] == warmup + 1:
            scopes.reset()
            scopes.enabled = True
            if prof is not None:  # torch.profiler records the thread that starts it: the engine's
                prof.__enter__()
        if warmup < n_steps[0] <= warmup + steps:
            step_starts.append(time.perf_counter())
            batch_sizes.append(len(b))
        elif n_steps[0] == warmup + steps + 1:
            step_starts.append(time.perf_counter())  # end of the window
            scopes.enabled = False
            if prof is not None:
                prof.__exit__(None, None, None)
            done.set()
        return inner_step(b)

    prof = None
    if trace_dir is not None:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if bundle.device.type == "cuda":  # the kernels too: how busy the GPU is between launches
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=acts, record_shapes=trace_shapes)
    engine._step = counting_step
    finished = [0]

    def sink(ev):
        from livespeech.api.session import Failed, Finished

        if isinstance(ev, (Finished, Failed)):
            finished[0] += 1

    def open_one(i: int):
        s = engine.open_session(SessionConfig(guidance_lambda=math.inf, seed=i), voice, sink)
        for k in range(0, len(text), 1000):
            s.push_text(text[k : k + 1000])
        s.end_input()

    opened = 0
    try:
        for i in range(batch):
            open_one(i)
            opened += 1
        engine.start()
        deadline = time.monotonic() + timeout_s
        while not done.is_set() and time.monotonic() < deadline:
            if engine.active_sessions < batch:
                open_one(opened)
                opened += 1
            time.sleep(0.005)
    finally:
        engine.stop()
        patches.undo()
    if not done.is_set():
        raise TimeoutError(f"batch {batch}: only {n_steps[0]} steps in {timeout_s:.0f} s")
    window = step_starts[-1] - step_starts[0]
    out = {"steps": steps, "window_s": window, "iteration_ms": 1000 * window / steps,
           "mean_batch": statistics.fmean(batch_sizes), "sessions_opened": opened, "sessions_finished": finished[0],
           "frozen_step": frozen, "native_step": native, "matmul_weights": engine.config.matmul_weights,
           "low_precision_from_batch": engine.runner.low_precision_from_batch,
           "incl": dict(scopes.incl), "excl": dict(scopes.excl), "calls": dict(scopes.calls),
           "parent": dict(scopes.parent), "per_call": {k: list(v) for k, v in scopes.per_call.items()}}
    if prof is not None and trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_dir / f"trace_b{batch}.json"))
        (trace_dir / f"ops_b{batch}.txt").write_text(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
        if trace_shapes:
            (trace_dir / f"ops_b{batch}_shapes.txt").write_text(
                prof.key_averages(group_by_input_shape=True).table(
                    sort_by="self_cpu_time_total", row_limit=80, max_name_column_width=40,
                    max_shapes_column_width=120))
    return out


def scope_table(run: dict) -> tuple[list[dict], dict]:
    steps = run["steps"]
    total = run["window_s"]
    excl = dict(run["excl"])
    top = sum(run["incl"].get(k, 0.0) for k in ("engine.step", "engine.commands", "engine.select"))
    excl["engine.loop-other"] = max(0.0, total - top)
    parent = dict(run["parent"])
    parent["engine.loop-other"] = ""

    order = ["engine.step", "runner.step", "model.step", "mamba", "cross-attention", "layernorm", "heads",
             "sampling", "guidance.set", "state.view", "state.window_mask",
             "state.commit", "state.write_back", "guidance.observe", "words.track", "timeline.replace",
             "engine.evict_past", "engine.fill_memory", "text.add", "text.place", "text.evict", "codec",
             "codec.decode_step", "engine.emit_audio", "audio.encode", "engine.commands", "engine.select",
             "engine.loop-other"]
    rank = {n: i for i, n in enumerate(order)}
    children: dict[str, list[str]] = {}
    for n in excl:
        children.setdefault(parent.get(n) or "", []).append(n)
    rows: list[dict] = []

    def visit(n: str, d: int) -> None:
        rows.append({"name": n, "depth": d, "ms_per_step": 1000 * excl[n] / steps,
                     "incl_ms_per_step": 1000 * (run["incl"].get(n, excl[n])) / steps,
                     "pct": 100 * excl[n] / total if total else 0.0,
                     "calls_per_step": run["calls"].get(n, 0) / steps})
        for c in sorted(children.get(n, []), key=lambda x: (rank.get(x, len(rank)), x)):
            visit(c, d + 1)

    for root in sorted(children.get("", []), key=lambda x: (rank.get(x, len(rank)), x)):
        visit(root, 0)
    cats = {}
    for cat, names in CATEGORIES.items():
        v = sum(excl.get(n, 0.0) for n in names)
        cats[cat] = {"ms_per_step": 1000 * v / steps, "pct": 100 * v / total if total else 0.0}
    return rows, cats


# ------------------------------------------------------------------ cost model


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def analytic_cost(model, cuda: bool = False) -> dict:
    """Per-step weight bytes (read once per batched step) and per-session MACs and state
    bytes, from the parameter shapes. `cuda`: what a bf16 step runs in bfloat16 is a
    GPU's (the cross-attention's projections too, and the memory K/V in bfloat16)."""
    cfg = model.cfg
    d = cfg.d_model
    L = model.n_layers
    H = cfg.n_heads
    hd = d // H
    M = cfg.n_enroll + cfg.max_text_tokens
    mb = model.layers[0].mamba
    di, n, r, kc = mb.d_inner, mb.d_state, mb.dt_rank, mb.d_conv
    macs_in_out = d * 2 * di + di * d  # the in and out projections (bf16 or int8 in such a step)
    macs_mamba = macs_in_out + di * (r + 2 * n) + r * di + di * kc + 3 * di * n
    macs_xattn = 2 * d * d + H * M * (2 * hd) + H * M * hd
    macs_heads = sum(model.vocab_sizes) * d
    macs = L * (macs_mamba + macs_xattn) + macs_heads
    skip = ("speech_encoder.", "text_emb.", "code_emb.")
    weights = 0
    for name, p in model.named_parameters():
        if name.startswith(skip) or ".xattn.kv_proj." in name:
            continue  # not read by a decode step (enrollment / text projection happen once)
        weights += _bytes(p)
    # what a step with bfloat16 or int8 matmul weights (from LOW_PRECISION_FROM_BATCH
    # sessions on the CPU) reads in that precision: the heads and each Mamba block's in/out
    # projections (LiveSpeech2.step's matmul_dtype), on a GPU (the memory in bfloat16) the
    # cross-attention's q and out too
    low_names = (".mamba.in_proj.weight", ".mamba.out_proj.weight")
    low_names += (".xattn.q_proj.weight", ".xattn.out_proj.weight") if cuda else ()
    low_weights = sum(_bytes(p) for name, p in model.named_parameters()
                      if name.startswith("heads.") or name.endswith(low_names))
    macs_low = L * (macs_in_out + (2 * d * d if cuda else 0)) + macs_heads
    es = 4
    state_rw = 2 * L * di * (kc + n) * es  # conv + SSM state, read and written
    mem_read = L * H * M * 3 * hd * es  # cached K (2*hd wide) and V
    emb_rows = cfg.n_codebooks * d * es
    return {"macs_per_session": macs, "macs_mamba_per_layer": macs_mamba, "macs_xattn_per_layer": macs_xattn,
            "macs_heads": macs_heads, "weight_bytes": weights,
            "macs_low_precision_per_session": macs_low, "low_precision_weight_bytes_fp32": low_weights,
            "state_bytes_per_session": state_rw + mem_read + emb_rows,
            # a GPU's bf16 step keeps the memory K/V in bfloat16: half of mem_read saved
            "bf16_memory_saving_per_session": mem_read / 2 if cuda else 0,
            "dims": {"d_model": d, "layers": L, "heads": H, "d_inner": di, "d_state": n, "dt_rank": r, "memory": M,
                     "vocab_sizes": list(model.vocab_sizes)}}


# bytes a weight of the step's widest matmuls by `matmul_weights`
WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}


def model_step_cost(cost: dict, batch: int, weights: str = "float32") -> dict:
    """FLOPs (and how many of them in a lower precision, `low_flops`) and bytes of one
    model step of `batch` sessions, from `analytic_cost`'s `cost`; `weights`: the
    precision the step's widest matmuls run in (float32, bfloat16, int8)."""
    low = weights != "float32"
    saving = cost["bf16_memory_saving_per_session"] if weights == "bfloat16" else 0
    w = cost["weight_bytes"] - cost["low_precision_weight_bytes_fp32"] * (1 - WEIGHT_BYTES[weights] / 4)
    return {"flops": 2 * cost["macs_per_session"] * batch,
            "low_flops": 2 * cost["macs_low_precision_per_session"] * batch if low else 0.0,
            "weight_bytes": w, "bytes": w + (cost["state_bytes_per_session"] - saving) * batch}


def codec_cost(codec) -> dict:
    dec = sum(_bytes(p) for name, p in codec.named_parameters() if name.startswith("decoder."))
    return {"weight_bytes": dec}


def _scratch_runner(bundle, batch: int):
    from livespeech.models.guidance import SamplingSettings
    from livespeech.server.runner import ModelRunner

    runner = ModelRunner(bundle, batch)
    voice = runner.make_voice("v", noise_reference(), 24000)
    slots = list(range(batch))
    for s in slots:
        runner.admit(s, voice, seed=s, sampling=SamplingSettings(math.inf, 20))
        runner.add_chunk(s, list(range(100, 112)), 0, 0)
    return runner, slots


def lstm_flops(input_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of `aten.lstm` (its arguments' shapes), which FlopCounterMode counts as none:
    the torch codec's LSTM runs as that op for packets of over four frames, and the
    native codec does the same products. Each weight matrix multiplies every (time,
    batch) row once, whatever the layer, direction or projection; the weights are the
    one list of 1-D and 2-D shapes (the states' are 3-D)."""
    params = next(a for a in args if isinstance(a, list) and a and all(len(p) in (1, 2) for p in a))
    rows = math.prod(input_shape[:-1])
    return 2 * rows * sum(p[0] * p[1] for p in params if len(p) == 2)


# FlopCounterMode looks an op's overload up before it runs it (one it lacks is decomposed,
# aten.lstm into oneDNN's per-layer op, which it lacks too) and counts by the packet
LSTM_FLOPS = {op: lstm_flops for op in (torch.ops.aten.lstm, torch.ops.aten.lstm.input, torch.ops.aten.lstm.data)}


def counted_cost(bundle, batch: int, packet_frames: int) -> dict:
    """FlopCounterMode FLOPs of one model.step and one packet's codec decode, and the aten
    op count of one full runner.step (model + sampling + commit)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from livespeech.models import graphemes
    from livespeech.models.guidance import GuidanceState

    runner, slots = _scratch_runner(bundle, batch)
    st = runner.state
    guides = [GuidanceState() for _ in slots]
    for g in guides:
        g.extend_transcript(graphemes.text_to_ids("hello world this is a test"))
    out: dict[str, Any] = {}
    with torch.inference_mode():
        view = st.view(slots)
        mask = st.window_mask(view, [0] * batch, [0] * batch)
        fc = FlopCounterMode(display=False)
        with fc:
            bundle.model.step(view.inputs, view.step, view, mask)
        out["model_step_flops"] = fc.get_total_flops()

        class Count(TorchDispatchMode):
            n = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                Count.n += 1
                return func(*args, **(kwargs or {}))

        with Count():
            runner.step(slots, [(0, 0)] * batch, guides, [False] * batch)
        out["aten_ops_runner_step"] = Count.n
        Count.n = 0
        with Count():
            bundle.model.step(view.inputs, view.step, view, mask)
        out["aten_ops_model_step"] = Count.n
        # the codec's FLOPs do not depend on the device: counted on a CPU copy (on CUDA the
        # counter's dispatch mode broke the streaming state's update, seen on an H100)
        n_frames = max(packet_frames, runner.min_first_frames)
        codec = copy.deepcopy(bundle.codec).cpu()
        codes = torch.ones(batch, bundle.model.cfg.n_acoustic_codebooks, n_frames, dtype=torch.long)
        fc = FlopCounterMode(display=False, custom_mapping=LSTM_FLOPS)
        with fc:
            codec.decode_step(codes, codec.streaming_state(batch))
        out["codec_packet_flops"] = fc.get_total_flops()
        out["codec_packet_frames"] = n_frames
    return out


# ------------------------------------------------------------------ machine limits


def _best_mm_gflops(n: int, dtype: torch.dtype, device: torch.device, reps: int, sync) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    torch.mm(a, b, out=c)
    best = math.inf
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        torch.mm(a, b, out=c)
        sync()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def _best_int8_gops(n: int, reps: int) -> float:
    """fbgemm's dynamically quantised linear (models/derived.py), n x n by n x n, in GOP/s."""
    from livespeech.models.derived import matmul_t, packed_int8

    x, w = torch.randn(n, n), packed_int8(torch.randn(n, n))
    matmul_t(x, w)
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        matmul_t(x, w)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def measure_machine(device: torch.device, sgemm_n: int = 1024, copy_mib: int = 256, reps: int = 5,
                    weights: str = "float32") -> dict:
    """sgemm GFLOP/s, memcpy GB/s and, for `weights` bfloat16, bf16 gemm GFLOP/s, for int8
    the int8 linear's GOP/s."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gflops = _best_mm_gflops(sgemm_n, torch.float32, device, reps, sync)
    bf16_gflops = _best_mm_gflops(sgemm_n, torch.bfloat16, device, reps, sync) if weights == "bfloat16" else None
    int8_gops = _best_int8_gops(sgemm_n, reps) if weights == "int8" else None
    n = copy_mib * (1 << 20) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best_c = math.inf
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        best_c = min(best_c, time.perf_counter() - t)
    gbs = 2 * n * 4 / best_c / 1e9  # read + write
    del src, dst
    return {"sgemm_n": sgemm_n, "sgemm_gflops": gflops, "bf16_gemm_gflops": bf16_gflops, "int8_gemm_gops": int8_gops,
            "memcpy_mib": copy_mib, "memcpy_gbs": gbs,
            "note": "best of %d; memcpy counts bytes read + written" % reps}


def roofline(flops: float, nbytes: float, t_s: float, machine: dict, low_flops: float = 0.0) -> dict:
    """`low_flops` of `flops` run in bfloat16 or int8, at the machine's bf16 gemm or int8
    linear throughput (the one `measure_machine` measured)."""
    t_f = (flops - low_flops) / (machine["sgemm_gflops"] * 1e9)
    if low_flops:
        rate = machine.get("bf16_gemm_gflops") or machine["int8_gemm_gops"]
        t_f += low_flops / (rate * 1e9)
    t_b = nbytes / (machine["memcpy_gbs"] * 1e9)
    return {"gflop": flops / 1e9, "mbytes": nbytes / 1e6, "t_flops_ms": 1000 * t_f, "t_bytes_ms": 1000 * t_b,
            "measured_ms": 1000 * t_s, "roofline_fraction": max(t_f, t_b) / t_s if t_s > 0 else None,
            "achieved_gflops": flops / t_s / 1e9 if t_s > 0 else None,
            "achieved_gbs": nbytes / t_s / 1e9 if t_s > 0 else None}


# ------------------------------------------------------------------ main


def profile(bundle, batches: list[int], steps: int, warmup: int, threads: int, trace_dir: Optional[Path] = None,
            plain: bool = True, packet_ms: int = 80, text_chars: int = 160, paths: Optional[dict] = None,
            trace_shapes: bool = False) -> dict:
    """`_engine_run` at each batch size, and the step against the machine's limits.
    paths: as `_engine_run`'s."""
    from livespeech.models.config import FRAME_RATE

    paths = dict(paths or {})
    weights = paths.setdefault("matmul_weights", "float32")
    machine = measure_machine(bundle.device, weights=weights)
    cost = analytic_cost(bundle.model, cuda=bundle.device.type == "cuda")
    ccost = codec_cost(bundle.codec)
    pf = max(1, math.ceil(packet_ms * FRAME_RATE / 1000))
    out: dict[str, Any] = {"model": bundle.source, "device": str(bundle.device), "threads": threads,
                           "torch": torch.__version__, "machine": machine, "analytic": cost,
                           "codec": ccost, "packet_frames": pf, "text_chars": text_chars, "steps": steps,
                           **{k: paths.get(k, False) for k in ("cuda_graphs", "device_guidance")},
                           "codec_runtime": paths.get("codec_runtime", "torch"),
                           "warmup": warmup, "batches": []}
    for b in batches:
        la = list(os.getloadavg())
        run = _engine_run(bundle, b, steps, warmup, fine=True, record_function=trace_dir is not None,
                          trace_dir=trace_dir, text_chars=text_chars, paths=paths, trace_shapes=trace_shapes)
        rows, cats = scope_table(run)
        # what the runner made of the request
        out["frozen_step"], out["matmul_weights"] = run["frozen_step"], run["matmul_weights"]
        out["native_step"] = run["native_step"]
        out["low_precision_from_batch"] = run["low_precision_from_batch"]
        plain_ms = own_ms = own_median_ms = None
        if plain:
            pr = _engine_run(bundle, b, steps, warmup, fine=False, text_chars=text_chars, paths=paths)
            plain_ms = pr["iteration_ms"]
            # the host's per-session bookkeeping, audio delivery included
            own_ms = plain_ms - 1000 * (pr["incl"].get("runner.step", 0.0) + pr["incl"].get("codec", 0.0)) / steps
            # each step's own (the step less the runner's step and the codec's calls, which
            # are the only scopes inside it in this run)
            own_median_ms = 1000 * statistics.median(pr["per_call"]["engine.step"])
        counted = counted_cost(bundle, b, pf)
        step_s = run["window_s"] / steps
        model_s = run["incl"].get("model.step", 0.0) / steps
        m = model_step_cost(cost, b, weights if b >= run["low_precision_from_batch"] else "float32")
        model_flops, model_bytes, low_flops, weight_bytes = m["flops"], m["bytes"], m["low_flops"], m["weight_bytes"]
        codec_flops = counted["codec_packet_flops"] / counted["codec_packet_frames"]  # per frame, all b sessions
        step_flops = model_flops + codec_flops
        step_bytes = model_bytes + ccost["weight_bytes"] / pf
        c = roofline(step_flops, step_bytes, step_s, machine, low_flops)
        c.update(gflop_counted=(counted["model_step_flops"] + codec_flops) / 1e9, low_gflop=low_flops / 1e9,
                 weight_mbytes=(weight_bytes + ccost["weight_bytes"] / pf) / 1e6,
                 state_mbytes_per_session=cost["state_bytes_per_session"] / 1e6,
                 model_only=roofline(model_flops, model_bytes, model_s, machine, low_flops))
        # the same bound against the uninstrumented step: the fine wrappers' Python is not
        # the step's cost (0.1-1.2 ms a step at batch 16 on the 2-core VMs)
        c["roofline_fraction_plain"] = (max(c["t_flops_ms"], c["t_bytes_ms"]) / plain_ms if plain_ms else None)
        ops = counted["aten_ops_runner_step"]
        runner_s = run["incl"].get("runner.step", 0.0) / steps
        out["batches"].append({
            "batch": b, "loadavg": la, "step_ms": 1000 * step_s, "step_ms_plain": plain_ms,
            "engine_own_ms_plain": own_ms, "engine_own_ms_median": own_median_ms,
            "mean_batch": run["mean_batch"], "model_step_ms": 1000 * model_s,
            "runner_step_ms": 1000 * runner_s,
            "aten_ops_per_step": ops, "aten_ops_model_step": counted["aten_ops_model_step"],
            "us_per_aten_op": 1e6 * runner_s / ops if ops else None,
            "cost": c, "counted": counted, "scopes": rows, "categories": cats,
            "sessions_opened": run["sessions_opened"],
        })
    return out


def noise_reference(seed: int = 0) -> np.ndarray:
    """One second of white noise at 24 kHz (float32, RMS 0.1): the reference voice of the
    tools that need one but no recording (throughput does not depend on the voice)."""
    return (np.random.default_rng(seed).standard_normal(24000) * 0.1).astype(np.float32)


def add_path_arguments(ap: argparse.ArgumentParser) -> None:
    """`--matmul-weights` and `--codec-runtime`, as the server's settings (server/runner.py;
    default auto, as there)."""
    ap.add_argument("--matmul-weights", choices=MATMUL_WEIGHTS, default="auto",
                    help="the weights of the step's widest matmuls, as the server's setting (auto: int8 on an x86 "
                         "CPU with AVX2, else bfloat16 where the CPU has bf16 dot products or the GPU bfloat16, else "
                         "float32)")
    ap.add_argument("--codec-runtime", choices=CODEC_RUNTIMES, default="auto",
                    help="what runs the streaming codec on the CPU, as the server's setting "
                         "(auto: native)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m livespeech.loadtest.profile_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="random:tiny", help="model directory or random:<preset>[/<codec>]")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0: the server's own choice on this machine, server.app.torch_threads: "
                         "on 2 CPUs one, which ran the batch-16 step 1.7x faster than torch's default two)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--text-chars", type=int, default=160,
                    help="text per session (sent at once); a finished session is replaced (default: ~2 sentences)")
    ap.add_argument("--no-plain", action="store_true", help="skip the uninstrumented comparison run")
    ap.add_argument("--trace", default=None, help="directory for torch.profiler chrome traces and op tables")
    ap.add_argument("--trace-shapes", action="store_true",
                    help="with --trace, an op table by input shapes as well (ops_b<N>_shapes.txt); recording "
                         "the shapes slows the traced ops")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="the model step replayed from a CUDA graph (its time then shows in runner.step)")
    ap.add_argument("--eager-step", action="store_true",
                    help="the eager model step on the CPU, whose layers are timed one by one (default: the step "
                         "the server runs, native or a frozen graph, timed as one scope)")
    ap.add_argument("--no-native-step", action="store_true",
                    help="the frozen TorchScript graph rather than the native step (models/native_step.py)")
    ap.add_argument("--device-guidance", action="store_true",
                    help="every session's guidance as tensors on the device (the server's --device-guidance)")
    add_path_arguments(ap)
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None, help="write the tables as markdown here")
    args = ap.parse_args(argv)
    if args.trace_shapes and not args.trace:
        ap.error("--trace-shapes needs --trace")
    if args.cuda_graphs and not args.device.startswith("cuda"):
        ap.error("--cuda-graphs needs a cuda device")
    from livespeech.models.loading import load_bundle
    from livespeech.server.app import available_cpus, torch_threads
    from livespeech.server.config import ServerConfig

    torch.set_num_threads(args.threads or torch_threads(ServerConfig(device=args.device), available_cpus()))

    bundle = load_bundle(None if args.model_path in ("", "default") else args.model_path, device=args.device)
    res = profile(bundle, args.batch, args.steps, args.warmup, torch.get_num_threads(),
                  Path(args.trace) if args.trace else None, plain=not args.no_plain, text_chars=args.text_chars,
                  paths=dict(cuda_graphs=args.cuda_graphs, frozen_step=not args.eager_step,
                             native_step=not args.no_native_step,
                             matmul_weights=matmul_weights(args.matmul_weights, args.device),
                             codec_runtime=codec_runtime(args.codec_runtime, args.device),
                             device_guidance=args.device_guidance),
                  trace_shapes=args.trace_shapes)
    res["loadavg"] = list(os.getloadavg())
    from .report import render_profile_markdown

    md = render_profile_markdown(res)
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
