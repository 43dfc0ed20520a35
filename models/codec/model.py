"""CodecModel: encode / decode / exact streaming decode / training losses / checkpoints."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Sequence, Union

import torch
from torch import Tensor, nn

from .config import CodecConfig, preset
from .losses import CodecLossConfig, weighted_reconstruction_losses
from .modules import SEANetDecoder, SEANetEncoder
from .quantization import ResidualVectorQuantizer

Indices = Union[Tensor, Sequence[int]]


@dataclass
class StreamState:
    """Streaming-decoder state of a batch of sessions. Every tensor has the session on
    dim 0, so sessions are gathered/scattered with `select`/`update` and joined with
    `cat` between steps.

    tensors: per causal conv its last (k-1)*dilation inputs; per transposed conv its
      last ceil(kernel / stride) - 1 input frames (1 here), which is what the unfinished
      right tail of its output still needs; per LSTM h and c ([B, layers, H]).
    frames: int64 [B], frames decoded so far per session (0 = not started).
    """

    tensors: list[Tensor]
    frames: Tensor

    @property
    def batch_size(self) -> int:
        return self.frames.shape[0]

    def _index(self, indices: Indices) -> Tensor:
        return torch.as_tensor(indices, dtype=torch.long, device=self.frames.device)

    def select(self, indices: Indices) -> "StreamState":
        """New state holding sessions `indices` (in that order); e.g. drop a session
        that left by selecting the others."""
        idx = self._index(indices)
        return StreamState([t.index_select(0, idx) for t in self.tensors], self.frames.index_select(0, idx))

    def update(self, indices: Indices, other: "StreamState") -> None:
        """In place: sessions `indices` of self take the state of other's sessions 0..n-1."""
        idx = self._index(indices)
        for t, o in zip(self.tensors, other.tensors, strict=True):
            t.index_copy_(0, idx, o)
        self.frames.index_copy_(0, idx, other.frames)

    @staticmethod
    def cat(states: Sequence["StreamState"]) -> "StreamState":
        """Concatenate batches of sessions (e.g. a running batch and newly joined ones)."""
        tensors = [torch.cat(ts, 0) for ts in zip(*(s.tensors for s in states), strict=True)]
        return StreamState(tensors, torch.cat([s.frames for s in states], 0))


class CodecModel(nn.Module):
    """EnCodec-style codec. Submodule names (`encoder`, `quantizer`, `decoder`) and all
    parameter/buffer names equal the official encodec package's, so
    `CodecModel(CodecConfig.encodec_24khz()).load_state_dict(torch.load(
    "encodec_24khz-d7cc33bc.th"))` works with strict=True."""

    def __init__(self, config: CodecConfig):
        super().__init__()
        self.config = config
        self.encoder = SEANetEncoder(config)
        self.quantizer = ResidualVectorQuantizer(config)
        self.decoder = SEANetDecoder(config)
        self._codes_frozen = False  # freeze_codes: train the decoder alone

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    @property
    def hop_length(self) -> int:
        return self.config.hop_length

    @property
    def frame_rate(self) -> float:
        return self.config.frame_rate

    @property
    def min_first_frames(self) -> int:
        """Frames the first packet of each stream must carry (1, or 7 with reflect padding)."""
        return self.decoder.min_first_frames

    @torch.no_grad()
    def encode(self, wav: Tensor, n_q: int | None = None) -> Tensor:
        """wav [B, 1, T] -> codes int64 [B, n_q, ceil(T / hop)] (n_q defaults to config.n_q)."""
        return self.quantizer.encode(self.encoder(wav), n_q)

    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, K, F] -> wav [B, 1, F * hop]; K may be fewer than n_codebooks."""
        return self.decoder(self.quantizer.decode(codes))

    @functools.cached_property
    def _stream_shapes(self) -> list[torch.Size]:
        return [t.shape[1:] for t in self.streaming_state(0).tensors]

    def streaming_state(self, batch_size: int) -> StreamState:
        ref = next(self.parameters())
        with torch.no_grad():
            tensors = self.decoder.stream_init(batch_size, ref)
        return StreamState(tensors, torch.zeros(batch_size, dtype=torch.long, device=ref.device))

    @torch.no_grad()
    def decode_step(self, codes: Tensor, state: StreamState) -> Tensor:
        """Decode the next packet of each session: codes [B, K, F] -> wav [B, 1, F * hop].

        Exact: concatenating the outputs of consecutive packets equals `decode` of the
        whole code stream (to float rounding), for any packet sizes, with no latency.
        With reflect padding a session's first packet needs >= `min_first_frames`
        frames (the reflection reads that far ahead). Updates `state` in place.
        """
        started = self.check_step(codes, state)
        new_states: list[Tensor] = []
        wav = self.decoder.stream_step(self.quantizer.decode(codes), iter(state.tensors), new_states, started)
        state.tensors = new_states
        state.frames = state.frames + codes.shape[-1]
        return wav

    def check_step(self, codes: Tensor, state: StreamState) -> Tensor | None:
        """Raises ValueError unless `decode_step(codes, state)` can run; returns its
        `started` mask (None when every stream in the batch has started)."""
        if codes.dim() != 3 or codes.shape[0] != state.batch_size:
            raise ValueError(f"codes must be [B={state.batch_size}, K, F], got {tuple(codes.shape)}")
        started = state.frames > 0
        if bool(started.all()):
            started = None
        elif codes.shape[-1] < self.min_first_frames:
            raise ValueError(f"the first packet of a stream needs >= {self.min_first_frames} frames "
                             f"with {self.config.pad_mode} padding, got {codes.shape[-1]}")
        if [t.shape[1:] for t in state.tensors] != self._stream_shapes:
            raise ValueError("stream state does not belong to this model")
        return started

    def stream_step_module(self) -> nn.Module:
        """The streaming decode of started streams as a module over plain tensors,
        (codes, *state tensors) -> (wav, *new state tensors): what tracing needs."""
        return _StreamStep(self)

    def freeze_codes(self) -> None:
        """Train the decoder alone from here on: the encoder and the codebooks keep their
        weights and stay in eval mode (no k-means, no EMA updates), so every utterance keeps
        its codes, and a language model trained on them stays valid."""
        self.encoder.requires_grad_(False)
        self.quantizer.requires_grad_(False)
        self._codes_frozen = True
        self.train(self.training)

    def train(self, mode: bool = True) -> "CodecModel":
        super().train(mode)
        if self._codes_frozen:
            self.encoder.eval()
            self.quantizer.eval()
        return self

    def train_forward(self, wav: Tensor, first_level: bool = False) -> tuple[Tensor, ...]:
        """Training forward on wav [B, 1, T] -> (reconstruction [B, 1, T], commitment loss
        [], already scaled by config.commitment_weight; zero with frozen codes), and with
        ``first_level`` the first quantiser level's output [B, D, F] (straight-through:
        a loss on it trains the encoder, e.g. a phone classifier). In
        training mode the codebooks are k-means initialised on the first batch and
        EMA-updated on every call (so call it once per step); gradients reach the encoder
        through the straight-through estimator. The first batch should hold >=
        codebook_size frames (16 x 1 s = 1200): with fewer, k-means copies every frame into
        the first codebook, the residual is zero and the later codebooks start at zero
        (dead-code expiry then revives them only gradually)."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self._codes_frozen):
            quantized, _, commit, first = self.quantizer(self.encoder(wav), with_first=True)
        recon = self.decoder(quantized)[..., : wav.shape[-1]]
        return (recon, commit, first) if first_level else (recon, commit)

    def train_losses(self, wav: Tensor, loss_config: CodecLossConfig | None = None) -> dict[str, Tensor]:
        """`train_forward`, scored: unweighted 'l1', 'stft', 'mel', the commitment loss
        'commit' and their weighted sum 'total' to backpropagate."""
        recon, commit = self.train_forward(wav)
        return weighted_reconstruction_losses(wav, recon, commit, self.sample_rate, loss_config)

    def save(self, path: str | os.PathLike, half: bool = False) -> None:
        """Our checkpoint format; ``half`` stores floating-point tensors in fp16 (loaded back
        to fp32 by `from_checkpoint`)."""
        sd = {k: (v.half() if half and v.is_floating_point() else v) for k, v in self.state_dict().items()}
        torch.save({"config": self.config.to_dict(), "state_dict": sd}, path)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, config: CodecConfig | str | None = None,
                        map_location: Any = "cpu") -> "CodecModel":
        """Load our format ({'config', 'state_dict'}) or a bare state dict such as the
        official `encodec_24khz-d7cc33bc.th`, for which `config` (a CodecConfig or a
        preset name) is required. With our format `config`, if given, overrides the
        stored one (e.g. to use fewer codebooks: `CodecConfig.encodec_24khz(n_q=8)`).
        Returns the model in eval mode."""
        obj = torch.load(path, map_location=map_location, weights_only=True)
        if isinstance(obj, dict) and set(obj) == {"config", "state_dict"}:
            state_dict = obj["state_dict"]
            config = config or CodecConfig.from_dict(obj["config"])
        elif config is None:
            raise ValueError(f"{path} is a bare state dict: pass config= (e.g. 'encodec_24khz')")
        else:
            state_dict = obj
        if isinstance(config, str):
            config = preset(config)
        model = cls(config)
        model.load_state_dict(state_dict)
        return model.eval()


class _StreamStep(nn.Module):
    def __init__(self, codec: CodecModel):
        super().__init__()
        self.codec = codec

    def forward(self, codes: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
        new_states: list[Tensor] = []
        wav = self.codec.decoder.stream_step(self.codec.quantizer.decode(codes), iter(tensors), new_states, None)
        return (wav, *new_states)
