"""The CPU decode step as one native call (models/native/step.cpp), called like
`LiveSpeech2.step`.

The frozen TorchScript step (models/step_graph.py `FrozenStep`) runs ~600 ops a step at
batch 16, most of them small elementwise ops whose dispatch, temporaries and passes over
memory cost as much as the matmuls between them (docs/loadtest.md). The native step
keeps the matmuls in the libraries (MKL, fbgemm's int8) and fuses everything between
them into loops over a session's rows; its attention reads only the memory slots a
session's window shows, and one copy of a voice's enrollment for the sessions sharing it.

It is a C++ extension, with the streaming codec's decoder step beside it
(models/native/codec.cpp, `step_graph.NativeCodecStep`), built once by torch's loader
with the machine's compiler (~1 min), then kept: by an install, beside this module
(`python -m livespeech.models.native_step`: scripts/install.sh, the container image's
build stage), else at first use in the user's cache (~/.cache/livespeech/native), one
build a source, torch and Python version. Its
loops carry code for AVX-512, AVX2 and baseline x86-64 and pick at load time, so a
build made where a compiler is runs where none is. Where there is neither a build nor a
compiler, the caller keeps the frozen graph (and the codec ONNX Runtime).

Like `FrozenStep`, its weights are taken once: a model that changes needs a new one.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Optional

import torch

from livespeech.api.cache import user_cache

from .derived import INT8_REDUCE_RANGE
from .livespeech import LiveSpeech2, StepLogits

if TYPE_CHECKING:  # the decode state's module calls the extension too
    from .inference import DecodeStateView

log = logging.getLogger(__name__)

NATIVE = Path(__file__).with_name("native")
# one extension: the model step, the codec decoder's step (models/native/codec.cpp,
# models/step_graph.py `NativeCodecStep`), the sampler (models/native/sampler.cpp,
# models/cpu_sampler.py) and the loops they share (kernels.h)
SOURCES = [NATIVE / "step.cpp", NATIVE / "codec.cpp", NATIVE / "sampler.cpp"]
HEADERS = [NATIVE / "kernels.h"]
# -fno-trapping-math: the loops' clamps and selects vectorise for AVX2 and SSE too (with
# trapping maths GCC kept them as branches there: the state update 3.7x slower on AVX2);
# NaN and infinity still propagate (no -ffinite-math-only)
CFLAGS = ["-O3", "-fopenmp-simd", "-fno-trapping-math"]
# where an install keeps its build, and where a first use builds one
INSTALLED_BUILDS = NATIVE / "build"


def cache_builds() -> Path:
    return user_cache("native")


def build_name() -> str:
    """The build's name: a digest of what it is made from and what it runs against."""
    key = b"\0".join([*(f.read_bytes() for f in SOURCES + HEADERS), " ".join(CFLAGS).encode(),
                      torch.__version__.encode(), sys.version.encode(), platform.machine().encode()])
    return f"livespeech_native_step_{hashlib.sha256(key).hexdigest()[:12]}"


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(into: Optional[Path] = None) -> ModuleType:
    """The extension: a kept build (the install's, else the cache's; with `into`, the one
    there), else built now into `into` (default: the cache) by torch's loader, which needs
    a C++ compiler and ninja. Raises where neither is possible."""
    name = build_name()
    for root in (into,) if into else (INSTALLED_BUILDS, cache_builds()):
        library = root / name / f"{name}.so"
        if library.exists():
            return _import(name, library)
    from torch.utils import cpp_extension

    root = into or cache_builds()
    for old in root.glob("livespeech_native_step_*"):  # builds of other sources or versions
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    where = root / name
    where.mkdir(parents=True, exist_ok=True)
    log.info("building the native CPU step and codec (once per source and torch) in %s", where)
    # ninja from the environment's own bin (the `ninja` package), on PATH or not
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
    try:
        return cpp_extension.load(name=name, sources=[str(f) for f in SOURCES], extra_cflags=CFLAGS,
                                  build_directory=str(where))
    finally:
        os.environ["PATH"] = path


@functools.cache
def native_module() -> Optional[ModuleType]:
    """The extension (`build`), or None where it cannot be had here; the reason is logged
    once."""
    try:
        return build()
    except Exception as e:  # noqa: BLE001 - no build and no compiler: the frozen step runs instead
        log.warning("the native CPU step is unavailable (%s: %s)", type(e).__name__,
                    str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None


def _detached(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().float().contiguous()


class NativeStep:
    """`LiveSpeech2.step` on the CPU as one native call, for a float32 decode state.
    `matmul_dtype` (int8 or bfloat16 weights for the widest matmuls, as
    `LiveSpeech2.step`) builds a second weight set, which a call with it runs."""

    def __init__(self, model: LiveSpeech2, matmul_dtype: Optional[torch.dtype] = None):
        module = native_module()
        if module is None:
            raise RuntimeError("the native CPU step could not be built here")
        if next(model.parameters()).device.type != "cpu":
            raise ValueError("the native step runs on the CPU")
        with torch.no_grad():
            self.steps = {dtype: self._build(module, model, dtype) for dtype in dict.fromkeys((None, matmul_dtype))}

    @staticmethod
    def _build(module, model: LiveSpeech2, dtype: Optional[torch.dtype]):
        cfg = model.cfg

        def linear(w, bias=None):
            packed = w if isinstance(w, torch.ScriptObject) else None
            return module.linear(None if packed is not None else w.detach().contiguous(), _detached(bias), packed,
                                 INT8_REDUCE_RANGE)

        def norm(n: torch.nn.LayerNorm):
            return module.norm(_detached(n.weight), _detached(n.bias), n.eps)

        table, offsets = model.step_embedding()
        phones = _detached(model.phone_emb.weight) if model.phone_emb is not None else None
        groups = [list(model.group_layer_ids(g)) for g in range(len(cfg.codebook_groups))]
        mamba0 = model.layers[0].mamba
        step = module.NativeStep(cfg.d_model, cfg.n_heads, cfg.d_state, cfg.d_conv, mamba0.dt_rank, cfg.n_enroll,
                                 float(cfg.rope_base), table.float(), offsets, phones, groups, list(model.vocab_sizes))
        for layer in model.layers:
            a2, conv_w, _, conv_b, w_in, b_in, w_x, w_dt, b_dt, d_skip, w_out, b_out = layer.mamba.step_tensors(dtype)
            w_q, w_o = layer.xattn.step_weights(layer.attention_matmul_dtype(dtype))
            step.add_layer(module.layer(norm(layer.norm1), norm(layer.norm2), linear(w_in, b_in), linear(w_out, b_out),
                                        _detached(conv_w), _detached(conv_b), _detached(w_x), _detached(w_dt),
                                        _detached(b_dt), _detached(a2), _detached(d_skip), linear(w_q),
                                        linear(w_o)))
        for g in range(len(cfg.codebook_groups)):
            step.add_group(norm(model.group_norms[g]), linear(model.group_head_weights(g, dtype)))
        return step

    def __call__(self, inputs: torch.Tensor, frame: torch.Tensor, state: DecodeStateView,
                 text_mask: torch.Tensor, matmul_dtype: Optional[torch.dtype] = None,
                 phones: Optional[torch.Tensor] = None, voices: Optional[torch.Tensor] = None) -> StepLogits:
        """`voices` [B] int64: rows with equal values hold the same enrollment memory (one
        voice), which the step then reads once; None: every row its own."""
        g, a = self.steps[matmul_dtype].step(inputs, frame, state.conv, state.ssm, state.mem_k, state.mem_v,
                                             text_mask, phones, voices)
        return StepLogits(graphemes=g, acoustic=a)


if __name__ == "__main__":  # build it ahead (the container image's build stage, an install)
    logging.basicConfig(level=logging.INFO)
    module = build(into=INSTALLED_BUILDS)
    print(f"native CPU step: {module.__file__}")
