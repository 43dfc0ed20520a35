"""Audio on the wire, shared by the server and the client (numpy; scipy to read WAV files).

PCM16 and G.711 mu-law sample conversions, and WAV decoding/encoding (enrollment audio,
`livespeech say` output).
"""
from __future__ import annotations

import io
from typing import Optional

import numpy as np


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
