"""Reconstruction losses for codec training without a discriminator: L1 on the waveform,
multi-resolution STFT (spectral convergence + log magnitude) and multi-scale log-mel."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class CodecLossConfig:
    l1_weight: float = 0.1  # EnCodec's lambda_t
    stft_weight: float = 1.0
    mel_weight: float = 1.0  # EnCodec's lambda_f
    # (n_fft, hop) per resolution
    stft_resolutions: tuple[tuple[int, int], ...] = ((2048, 512), (1024, 256), (512, 128))
    # EnCodec: windows 2^5..2^11 with hop w/4; 2^5 is dropped, 32-point FFTs carry no mel detail
    mel_windows: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)
    n_mels: int = 64
    log_floor: float = 1e-5

    def __post_init__(self) -> None:
        if not self.stft_resolutions or not self.mel_windows or self.n_mels < 1 or not self.log_floor > 0:
            raise ValueError("CodecLossConfig needs an STFT resolution, a mel window, "
                             "n_mels >= 1 and log_floor > 0")


@functools.lru_cache(maxsize=32)
def _mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> Tensor:
    """HTK triangular filters [n_mels, n_fft // 2 + 1] over 0..Nyquist (filters narrower
    than an FFT bin come out all zero and simply contribute no loss)."""
    def hz_to_mel(f: Tensor) -> Tensor:
        return 2595.0 * torch.log10(1.0 + f / 700.0)

    def mel_to_hz(m: Tensor) -> Tensor:
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)

    freqs = torch.linspace(0.0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    edges = mel_to_hz(torch.linspace(0.0, float(hz_to_mel(torch.tensor(sample_rate / 2))), n_mels + 2,
                                     dtype=torch.float64))
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    up = (freqs[None] - lo) / (mid - lo)
    down = (hi - freqs[None]) / (hi - mid)
    return torch.clamp(torch.minimum(up, down), min=0.0).float()


@functools.lru_cache(maxsize=32)
def _hann(n_fft: int) -> Tensor:
    return torch.hann_window(n_fft)


def _magnitude(x: Tensor, n_fft: int, hop: int) -> Tensor:
    """x [B, T] -> |STFT| [B, n_fft // 2 + 1, frames]; clamped before the sqrt so the
    gradient stays finite in silence."""
    window = _hann(n_fft).to(x)
    spec = torch.stft(x, n_fft, hop, n_fft, window, center=True, return_complex=True)
    return torch.view_as_real(spec).pow(2).sum(-1).clamp_min(1e-10).sqrt()


def stft_loss(x: Tensor, y: Tensor, cfg: CodecLossConfig) -> Tensor:
    """Mean over resolutions of spectral convergence + L1 log magnitude; x is the target."""
    total = x.new_zeros(())
    for n_fft, hop in cfg.stft_resolutions:
        mx, my = _magnitude(x, n_fft, hop), _magnitude(y, n_fft, hop)
        sc = torch.linalg.vector_norm(mx - my) / torch.linalg.vector_norm(mx).clamp_min(1e-7)
        log = (mx.clamp_min(cfg.log_floor).log() - my.clamp_min(cfg.log_floor).log()).abs().mean()
        total = total + sc + log
    return total / len(cfg.stft_resolutions)


def mel_loss(x: Tensor, y: Tensor, sample_rate: int, cfg: CodecLossConfig) -> Tensor:
    """Mean over window sizes of the L1 distance between log-mel spectrograms."""
    total = x.new_zeros(())
    for win in cfg.mel_windows:
        fb = _mel_filterbank(sample_rate, win, cfg.n_mels).to(x)
        mx = fb @ _magnitude(x, win, win // 4)
        my = fb @ _magnitude(y, win, win // 4)
        total = total + (mx.clamp_min(cfg.log_floor).log() - my.clamp_min(cfg.log_floor).log()).abs().mean()
    return total / len(cfg.mel_windows)


def reconstruction_losses(wav: Tensor, recon: Tensor, sample_rate: int,
                          cfg: CodecLossConfig) -> dict[str, Tensor]:
    """wav, recon [B, 1, T] -> {'l1', 'stft', 'mel'} (unweighted)."""
    x, y = wav.flatten(0, 1), recon.flatten(0, 1)
    return {
        "l1": (x - y).abs().mean(),
        "stft": stft_loss(x, y, cfg),
        "mel": mel_loss(x, y, sample_rate, cfg),
    }


def weighted_reconstruction_losses(wav: Tensor, recon: Tensor, commit: Tensor, sample_rate: int,
                                   cfg: CodecLossConfig | None = None) -> dict[str, Tensor]:
    """`reconstruction_losses` plus 'commit' and their weighted sum 'total'."""
    cfg = cfg or CodecLossConfig()
    losses = reconstruction_losses(wav, recon, sample_rate, cfg)
    losses["commit"] = commit
    losses["total"] = (cfg.l1_weight * losses["l1"] + cfg.stft_weight * losses["stft"]
                       + cfg.mel_weight * losses["mel"] + commit)
    return losses
