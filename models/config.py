"""Model configuration: one validated object, two presets.

`paper` is the LiveSpeech 2 model of Sec. 5.2; `tiny` is the CPU default, sized from
measured decode-step times (docs/model.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from . import graphemes

FRAME_RATE = 75  # EnCodec 24 kHz frames per second
SAMPLE_RATE = 24_000
WHISPER_VOCAB = 51_866  # Whisper large-v3 BPE
TEXT_EOS = WHISPER_VOCAB  # end-of-stream token appended after Whisper's ids


@dataclass(frozen=True)
class ModelConfig:
    # decoder
    d_model: int = 256
    n_shared_layers: int = 3
    n_group_layers: int = 1
    # codebooks per group, the grapheme codebook counted in the first group
    codebook_groups: tuple[int, ...] = (5, 4)
    n_acoustic_codebooks: int = 8
    codebook_size: int = 1024
    n_graphemes: int = graphemes.VOCAB_SIZE
    # delay (in frames) of each codebook, grapheme first; MusicGen-style 0,1,2,...
    delays: tuple[int, ...] = ()
    n_heads: int = 4
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    rope_base: float = 10_000.0
    # text
    text_vocab_size: int = WHISPER_VOCAB + 1  # + end-of-stream
    max_text_tokens: int = 75
    # "table": one learnt row per token; "spelling": computed from the token's bytes by a
    # small shared encoder (models/spelling.py), so every token is read, seen or not
    text_embedding: str = "table"
    spelling_max_len: int = 16  # bytes of a token's spelling read (longer ones: 91 of 50,257)
    # phone input: each step also reads the phone of the frame its codebook 1 is drawn
    # for (the letter schedule's, models/front_end.py), one of n_phones (0: no phone input)
    n_phones: int = 0
    # speech encoder (enrollment)
    n_enroll: int = 32
    enc_d_model: int = 256
    enc_layers: int = 2
    enc_heads: int = 4
    enc_max_frames: int = 75 * 10
    # training
    cb_loss_lambda: float = 0.1
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if not self.delays:
            object.__setattr__(self, "delays", tuple(range(self.n_codebooks)))
        self.validate()

    @property
    def n_codebooks(self) -> int:
        """Grapheme codebook + acoustic codebooks."""
        return 1 + self.n_acoustic_codebooks

    @property
    def max_delay(self) -> int:
        return max(self.delays)

    @property
    def memory_size(self) -> int:
        """Cross-attention memory: enrollment vectors + text tokens (paper: 64 + 75)."""
        return self.n_enroll + self.max_text_tokens

    def group_slices(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for n in self.codebook_groups:
            out.append((start, start + n))
            start += n
        return out

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"invalid ModelConfig: {msg}")

        need(self.d_model > 0 and self.d_model % self.n_heads == 0, "d_model must be a positive multiple of n_heads")
        need((self.d_model // self.n_heads) % 2 == 0, "head dim must be even for RoPE")
        need(self.enc_d_model % self.enc_heads == 0, "enc_d_model must be a multiple of enc_heads")
        need(self.n_shared_layers >= 1 and self.n_group_layers >= 0, "layer counts")
        need(sum(self.codebook_groups) == self.n_codebooks,
             f"codebook_groups {self.codebook_groups} must sum to 1 + n_acoustic_codebooks = {self.n_codebooks}")
        need(all(n > 0 for n in self.codebook_groups), "empty codebook group")
        need(len(self.delays) == self.n_codebooks, "one delay per codebook")
        need(self.delays[0] == 0 and all(b >= a for a, b in zip(self.delays, self.delays[1:])),
             "delays must start at 0 (grapheme) and not decrease")
        need(self.codebook_size >= 2 and self.n_graphemes >= 3, "vocab sizes")
        need(self.max_text_tokens >= 1 and self.n_enroll >= 1, "memory sizes")
        need(0.0 <= self.cb_loss_lambda and 0.0 <= self.dropout < 1.0, "loss/dropout ranges")
        need(self.text_embedding in ("table", "spelling"), "text_embedding must be 'table' or 'spelling'")
        need(self.spelling_max_len >= 1, "spelling_max_len >= 1")
        need(self.n_phones >= 0, "n_phones >= 0")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
        d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        return cls(**d)


PRESETS: dict[str, ModelConfig] = {
    "paper": ModelConfig(
        d_model=1536, n_shared_layers=6, n_group_layers=6, codebook_groups=(4, 4, 4, 5),
        n_acoustic_codebooks=16, n_heads=16, n_enroll=64, enc_d_model=1024, enc_layers=6,
        enc_heads=8, max_text_tokens=75,
    ),
    "tiny": ModelConfig(),
    # the server's host work without its tensor work: one narrow layer, the tiny
    # preset's codebooks and text memory (`profile_step --model-path random:micro/micro`)
    "micro": ModelConfig(d_model=32, n_shared_layers=1, n_group_layers=1, n_heads=2, d_state=4,
                         enc_d_model=32, enc_layers=1, enc_heads=2),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    if not overrides:
        return PRESETS[name]
    if "n_acoustic_codebooks" in overrides and "delays" not in overrides:
        overrides["delays"] = ()  # recomputed for the new codebook count
    return dataclasses.replace(PRESETS[name], **overrides)
