"""Residual vector quantizer with EMA codebooks (names as in the official encodec package:
`quantizer.vq.layers.{i}._codebook.{inited,cluster_size,embed,embed_avg}`)."""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .config import CodecConfig


def _sample_vectors(samples: Tensor, num: int) -> Tensor:
    n = samples.shape[0]
    if n >= num:
        idx = torch.randperm(n, device=samples.device)[:num]
    else:
        idx = torch.randint(0, n, (num,), device=samples.device)
    return samples[idx]


def _nearest(x: Tensor, embed: Tensor) -> Tensor:
    """Index of the nearest codeword for each row of x [N, D]; embed is [K, D]. Written
    as encodec writes it so that codes match it bit for bit, near-ties included."""
    e = embed.t()
    dist = -(x.pow(2).sum(1, keepdim=True) - 2 * x @ e + e.pow(2).sum(0, keepdim=True))
    return dist.max(dim=-1).indices


def kmeans(samples: Tensor, num_clusters: int, num_iters: int) -> tuple[Tensor, Tensor]:
    """Lloyd's k-means from randomly sampled rows; returns (means [K, D], counts [K]).
    Distances go through a matmul, not an [N, K, D] difference tensor, so 50 iterations
    on a training batch take seconds rather than minutes."""
    means = _sample_vectors(samples, num_clusters)
    counts = torch.zeros(num_clusters, dtype=torch.long, device=samples.device)
    for _ in range(num_iters):
        assign = _nearest(samples, means)
        counts = torch.bincount(assign, minlength=num_clusters)
        sums = torch.zeros_like(means).index_add_(0, assign, samples)
        new_means = sums / counts.clamp(min=1)[:, None].to(samples.dtype)
        means = torch.where((counts == 0)[:, None], means, new_means)
    return means, counts


class EuclideanCodebook(nn.Module):
    def __init__(self, dim: int, codebook_size: int, *, kmeans_init: bool, kmeans_iters: int,
                 decay: float, threshold_ema_dead_code: float, epsilon: float = 1e-5):
        super().__init__()
        self.codebook_size = codebook_size
        self.kmeans_iters = kmeans_iters
        self.decay = decay
        self.epsilon = epsilon
        self.threshold_ema_dead_code = threshold_ema_dead_code
        if kmeans_init:
            embed = torch.zeros(codebook_size, dim)  # filled by k-means on the first training batch
        else:
            embed = nn.init.kaiming_uniform_(torch.empty(codebook_size, dim))
        # float [1] like the official buffer, so official checkpoints load unchanged
        self.register_buffer("inited", torch.tensor([float(not kmeans_init)]))
        self.register_buffer("cluster_size", torch.zeros(codebook_size))
        self.register_buffer("embed", embed)
        self.register_buffer("embed_avg", embed.clone())

    def encode(self, x: Tensor) -> Tensor:
        """x [..., D] -> codes [...]."""
        return _nearest(x.reshape(-1, x.shape[-1]), self.embed).view(x.shape[:-1])

    def decode(self, codes: Tensor) -> Tensor:
        return F.embedding(codes, self.embed)

    @torch.no_grad()
    def _init_embed(self, flat: Tensor) -> None:
        embed, counts = kmeans(flat, self.codebook_size, self.kmeans_iters)
        self.embed.copy_(embed)
        self.embed_avg.copy_(embed)
        self.cluster_size.copy_(counts)
        self.inited.fill_(1.0)

    @torch.no_grad()
    def _expire_codes(self, flat: Tensor) -> None:
        if self.threshold_ema_dead_code == 0:
            return
        dead = self.cluster_size < self.threshold_ema_dead_code
        if not bool(dead.any()):
            return
        fresh = _sample_vectors(flat, self.codebook_size)
        # Unlike encodec, which replaces only `embed` (the EMA step right after rebuilds
        # it from embed_avg, so revived codes die again at once), the EMA statistics are
        # reset too, so revived codes survive until they are used or expire again.
        self.embed.copy_(torch.where(dead[:, None], fresh, self.embed))
        self.embed_avg.copy_(torch.where(dead[:, None], fresh * self.threshold_ema_dead_code, self.embed_avg))
        self.cluster_size.masked_fill_(dead, float(self.threshold_ema_dead_code))

    @torch.no_grad()
    def _ema_update(self, flat: Tensor, codes: Tensor) -> None:
        onehot = F.one_hot(codes, self.codebook_size).to(flat.dtype)
        self.cluster_size.lerp_(onehot.sum(0), 1 - self.decay)
        self.embed_avg.lerp_(onehot.t() @ flat, 1 - self.decay)
        # Laplace smoothing keeps unused codes from dividing by zero
        n = self.cluster_size.sum()
        smoothed = (self.cluster_size + self.epsilon) / (n + self.codebook_size * self.epsilon) * n
        self.embed.copy_(self.embed_avg / smoothed[:, None])

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [..., D] -> (quantized [..., D], codes [...]); trains the codebook in training mode."""
        flat = x.reshape(-1, x.shape[-1])
        if self.training and not bool(self.inited.item()):
            self._init_embed(flat.detach())
        codes = _nearest(flat.detach(), self.embed)
        quantized = F.embedding(codes, self.embed)
        if self.training:
            self._expire_codes(flat.detach())
            self._ema_update(flat.detach(), codes)
        return quantized.view(x.shape), codes.view(x.shape[:-1])


class VectorQuantization(nn.Module):
    """One codebook over conv layout [B, D, T] with a straight-through estimator."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.commitment_weight = cfg.commitment_weight
        self._codebook = EuclideanCodebook(
            cfg.dimension, cfg.codebook_size, kmeans_init=cfg.kmeans_init, kmeans_iters=cfg.kmeans_iters,
            decay=cfg.ema_decay, threshold_ema_dead_code=cfg.threshold_ema_dead_code)

    def encode(self, x: Tensor) -> Tensor:
        return self._codebook.encode(x.transpose(1, 2))

    def decode(self, codes: Tensor) -> Tensor:
        return self._codebook.decode(codes).transpose(1, 2)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """-> (quantized [B, D, T], codes [B, T], weighted commitment loss [])."""
        x = x.transpose(1, 2)
        quantized, codes = self._codebook(x)
        loss = x.new_zeros(())
        if self.training:
            loss = F.mse_loss(quantized.detach(), x) * self.commitment_weight
            quantized = x + (quantized - x).detach()
        return quantized.transpose(1, 2), codes, loss


class ResidualVectorQuantization(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.layers = nn.ModuleList(VectorQuantization(cfg) for _ in range(cfg.n_codebooks))


class ResidualVectorQuantizer(nn.Module):
    """Residual VQ over latent [B, D, T]; codes are [B, n_q, T]."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.n_q = cfg.n_q
        self.vq = ResidualVectorQuantization(cfg)

    def set_dead_code_threshold(self, threshold: float) -> None:
        """The EMA count below which a training step re-seeds a code from the batch, in
        every codebook (the config's `threshold_ema_dead_code` until set)."""
        for layer in self.vq.layers:
            layer._codebook.threshold_ema_dead_code = threshold

    def _layers(self, n_q: int | None) -> nn.ModuleList:
        n_q = self.n_q if n_q is None else n_q
        if not 1 <= n_q <= len(self.vq.layers):
            raise ValueError(f"n_q={n_q} outside 1..{len(self.vq.layers)}")
        return self.vq.layers[:n_q]

    def forward(self, x: Tensor, n_q: int | None = None, with_first: bool = False) -> tuple[Tensor, ...]:
        """-> (quantized [B, D, T], codes [B, n_q, T], mean commitment loss []), and with
        ``with_first`` the first level's quantized output [B, D, T]."""
        residual, out = x, torch.zeros_like(x)
        codes, losses, levels = [], [], []
        for layer in self._layers(n_q):
            q, c, loss = layer(residual)
            residual = residual - q
            out = out + q
            codes.append(c)
            losses.append(loss)
            levels.append(q)
        result = (out, torch.stack(codes, 1), torch.stack(losses).mean())
        return (*result, levels[0]) if with_first else result

    def encode(self, x: Tensor, n_q: int | None = None) -> Tensor:
        residual, codes = x, []
        for layer in self._layers(n_q):
            c = layer.encode(residual)
            residual = residual - layer.decode(c)
            codes.append(c)
        return torch.stack(codes, 1)

    def codeword_tables(self) -> Tensor:
        """[n_codebooks, codebook_size, D]: each level's codewords, which `decode` sums."""
        return torch.stack([layer._codebook.embed for layer in self.vq.layers])

    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, K, T] (any K <= n_codebooks) -> latent [B, D, T]."""
        layers = self._layers(codes.shape[1])
        out = layers[0].decode(codes[:, 0])
        for k in range(1, codes.shape[1]):
            out = out + layers[k].decode(codes[:, k])
        return out
