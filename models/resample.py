"""Rational-rate resampling, whole or streaming (numpy only).

`StreamingResampler` is a polyphase FIR with state carried across pushes, so pushing in
pieces gives the same samples as resampling the whole signal, and the same as
`scipy.signal.resample_poly(x, up, down)` (same Kaiser-windowed filter, same alignment:
no delay is added, the filter's look-ahead is held back until input arrives or
`flush()`). numpy only: importing scipy.signal takes seconds, too long for the server's
engine thread. Used for the wire audio (server/audio.py) and for reference audio
(models/loading.py).
"""
from __future__ import annotations

import functools
import math

import numpy as np


@functools.lru_cache(maxsize=None)
def resample_filter(up: int, down: int) -> tuple[np.ndarray, int]:
    """The FIR `scipy.signal.resample_poly` uses (windowed sinc, Kaiser beta 5, unit DC
    gain, times `up`) and its half length; numpy only (importing scipy.signal takes
    seconds, too long for the engine thread)."""
    max_rate = max(up, down)
    half_len = 10 * max_rate
    cutoff = 1.0 / max_rate
    n = np.arange(2 * half_len + 1) - half_len
    h = cutoff * np.sinc(cutoff * n) * np.kaiser(2 * half_len + 1, 5.0)
    h *= up / h.sum()
    h.setflags(write=False)
    return h, half_len


class StreamingResampler:
    """Rational resampling by up/down, fed in pieces; output == resample_poly(whole)."""

    def __init__(self, up: int, down: int) -> None:
        g = math.gcd(up, down)
        self.up, self.down = up // g, down // g
        h, self.half_len = resample_filter(self.up, self.down)
        # polyphase: bank[p, m] = h[p + m*up]; output n at upsampled time t = n*down + half_len
        # is sum_m bank[t % up, m] * x[t // up - m]
        self.taps = -(-len(h) // self.up)
        padded = np.zeros(self.taps * self.up)
        padded[: len(h)] = h
        self.bank = padded.reshape(self.taps, self.up).T.copy()
        self._buf = np.zeros(0, dtype=np.float64)
        self._buf_start = 0  # global input index of _buf[0]
        self._n_in = 0
        self._n_out = 0  # next output index

    def _emit(self, upto: int) -> np.ndarray:
        """Outputs n in [_n_out, upto): inputs past _n_in count as zeros."""
        if upto <= self._n_out:
            return np.zeros(0, dtype=np.float32)
        n = np.arange(self._n_out, upto)
        t = n * self.down + self.half_len
        idx = (t // self.up)[:, None] - np.arange(self.taps)[None, :] - self._buf_start
        valid = (idx >= 0) & (idx < len(self._buf))
        vals = np.where(valid, self._buf[np.clip(idx, 0, max(len(self._buf) - 1, 0))] if len(self._buf) else 0.0, 0.0)
        y = np.einsum("nm,nm->n", self.bank[t % self.up], vals)
        self._n_out = upto
        # keep only the history the next output needs
        keep_from = (self._n_out * self.down + self.half_len) // self.up - self.taps + 1
        drop = min(max(keep_from - self._buf_start, 0), len(self._buf))
        self._buf = self._buf[drop:]
        self._buf_start += drop
        return y.astype(np.float32)

    def push(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        self._buf = np.concatenate([self._buf, x])
        self._n_in += len(x)
        # output n is final once its newest tap t//up has arrived: t//up <= n_in - 1
        ready = (self._n_in * self.up - self.half_len - 1) // self.down + 1
        total = -(-self._n_in * self.up // self.down)
        return self._emit(max(min(ready, total), self._n_out))

    def flush(self) -> np.ndarray:
        total = -(-self._n_in * self.up // self.down)
        return self._emit(total)


def resample(x: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """Whole-signal resampling: float32 at sr_out."""
    if sr_in == sr_out:
        return np.asarray(x, dtype=np.float32)
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    r = StreamingResampler(sr_out, sr_in)
    block = 1 << 14  # bounds the (outputs x taps) work matrix
    return np.concatenate([r.push(x[i : i + block]) for i in range(0, len(x), block)] + [r.flush()])
