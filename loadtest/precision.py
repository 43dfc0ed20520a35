"""How far a lower-precision step moves the model's sampling distributions from the float32 step's.

    python -m livespeech.loadtest.precision --sessions 8 --turns 2 [--arm int8] --json precision.json

`matmul_weights` (server/runner.py) runs the decode step's widest matmuls with bfloat16
or int8 weights: bfloat16 on the CPU from two sessions (`--arm bfloat16`), on a GPU at
every step with the cross-attention's projections and the text memory in bfloat16 too
(`--arm gpu`, run here on the CPU); int8 on the CPU from one session (`--arm int8`, each
call's activations quantised to int8 too; fbgemm); `--arm decoder` measures the whole
decoder converted to bfloat16 instead (not a server setting; docs/loadtest.md). This
measures what that costs in the model's output, teacher-forced along real decodes: the
real engine (no gRPC) speaks `--sessions` x `--turns` turns of built-in sentences in the
bundle's voices, stepping in float32; at every step where the server would use the lower
precision the same step also runs in it from a copy of the recurrent state, and the two
steps' logits are compared row by row (each row one session's grapheme or one acoustic
codebook):

- argmax agreement: the share of rows whose most likely token is the same;
- KL(float32 || lower precision) of the full softmax, in nats;
- total variation between the top-k distributions the sampler draws from (`--top-k`,
  the server's default 20): the least possible share of draws that differ;
- same-draw disagreement: the share of tokens the sampler (`sample_top_k`) picks
  differently from the same uniforms (`--draws` per row). It is far above the total
  variation: the sampler walks the candidates in logit order, and a lower precision reorders
  near-equal ones, so a seeded session's speech is not the same with it on and off
  (nor alone and in a batch), though it comes from nearly the same distributions;
- for scale, the total variation that a sampling temperature of 1.01, 1.02 and 1.05
  (against 1) makes in the float32 step's top-k distributions.

A measurement, not a test: it prints a JSON summary.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import threading
from typing import Any

import torch

from livespeech.models.guidance import sample_top_k

from .profile_step import noise_reference
from .workload import load_sentences

TEMPERATURES = (1.01, 1.02, 1.05)
ARMS = ("bfloat16", "int8", "gpu", "decoder")  # what runs in a lower precision (`measure`)
CPU_ARMS = ("bfloat16", "int8")  # the CPU server's `matmul_weights`


def _row_stats(p32: torch.Tensor, p16: torch.Tensor, top_k: int, draws: int, gen: torch.Generator) -> dict:
    """Per-row comparisons of two [N, V] float logits."""
    logp32, logp16 = p32.log_softmax(-1), p16.log_softmax(-1)
    kl = (logp32.exp() * (logp32 - logp16)).sum(-1)
    k = min(top_k, p32.shape[-1])

    def truncated(logits: torch.Tensor) -> torch.Tensor:
        vals, idx = logits.topk(k, dim=-1)
        return torch.zeros_like(logits).scatter_(-1, idx, vals.softmax(-1))

    base = truncated(p32)
    tv = 0.5 * (base - truncated(p16)).abs().sum(-1)
    tv_temp = {f"tv_temperature_{t}": 0.5 * (base - truncated(p32 / t)).abs().sum(-1) for t in TEMPERATURES}
    n = p32.shape[0]
    gens = [torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=gen))) for _ in range(n)]
    same = [torch.Generator().manual_seed(g.initial_seed()) for g in gens]
    a = sample_top_k(p32.unsqueeze(1).expand(n, draws, -1), k, gens)
    b = sample_top_k(p16.unsqueeze(1).expand(n, draws, -1), k, same)
    return {"agree": (p32.argmax(-1) == p16.argmax(-1)).float(), "kl": kl, "tv": tv,
            "differ": (a != b).float().mean(-1), **tv_temp}


def measure(bundle, sessions: int, turns: int, top_k: int = 20, draws: int = 32, seed: int = 0,
            timeout_s: float = 600.0, arm: str = "bfloat16") -> dict[str, Any]:
    """arm "bfloat16" / "int8": the CPU's `matmul_weights` (the widest matmuls with those
    weights), at the steps where the CPU server uses them (bfloat16 from two sessions,
    int8 from one); "gpu": a GPU's bf16 path (the same plus the cross-attention's
    projections, the text memory in bfloat16: server/runner.py), at every step;
    "decoder": the whole decoder converted to bfloat16 (weights, activations, the conv
    window and the memory; not a server setting), at every step. Each from the float32
    state (rounded to bfloat16 where the arm keeps it so; the SSM state stays float32)."""
    from livespeech.server.engine import Engine, EngineConfig
    from livespeech.api.session import Failed, Finished, SessionConfig

    if arm not in ARMS:
        raise ValueError(f"arm must be one of {', '.join(ARMS)}, got {arm!r}")
    engine = Engine(bundle, EngineConfig(max_sessions=sessions, matmul_weights=arm if arm in CPU_ARMS else "float32"))
    runner = engine.runner
    step = runner.model_step
    bf16 = torch.bfloat16
    low_model = copy.deepcopy(bundle.model).to(bf16) if arm == "decoder" else bundle.model
    min_batch = runner.low_precision_from_batch if arm in CPU_ARMS else 1
    rounded = {"gpu": ("mem_k", "mem_v"), "decoder": ("conv", "mem_k", "mem_v")}.get(arm, ())
    gen = torch.Generator().manual_seed(seed)
    rows: dict[str, list[dict]] = {"graphemes": [], "acoustic": []}
    batches: list[int] = []

    def low_step(inputs, frame, view, mask, phones, kw):
        state = {name: getattr(view, name).clone() for name in ("conv", "ssm")}  # the step writes them
        state.update({name: getattr(view, name).to(bf16) for name in rounded})
        low_view = dataclasses.replace(view, **state)
        if arm in CPU_ARMS:
            return step(inputs, frame, low_view, mask, runner.low_precision, phones=phones, **kw)
        return low_model.step(inputs, frame, low_view, mask, None if arm == "decoder" else bf16, phones=phones)

    def both(inputs, frame, view, mask, dtype=None, phones=None, **kw):
        # the low-precision step from a copy of the recurrent state; the float32 one goes on.
        # kw: what the runner's step takes besides (the native step's voices)
        if inputs.shape[0] < min_batch:
            return step(inputs, frame, view, mask, None, phones=phones, **kw)
        low = low_step(inputs, frame, view, mask, phones, kw)
        out = step(inputs, frame, view, mask, None, phones=phones, **kw)
        batches.append(inputs.shape[0])
        rows["graphemes"].append(_row_stats(out.graphemes.float(), low.graphemes.float(), top_k, draws, gen))
        v = out.acoustic.shape[-1]
        rows["acoustic"].append(_row_stats(out.acoustic.float().reshape(-1, v), low.acoustic.float().reshape(-1, v),
                                           top_k, draws, gen))
        return out

    runner.model_step = both
    corpus = load_sentences(None)
    voices = sorted(bundle.builtin_voices) or [None]
    done = threading.Semaphore(0)
    outcomes: list[str] = []

    def sink(ev) -> None:
        if isinstance(ev, (Finished, Failed)):
            outcomes.append(type(ev).__name__)
            done.release()

    engine.start()
    try:
        handles = {}
        for v in voices:
            audio = bundle.builtin_voices.get(v) if v is not None else None
            if audio is None:
                audio = noise_reference(seed)
            handles[v] = engine.make_voice(f"precision-{v}", audio, 24000)
        for t in range(turns):
            for i in range(sessions):
                s = engine.open_session(SessionConfig(seed=seed + 100 * t + i, guidance_lambda=math.inf, top_k=top_k),
                                        handles[voices[(t * sessions + i) % len(voices)]], sink)
                s.push_text(" ".join(corpus[(7 * (t * sessions + i) + j) % len(corpus)] for j in range(2)))
                s.end_input()
            for _ in range(sessions):
                if not done.acquire(timeout=timeout_s):
                    raise SystemExit("a session did not finish in time")
    finally:
        engine.stop()

    def summary(stats: list[dict]) -> dict:
        out: dict[str, Any] = {"rows": 0}
        for name in ("agree", "kl", "tv", "differ", *(f"tv_temperature_{t}" for t in TEMPERATURES)):
            x = torch.cat([s[name] for s in stats]).double() if stats else torch.zeros(0, dtype=torch.double)
            out["rows"] = int(x.numel())
            if x.numel():
                out[name] = {"mean": x.mean().item(), "p99": x.quantile(0.99).item(), "max": x.max().item()}
        return out

    return {"model": bundle.source, "arm": arm, "sessions": sessions, "turns": turns, "top_k": top_k, "draws_per_row": draws,
            "outcomes": {o: outcomes.count(o) for o in set(outcomes)}, "steps_compared": len(batches),
            "mean_batch": sum(batches) / max(1, len(batches)),
            "graphemes": summary(rows["graphemes"]), "acoustic": summary(rows["acoustic"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m livespeech.loadtest.precision", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="default", help="model directory or random:<preset>[/<codec>]")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--draws", type=int, default=32, help="uniform draws per row for the same-draw disagreement")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arm", choices=ARMS, default="bfloat16",
                    help="bfloat16, int8: the CPU's --matmul-weights; gpu: a GPU's bfloat16 (the attention's "
                         "projections and the text memory in bfloat16 too); decoder: the whole decoder converted to "
                         "bfloat16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from livespeech.models.loading import load_bundle

    bundle = load_bundle(None if args.model_path == "default" else args.model_path)
    result = measure(bundle, args.sessions, args.turns, args.top_k, args.draws, args.seed, arm=args.arm)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
