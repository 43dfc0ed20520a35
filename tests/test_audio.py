"""protos/audio.py and server/audio.py: streaming resampling, packetising, PCM16 and G.711 mu-law."""
from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from livespeech.api.audio import MULAW_DECODE, decode_wav, encode_wav, float_to_pcm16, mulaw_to_pcm16, pcm16_to_mulaw
from livespeech.server.audio import AudioEncoder
from livespeech.models.resample import StreamingResampler, resample, resample_filter
from livespeech.api.session import Encoding

RATIOS = [(1, 3), (2, 3), (2, 1)]  # 24 kHz -> 8, 16, 48 kHz


def _signal(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 0.3).astype(np.float32)


def _in_pieces(r: StreamingResampler, x: np.ndarray, cuts: list[int]) -> np.ndarray:
    out, prev = [], 0
    for c in sorted(set(cuts)) + [len(x)]:
        out.append(r.push(x[prev:c]))
        prev = c
    out.append(r.flush())
    return np.concatenate(out)


@pytest.mark.parametrize("up,down", RATIOS)
def test_resampler_matches_scipy_resample_poly(up: int, down: int) -> None:
    from scipy.signal import firwin, resample_poly

    h, half_len = resample_filter(up, down)
    np.testing.assert_allclose(h, firwin(2 * half_len + 1, 1 / max(up, down), window=("kaiser", 5.0)) * up, atol=1e-12)
    x = _signal(4801)
    r = StreamingResampler(up, down)
    y = np.concatenate([r.push(x), r.flush()])
    ref = resample_poly(x.astype(np.float64), up, down)
    assert len(y) == len(ref)
    np.testing.assert_allclose(y, ref, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    ratio=st.sampled_from(RATIOS),
    n=st.integers(0, 3000),
    cuts=st.lists(st.integers(0, 3000), max_size=12),
)
def test_resampling_in_pieces_equals_whole(ratio: tuple[int, int], n: int, cuts: list[int]) -> None:
    x = _signal(n, seed=n)
    whole = _in_pieces(StreamingResampler(*ratio), x, [])
    pieces = _in_pieces(StreamingResampler(*ratio), x, [c for c in cuts if c <= n])
    assert len(pieces) == len(whole) == -(-n * ratio[0] // ratio[1])
    np.testing.assert_array_equal(pieces, whole)


@pytest.mark.parametrize("rate", [8000, 16000, 24000, 48000])
@pytest.mark.parametrize("encoding", [Encoding.PCM16, Encoding.MULAW])
def test_encoder_packets_exact_contiguous_and_seamless(rate: int, encoding: Encoding) -> None:
    packet_ms = 40
    x = _signal(24000 * 7 // 10, seed=rate)  # 0.7 s
    enc = AudioEncoder(rate, encoding, packet_ms)
    packets = []
    rng = np.random.default_rng(1)
    i = 0
    while i < len(x):
        k = int(rng.integers(1, 900))
        packets += enc.push(x[i : i + k])
        i += k
    packets += enc.flush()
    width = 2 if encoding is Encoding.PCM16 else 1
    n = rate * packet_ms // 1000
    t = 0.0
    for p in packets[:-1]:
        assert len(p.data) == n * width
        assert p.duration_s == pytest.approx(packet_ms / 1000)
    assert 0 < len(packets[-1].data) <= n * width
    for p in packets:
        assert p.start_s == pytest.approx(t, abs=1e-9)
        assert p.duration_s == pytest.approx(len(p.data) / width / rate)
        t += p.duration_s
    assert t == pytest.approx(len(x) / 24000, abs=1 / rate)
    # the packets join into exactly the whole-signal conversion
    data = b"".join(p.data for p in packets)
    whole = resample(x, 24000, rate)
    pcm = float_to_pcm16(whole)
    expected = pcm.tobytes() if encoding is Encoding.PCM16 else pcm16_to_mulaw(pcm).tobytes()
    assert data == expected


def test_pcm16_clips_and_rounds() -> None:
    y = float_to_pcm16(np.array([0.0, 0.5, -0.5, 1.0, -1.0, 3.0, -3.0], dtype=np.float32))
    assert y.dtype == np.dtype("<i2")
    assert y.tolist() == [0, 16384, -16384, 32767, -32767, 32767, -32768]


def _mulaw_formula(x: np.ndarray) -> np.ndarray:
    """Continuous mu-law (mu = 255) of x in [-1, 1]."""
    return np.sign(x) * np.log1p(255 * np.abs(x)) / np.log(256)


def test_mulaw_against_reference_formula() -> None:
    x = np.arange(-32768, 32768)
    codes = pcm16_to_mulaw(x)
    decoded = mulaw_to_pcm16(codes.tobytes()).astype(np.float64)
    # G.711 is the 8-bit segment approximation of the continuous law: within one step
    err = np.abs(_mulaw_formula(decoded / 32768) - _mulaw_formula(x / 32768))
    assert err.max() <= 1 / 128
    # decoding is monotonic, symmetric, and known anchor codes hold
    assert MULAW_DECODE[0xFF] == 0 and MULAW_DECODE[0x7F] == 0
    assert MULAW_DECODE[0x80] == 32124 and MULAW_DECODE[0x00] == -32124
    pos = MULAW_DECODE[0x80:][::-1]
    assert np.all(np.diff(pos.astype(int)) > 0)
    np.testing.assert_array_equal(MULAW_DECODE[:0x80], -MULAW_DECODE[0x80:])
    # every decoded level encodes back to a code of that level
    levels = np.unique(MULAW_DECODE)
    assert np.array_equal(MULAW_DECODE[pcm16_to_mulaw(levels)], levels)


def test_mulaw_matches_audioop_where_available() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")
    np.testing.assert_array_equal(
        MULAW_DECODE, np.frombuffer(audioop.ulaw2lin(bytes(range(256)), 2), dtype="<i2")
    )
    x = np.arange(0, 32768, dtype=np.int16)  # audioop truncates negatives to 14 bits differently
    ref = np.frombuffer(audioop.lin2ulaw(x.tobytes(), 2), dtype=np.uint8)
    np.testing.assert_array_equal(pcm16_to_mulaw(x), ref)


def test_wav_round_trip_and_formats() -> None:
    from scipy.io import wavfile

    x = _signal(1600) * 0.5
    y, rate = decode_wav(encode_wav(x, 16000))
    assert rate == 16000
    np.testing.assert_allclose(y, x, atol=1 / 16000)
    buf = io.BytesIO()  # float32 stereo
    wavfile.write(buf, 8000, np.stack([x, x], axis=1).astype(np.float32))
    y, rate = decode_wav(buf.getvalue())
    assert rate == 8000 and y.shape == x.shape
    with pytest.raises(ValueError):
        decode_wav(b"RIFF junk")


def _wav_header(bits: int, tag: int = 1, rate: int = 16000, data: bytes = b"\x00\x10" * 800) -> bytes:
    """A mono WAV with a hand-written fmt chunk (any sample width, even unsupported)."""
    import struct

    block = (bits + 7) // 8
    fmt = struct.pack("<HHIIHH", tag, 1, rate, rate * block, block, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


@pytest.mark.parametrize("bits,tag", [(12, 1), (4, 1), (20, 1), (16, 3), (8, 6)])
def test_wav_with_an_unsupported_sample_format_is_refused(bits: int, tag: int) -> None:
    with pytest.raises(ValueError, match="unsupported sample format"):
        decode_wav(_wav_header(bits, tag))


@pytest.mark.parametrize("bits", [8, 16])
def test_wav_header_helper_makes_files_that_decode(bits: int) -> None:
    x, rate = decode_wav(_wav_header(bits))
    assert rate == 16000 and len(x) == 1600 // (bits // 8)
