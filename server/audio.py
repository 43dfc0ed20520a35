"""Audio encoding for the wire (numpy only; called from the engine thread).

`AudioEncoder` turns the model's 24 kHz float32 stream into packets of exactly
`packet_ms` (the last one may be shorter, and so may one the engine asks for early) in
the session's sample rate and encoding.
Resampling is models/resample.py's streaming polyphase FIR: pushing in pieces gives the
same samples as resampling the whole signal.

Also: G.711 mu-law, PCM16, WAV decoding/encoding helpers for enrollment audio.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Optional

import numpy as np

from models.resample import StreamingResampler

from .session_api import Encoding

MODEL_SAMPLE_RATE = 24_000


@dataclass(frozen=True)
class EncodedPacket:
    data: bytes
    start_s: float  # offset of the first sample on the session's audio timeline
    duration_s: float


# ------------------------------------------------------------------- sample formats


def float_to_pcm16(x: np.ndarray) -> np.ndarray:
    """float in [-1, 1] -> int16 (clipped, rounded)."""
    y = np.rint(np.asarray(x, dtype=np.float64) * 32767.0)
    return np.clip(y, -32768, 32767).astype("<i2")


def pcm16_to_float(data: bytes) -> np.ndarray:
    if len(data) % 2:
        raise ValueError("PCM16 data has an odd number of bytes")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


_MULAW_BIAS = 0x84
_MULAW_CLIP = 32635


def _mulaw_encode_table() -> np.ndarray:
    """G.711 mu-law for every int16 value (the segment encoder of ITU-T G.711 / Sun g711.c)."""
    x = np.arange(-32768, 32768, dtype=np.int32)
    sign = np.where(x < 0, 0x80, 0x00)
    mag = np.minimum(np.abs(x), _MULAW_CLIP) + _MULAW_BIAS
    # segment = position of the highest set bit above bit 7, 0..7
    exponent = np.floor(np.log2(mag)).astype(np.int32) - 7
    exponent = np.clip(exponent, 0, 7)
    mantissa = (mag >> (exponent + 3)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8)


def _mulaw_decode_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    sign = u & 0x80
    exponent = (u >> 4) & 0x07
    mantissa = u & 0x0F
    mag = (((mantissa << 3) + _MULAW_BIAS) << exponent) - _MULAW_BIAS
    return np.where(sign, -mag, mag).astype(np.int16)


_MULAW_ENC = _mulaw_encode_table()
MULAW_DECODE = _mulaw_decode_table()


def pcm16_to_mulaw(x: np.ndarray) -> np.ndarray:
    return _MULAW_ENC[np.asarray(x, dtype=np.int32) + 32768]


def mulaw_to_pcm16(data: bytes) -> np.ndarray:
    return MULAW_DECODE[np.frombuffer(data, dtype=np.uint8)]


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
        one shorter packet if it lasts at least min_packet_ms (`Engine._packet_due`
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


# ------------------------------------------------------------------- files


# (format tag, bits per sample) decode_wav reads exactly; scipy also "reads" other
# widths (a 12-bit header as 16- or 8-bit samples), which would be the wrong audio
_WAV_PCM, _WAV_FLOAT, _WAV_EXTENSIBLE = 1, 3, 0xFFFE
WAV_FORMATS = {(_WAV_PCM, b) for b in (8, 16, 24, 32)} | {(_WAV_FLOAT, b) for b in (32, 64)}


def _wav_format(data: bytes) -> Optional[tuple[int, int]]:
    """(format tag, bits per sample) from the fmt chunk; None if there is none to read
    (scipy then names what is wrong with the file)."""
    import struct

    if len(data) < 12 or data[:4] not in (b"RIFF", b"RIFX") or data[8:12] != b"WAVE":
        return None
    order = "<" if data[:4] == b"RIFF" else ">"
    pos = 12
    while pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], struct.unpack(order + "I", data[pos + 4:pos + 8])[0]
        body = data[pos + 8:pos + 8 + size]
        if cid == b"fmt ":
            if len(body) < 16:
                return None
            tag, bits = struct.unpack(order + "H", body[0:2])[0], struct.unpack(order + "H", body[14:16])[0]
            if tag == _WAV_EXTENSIBLE and len(body) >= 26:  # the sub-format GUID starts with the tag
                tag = struct.unpack(order + "H", body[24:26])[0]
            return tag, bits
        pos += 8 + size + (size & 1)  # chunks are padded to even sizes
    return None


def decode_wav(data: bytes) -> tuple[np.ndarray, int]:
    """WAV bytes (PCM 8/16/24/32-bit or float 32/64-bit; any channel count) -> float32
    mono, rate. Other sample formats raise ValueError."""
    from scipy.io import wavfile

    fmt = _wav_format(data)
    if fmt is not None and fmt not in WAV_FORMATS:
        tag, bits = fmt
        kind = {_WAV_PCM: "PCM", _WAV_FLOAT: "float"}.get(tag, f"format tag {tag}")
        raise ValueError(
            f"unsupported sample format: {bits}-bit {kind} (supported: PCM 8/16/24/32-bit, float 32/64-bit)"
        )
    try:
        rate, x = wavfile.read(io.BytesIO(data))
    except Exception as e:  # scipy raises ValueError/TypeError for malformed files
        raise ValueError(f"not a readable WAV file: {e}") from None
    if x.dtype == np.uint8:
        y = (x.astype(np.float32) - 128.0) / 128.0
    elif np.issubdtype(x.dtype, np.integer):
        y = x.astype(np.float32) / float(-np.iinfo(x.dtype).min)
    else:
        y = x.astype(np.float32)
    if y.ndim == 2:
        y = y.mean(axis=1)
    return y, int(rate)


def encode_wav(samples: np.ndarray, sample_rate: int) -> bytes:
    """float32 mono -> 16-bit PCM WAV bytes."""
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(float_to_pcm16(samples).tobytes())
    return buf.getvalue()
