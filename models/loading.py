"""Everything needed to synthesise, loaded together: decoder, codec, tokenizer, voices.

A model directory holds `decoder.pt` ({'config', 'state_dict'}), `codec.pt` (our codec
format, or an official EnCodec state dict named `encodec_24khz*.th`), optional
`voices/*.wav` (built-in reference voices) and optional `front_end.pt` (the letter
schedule, models/front_end.py). The embedded default model lives in
`models/weights/default/`.
"""
from __future__ import annotations

import os
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .codec import CodecModel
from .codec import preset as codec_preset
from .config import SAMPLE_RATE, ModelConfig, preset
from .front_end import FrontEnd, load_front_end
from .livespeech import LiveSpeech2
from .resample import resample
from .tokenizer import TextTokenizer, get_tokenizer

DEFAULT_MODEL_DIR = Path(__file__).parent / "weights" / "default"


def read_wav(path: os.PathLike | str) -> tuple[np.ndarray, int]:
    """Mono float32 samples and the sample rate of a 16-bit PCM WAV file."""
    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2:
            raise ValueError(f"{path}: only 16-bit PCM WAV is supported")
        data = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
        if w.getnchannels() > 1:
            data = data.reshape(-1, w.getnchannels()).mean(axis=1)
        return data, w.getframerate()


def write_wav(path: os.PathLike | str, audio: np.ndarray, sample_rate: int) -> None:
    pcm = (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())


@dataclass
class ModelBundle:
    model: LiveSpeech2
    codec: CodecModel
    tokenizer: TextTokenizer
    device: torch.device
    builtin_voices: dict[str, np.ndarray] = field(default_factory=dict)  # 24 kHz reference audio
    source: str = ""
    front_end: Optional[FrontEnd] = None  # the letter schedule's networks (models/front_end.py)

    @torch.no_grad()
    def encode_audio(self, audio: np.ndarray, sample_rate: int) -> torch.Tensor:
        """Reference audio -> acoustic codes [Q, T] (the codebooks the decoder models)."""
        x = torch.from_numpy(resample(np.asarray(audio, dtype=np.float32), sample_rate, SAMPLE_RATE))
        x = x.to(self.device).view(1, 1, -1)
        return self.codec.encode(x, n_q=self.model.cfg.n_acoustic_codebooks)[0]


def load_decoder(path: os.PathLike | str, device="cpu") -> LiveSpeech2:
    return decoder_from_weights(torch.load(path, map_location=device, weights_only=True), device)


def decoder_from_weights(obj: dict, device="cpu") -> LiveSpeech2:
    """A decoder from a {"config", "state_dict"} dict (what save_decoder writes)."""
    model = LiveSpeech2(ModelConfig.from_dict(obj["config"]), device=device)
    model.load_state_dict({k: v.float() for k, v in obj["state_dict"].items()})
    return model.to(device).eval()


def save_decoder(model: LiveSpeech2, path: os.PathLike | str, half: bool = False, meta: Optional[dict] = None) -> None:
    sd = {k: (v.half() if half and v.is_floating_point() else v) for k, v in model.state_dict().items()}
    torch.save({"config": model.cfg.to_dict(), "state_dict": sd, "meta": meta or {}}, path)


def load_codec(path: os.PathLike | str, n_q: int, device="cpu") -> CodecModel:
    name = Path(path).name
    config = codec_preset("encodec_24khz", n_q=n_q) if name.startswith("encodec_24khz") else None
    return CodecModel.from_checkpoint(path, config=config, map_location=device).to(device).eval()


def load_bundle(
    path: Optional[os.PathLike | str] = None,
    device: str = "cpu",
    random_init: bool = False,
    model_preset: str = "tiny",
    codec_preset_name: str = "small",
    seed: int = 0,
) -> ModelBundle:
    """Load a model directory (None: the embedded default). `random_init`, or a path of
    the form `random:<model preset>[/<codec preset>]`, builds an untrained model instead
    (wiring tests, throughput benchmarks)."""
    dev = torch.device(device)
    tok = get_tokenizer()
    if path is not None and str(path).startswith("random:"):
        random_init = True
        spec = str(path)[len("random:"):].split("/")
        model_preset = spec[0] or model_preset
        codec_preset_name = spec[1] if len(spec) > 1 else codec_preset_name
    if random_init:
        torch.manual_seed(seed)
        n_q, have = preset(model_preset).n_acoustic_codebooks, codec_preset(codec_preset_name).n_codebooks
        if have < n_q:
            raise ValueError(f"model preset {model_preset!r} speaks {n_q} codebooks; codec preset "
                             f"{codec_preset_name!r} has {have}: name a larger one, e.g. "
                             f"random:{model_preset}/encodec_24khz")
        model = LiveSpeech2(preset(model_preset), device=dev).to(dev).eval()
        codec = CodecModel(codec_preset(codec_preset_name, n_q=model.cfg.n_acoustic_codebooks)).to(dev).eval()
        _init_codebooks(codec)
        return ModelBundle(model, codec, tok, dev, source=f"random:{model_preset}/{codec_preset_name}")
    root = Path(path) if path is not None else DEFAULT_MODEL_DIR
    decoder_path = root / "decoder.pt"
    if not decoder_path.exists():
        raise FileNotFoundError(
            f"no decoder checkpoint at {decoder_path}: train one (docs/training.md) or pass a model directory")
    model = load_decoder(decoder_path, dev)
    codec_files = sorted(root.glob("codec.pt")) or sorted(root.glob("encodec_24khz*.th"))
    if not codec_files:
        raise FileNotFoundError(f"no codec checkpoint (codec.pt or encodec_24khz*.th) in {root}")
    codec = load_codec(codec_files[0], model.cfg.n_acoustic_codebooks, dev)
    voices = {}
    for wav_path in sorted((root / "voices").glob("*.wav")):
        audio, sr = read_wav(wav_path)
        voices[wav_path.stem] = resample(audio, sr, SAMPLE_RATE)
    return ModelBundle(model, codec, tok, dev, voices, source=str(root), front_end=load_front_end(root))


def _init_codebooks(codec: CodecModel) -> None:
    """Random codebooks for an untrained codec (its RVQ starts at zero until k-means)."""
    g = torch.Generator().manual_seed(0)
    for layer in codec.quantizer.vq.layers:
        cb = layer._codebook
        cb.embed.copy_(torch.randn(cb.embed.shape, generator=g) * 0.1)
        cb.inited.fill_(1)
