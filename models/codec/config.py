"""Codec configuration: one validated frozen object, two presets.

`encodec_24khz` is the official EnCodec 24 kHz model (its checkpoint loads unchanged);
`small` is our CPU training default. See `PRESETS` for why `small` differs.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

NORMS = ("weight_norm", "none")
PAD_MODES = ("reflect", "constant")


@dataclass(frozen=True)
class CodecConfig:
    sample_rate: int = 24_000
    channels: int = 1
    # SEANet
    n_filters: int = 32
    ratios: tuple[int, ...] = (8, 5, 4, 2)  # decoder (upsampling) order; encoder reverses
    dimension: int = 128
    n_residual_layers: int = 1
    kernel_size: int = 7
    last_kernel_size: int = 7
    residual_kernel_size: int = 3
    dilation_base: int = 2
    lstm_layers: int = 2
    compress: int = 2
    true_skip: bool = False  # False: the residual shortcut is a 1x1 conv (official)
    causal: bool = True
    norm: str = "weight_norm"
    pad_mode: str = "reflect"
    # residual vector quantizer
    codebook_size: int = 1024
    n_codebooks: int = 32  # quantizer layers stored in the state dict
    n_q: int = 32  # codebooks used by encode (<= n_codebooks); 8 = 6 kbps at 24 kHz
    ema_decay: float = 0.99
    kmeans_init: bool = True
    kmeans_iters: int = 50
    threshold_ema_dead_code: int = 2
    commitment_weight: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratios", tuple(int(r) for r in self.ratios))
        self.validate()

    @property
    def hop_length(self) -> int:
        """Audio samples per code frame (320 for ratios 8*5*4*2)."""
        return math.prod(self.ratios)

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.hop_length

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"invalid CodecConfig: {msg}")

        need(self.sample_rate > 0, "sample_rate must be positive")
        need(self.channels == 1, "only mono (channels=1) is supported")
        need(self.n_filters > 0 and self.dimension > 0, "n_filters and dimension must be positive")
        need(len(self.ratios) >= 1 and all(r >= 1 for r in self.ratios), "ratios must be >= 1")
        need(self.n_residual_layers >= 0 and self.lstm_layers >= 0, "layer counts must be >= 0")
        need(min(self.kernel_size, self.last_kernel_size, self.residual_kernel_size) >= 1, "kernel sizes")
        need(self.dilation_base >= 1, "dilation_base must be >= 1")
        need(self.compress >= 1 and self.n_filters % self.compress == 0,
             "compress must divide n_filters (residual branches use n_filters // compress)")
        need(self.norm in NORMS, f"norm must be one of {NORMS}")
        need(self.pad_mode in PAD_MODES, f"pad_mode must be one of {PAD_MODES}")
        need(self.codebook_size >= 2 and (self.codebook_size & (self.codebook_size - 1)) == 0,
             "codebook_size must be a power of 2")
        need(1 <= self.n_q <= self.n_codebooks, "need 1 <= n_q <= n_codebooks")
        need(0.0 <= self.ema_decay < 1.0, "ema_decay must be in [0, 1)")
        need(self.kmeans_iters >= 0 and self.threshold_ema_dead_code >= 0, "kmeans/dead-code settings")
        need(self.commitment_weight >= 0.0, "commitment_weight must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CodecConfig":
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown CodecConfig fields: {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def encodec_24khz(cls, **overrides: Any) -> "CodecConfig":
        return preset("encodec_24khz", **overrides)

    @classmethod
    def small(cls, **overrides: Any) -> "CodecConfig":
        return preset("small", **overrides)


PRESETS: dict[str, CodecConfig] = {
    # The official causal 24 kHz EnCodec: 32 x 1024 codebooks (24 kbps), 75 frames/s.
    "encodec_24khz": CodecConfig(),
    # CPU training default. Same layout and frame rate as the official model at half the
    # width (n_filters 16: ~0.8 s/step vs 2.0 s/step on 2 threads) and 8 codebooks
    # (6 kbps). Constant (zero) padding makes every conv strictly causal: the streaming
    # decoder then needs no 7-frame first packet (reflect padding reads 6 frames ahead at
    # the start of a stream), and sessions can join a batch with any packet size.
    "small": CodecConfig(n_filters=16, n_codebooks=8, n_q=8, pad_mode="constant"),
    # the server's host work around a codec call without its tensor work (benchmarks)
    "micro": CodecConfig(n_filters=2, dimension=16, lstm_layers=0, n_residual_layers=0, n_codebooks=8, n_q=8,
                         pad_mode="constant"),
}


def preset(name: str, **overrides: Any) -> CodecConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown codec preset {name!r}; choose from {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides) if overrides else PRESETS[name]
