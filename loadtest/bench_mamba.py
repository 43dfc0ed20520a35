"""Timings for models/mamba.py: training step of a Mamba stack, and decode `step`.

    python -m livespeech.loadtest.bench_mamba [--threads 1] [--chunks auto,8,16] [--naive] [--no-train]
    python -m livespeech.loadtest.bench_mamba --device cuda --batch 256 --frames 600 --tiling cpu,cuda --no-step
    python -m livespeech.loadtest.bench_mamba --device cuda --batch 256 --frames 600 --mamba-ssm --no-step

Training: n_layers residual MambaBlocks (pre-RMSNorm), fwd + bwd + AdamW on [B, T, d].
`--naive` also times one layer with plain autograd through a per-step Python loop.
`--mamba-ssm` also times the same stack (same weights) built from `mamba_ssm.Mamba`
(its CUDA kernels) and prints how far its outputs are from ours.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from livespeech.models import mamba
from livespeech.models.mamba import MambaBlock


class Stack(nn.Module):
    def __init__(self, d_model: int, n_layers: int, block=MambaBlock, **kw):
        super().__init__()
        self.layers = nn.ModuleList(block(d_model, layer_idx=i, **kw) for i in range(n_layers))
        self.norms = nn.ModuleList(nn.RMSNorm(d_model) for _ in range(n_layers))

    def forward(self, x):
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x))
        return x


def naive_forward(m: MambaBlock, x: torch.Tensor) -> torch.Tensor:
    """Same math as MambaBlock.forward, scan recorded step by step by autograd."""
    T = x.shape[1]
    xz = m.in_proj(x)
    u, z = xz.chunk(2, -1)
    u = F.silu(m.conv1d(u.transpose(1, 2))[..., :T]).transpose(1, 2)
    dt, B, C = m.x_proj(u).split([m.dt_rank, m.d_state, m.d_state], -1)
    delta = F.softplus(m.dt_proj(dt))
    A = -torch.exp(m.A_log)
    h = u.new_zeros(u.shape[0], m.d_inner, m.d_state)
    ys = []
    for t in range(T):
        dBu = (delta[:, t] * u[:, t])[:, :, None] * B[:, t, None, :]
        h = torch.exp(delta[:, t, :, None] * A) * h + dBu
        ys.append((h * C[:, t, None, :]).sum(-1))
    y = (torch.stack(ys, 1) + m.D * u) * F.silu(z)
    return m.out_proj(y)


def time_train(model, x, fwd, steps: int) -> tuple[float, float]:
    """(median wall s, median CPU s) per fwd + bwd + AdamW step; CPU time is what other
    processes on a shared machine inflate least (on CUDA, wall time is the figure)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    wall, cpu = [], []
    for i in range(steps + 1):
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = fwd(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i:  # the first step warms the allocator and AdamW state
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def time_step(m: MambaBlock, batch: int, iters: int) -> float:
    """Best-of-5 mean CPU seconds of one `step` call."""
    conv, ssm = m.allocate_inference_cache(batch)
    x = torch.randn(batch, 1, m.d_model)
    with torch.inference_mode():
        for _ in range(20):
            m.step(x, conv, ssm)
        best = []
        for _ in range(5):
            c0 = time.process_time()
            for _ in range(iters):
                m.step(x, conv, ssm)
            best.append((time.process_time() - c0) / iters)
    return min(best)


def compare_mamba_ssm(a, x: torch.Tensor, dev: torch.device) -> None:
    """Train-step time of the same stack on mamba_ssm.Mamba, and its output distance from ours."""
    from mamba_ssm import Mamba

    ours = Stack(a.d_model, a.layers).to(dev)
    theirs = Stack(a.d_model, a.layers, block=Mamba).to(dev)
    theirs.load_state_dict(ours.state_dict())  # same parameter names and shapes
    with torch.no_grad():
        y0, y1 = ours(x), theirs(x)
    rel = float((y0 - y1).norm() / y0.norm())
    w0, _ = time_train(ours, x, ours, a.steps)
    w1, _ = time_train(theirs, x, theirs, a.steps)
    print(f"train d{a.d_model} x{a.layers} B{a.batch} T{a.frames}: ours {w0:.3f} s/step, mamba_ssm "
          f"{w1:.3f} s/step ({w0 / w1:.1f}x); outputs: relative L2 distance {rel:.2e}, "
          f"max |diff| {float((y0 - y1).abs().max()):.2e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--frames", type=int, default=375)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--chunks", default="auto", help="scan chunk sizes to compare; auto = default")
    ap.add_argument("--naive", action="store_true")
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--no-step", action="store_true")
    ap.add_argument("--mamba-ssm", action="store_true", help="also time mamba_ssm.Mamba (CUDA)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tiling", default="", help="scan tiling rules to compare on --device, e.g. cpu,cuda "
                    "(livespeech.models.mamba._TILING); default: the device's own")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dev = torch.device(a.device)
    print(f"torch {torch.__version__}, {a.threads} thread(s), {dev}")

    if not a.no_train:
        x = torch.randn(a.batch, a.frames, a.d_model, device=dev)
        rules = dict(mamba._TILING)
        for rule in a.tiling.split(",") if a.tiling else [dev.type]:
            mamba._TILING[dev.type] = rules[rule]
            for cs in (None if c == "auto" else int(c) for c in a.chunks.split(",")):
                model = Stack(a.d_model, a.layers, chunk_size=cs).to(dev)
                L, bt = mamba.scan_tiling(a.batch, 16 * model.layers[0].d_inner, dev, cs)
                w, c = time_train(model, x, model, a.steps)
                print(f"train d{a.d_model} x{a.layers} B{a.batch} T{a.frames} tiling {rule} (chunk {L}, "
                      f"{bt} rows a tile): {w:.3f} s/step wall, {c:.3f} s/step cpu")
        mamba._TILING.clear()
        mamba._TILING.update(rules)
        if a.mamba_ssm:
            compare_mamba_ssm(a, x, dev)
        if a.naive:
            m = MambaBlock(a.d_model).to(dev)
            _, fast = time_train(m, x, m, a.steps)
            _, naive = time_train(m, x, lambda v: naive_forward(m, v), a.steps)
            print(f"train 1 layer d{a.d_model} B{a.batch} T{a.frames} (cpu s/step): custom scan "
                  f"{fast:.3f}, naive autograd loop {naive:.3f} ({naive / fast:.1f}x)")

    if a.no_step or dev.type != "cpu":
        return
    m = MambaBlock(a.d_model)
    for batch in (1, 16):
        us = time_step(m, batch, 500) * 1e6
        print(f"step d{a.d_model} batch {batch}: {us:.0f} us cpu per layer")


if __name__ == "__main__":
    main()
