"""Audio encoding for the wire (numpy only; called from the engine thread).

`AudioEncoder` turns the model's 24 kHz float32 stream into packets of exactly
`packet_ms` (the last one may be shorter, and so may one the engine asks for early) in
the session's sample rate and encoding (sample formats: protos/audio.py).
Resampling is models/resample.py's streaming polyphase FIR: pushing in pieces gives the
same samples as resampling the whole signal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from livespeech.api.audio import float_to_pcm16, pcm16_to_mulaw
from livespeech.api.session import Encoding
from livespeech.models.resample import StreamingResampler

MODEL_SAMPLE_RATE = 24_000


@dataclass(frozen=True)
class EncodedPacket:
    data: bytes
    start_s: float  # offset of the first sample on the session's audio timeline
    duration_s: float


# ------------------------------------------------------------------- packetising


class AudioEncoder:
    """24 kHz float32 -> packets of `packet_ms` in the session's rate and encoding."""

    def __init__(self, sample_rate: int, encoding: Encoding, packet_ms: int, min_packet_ms: Optional[int] = None) -> None:
        self.sample_rate = sample_rate
        self.encoding = encoding
        self.packet_samples = sample_rate * packet_ms // 1000
        # the shortest packet `push(short=True)` sends (but the last); default packet_ms
        self.min_packet_samples = max(1, sample_rate * (packet_ms if min_packet_ms is None else min_packet_ms) // 1000)
        if self.packet_samples <= 0 or sample_rate * packet_ms % 1000:
            raise ValueError(f"packet_ms={packet_ms} is not a whole number of samples at {sample_rate} Hz")
        self._resampler: Optional[StreamingResampler] = (
            None if sample_rate == MODEL_SAMPLE_RATE else StreamingResampler(sample_rate, MODEL_SAMPLE_RATE)
        )
        self._pending = np.zeros(0, dtype=np.float32)
        self._emitted = 0  # output samples already packetised

    def _encode(self, x: np.ndarray) -> bytes:
        pcm = float_to_pcm16(x)
        if self.encoding is Encoding.MULAW:
            return pcm16_to_mulaw(pcm).tobytes()
        return pcm.tobytes()

    def _packets(self, final: bool) -> list[EncodedPacket]:
        out = []
        n = self.packet_samples
        while len(self._pending) >= n or (final and len(self._pending)):
            chunk, self._pending = self._pending[:n], self._pending[n:]
            out.append(
                EncodedPacket(
                    self._encode(chunk), self._emitted / self.sample_rate, len(chunk) / self.sample_rate
                )
            )
            self._emitted += len(chunk)
        return out

    def push(self, samples: np.ndarray, short: bool = False) -> list[EncodedPacket]:
        """Whole packets of the audio so far; with `short`, also what is left over as
        one shorter packet if it lasts at least min_packet_ms (`PacketPolicy.due`
        asks for one)."""
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        if self._resampler is not None:
            x = self._resampler.push(x)
        self._pending = np.concatenate([self._pending, x])
        out = self._packets(final=False)
        if short and len(self._pending) >= self.min_packet_samples:
            out += self._packets(final=True)
        return out

    def flush(self) -> list[EncodedPacket]:
        if self._resampler is not None:
            self._pending = np.concatenate([self._pending, self._resampler.flush()])
        return self._packets(final=True)
