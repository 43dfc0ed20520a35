"""Decode-step timings of a model preset (random weights): model.step alone, then
sampling + commit, then the codec decode of one packet, at several batch sizes.

    python -m livespeech.loadtest.bench_step --preset tiny --threads 1 --batch 1 16
    python -m livespeech.loadtest.bench_step --roofline --batch 1 16   # + the step's bound on this machine
    python -m livespeech.loadtest.bench_step --guidance-only --batch 1 16 64   # guidance alone
    python -m livespeech.loadtest.bench_step --first-calls --batch 1 2 3 4 8 16   # a batch size's first step
    python -m livespeech.loadtest.bench_step --gaps 15/16 12/16 8/15 2/4   # batches with sessions sitting out
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from livespeech.models.config import FRAME_RATE
from livespeech.models.loading import load_bundle
from livespeech.models.scripted import kernel_fusion

from .profile_step import add_path_arguments, analytic_cost, measure_machine, model_step_cost, noise_reference, roofline


def bench(fn, n: int) -> float:
    """The median seconds of `n` calls of `fn` (after a few unmeasured), each up to the end
    of the device work it queued: on a GPU a call returns once its kernels are queued."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(max(3, n // 10)):
        fn()
    ts = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def guidance_cost(batch: int, steps: int, device: str) -> dict:
    """One step's guiding sets and observation for `batch` sessions reading a text with
    slips: per session in Python (`GuidanceState`) and for all as tensors (`GuidanceBatch`)."""
    import random

    from livespeech.models.graphemes import text_to_ids
    from livespeech.models.guidance import GuidanceState
    from livespeech.models.guidance_batch import GuidanceBatch

    text = text_to_ids("the quick brown fox jumps over the lazy dog " * 20)
    rng = random.Random(0)
    frames = [[text[min(max(t // 3 + rng.randint(-1, 1), 0), len(text) - 1)] for t in range(steps + 20)]
              for _ in range(batch)]
    states = [GuidanceState(text) for _ in range(batch)]
    tensors = GuidanceBatch(batch, ring=4096, device=device)
    tensors.extend({s: text for s in range(batch)})
    idx = torch.arange(batch, device=device)
    # bench() calls a function up to steps + 20 times: each call takes the next frame
    python_frames = iter(list(zip(*frames)))
    tensor_frames = iter([torch.tensor(col, device=device) for col in zip(*frames)])

    def python_step():
        for st, g in zip(states, next(python_frames)):
            st.guiding_set()
            st.observe(g)

    def tensor_step():
        tensors.guide(idx)
        tensors.observe(idx, next(tensor_frames))
        if tensors.device.type == "cuda":
            torch.cuda.synchronize()

    t_python, t_tensor = bench(python_step, steps), bench(tensor_step, steps)
    return {"batch": batch, "guidance_python_ms": t_python * 1e3, "guidance_tensors_ms": t_tensor * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--codec", default="small")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cuda-graphs", action="store_true", help="the model step replayed from a CUDA graph")
    ap.add_argument("--compile-step", action="store_true",
                    help="the CUDA graphs record the step compiled by torch.compile (ServerConfig.compile_step)")
    ap.add_argument("--eager-step", action="store_true", help="the eager model step on the CPU (default: frozen graph)")
    ap.add_argument("--device-guidance", action="store_true",
                    help="every slot's guidance as tensors on the device (ServerConfig.device_guidance)")
    ap.add_argument("--first-calls", action="store_true",
                    help="one runner for the largest batch; each batch size's first whole step against its next ones "
                         "(what a server pays as its batch grows to sizes it has not run)")
    ap.add_argument("--gaps", nargs="+", metavar="K/N", default=None,
                    help="batches of K sessions spread over a run of N slots (others sitting out): the whole "
                         "runner step with the run stepped as a slice (the runner's choice up to its "
                         "span_max_rows_per_session) against the batch gathered, alternated")
    ap.add_argument("--text-tokens", type=int, default=12,
                    help="tokens of text in each session's memory, all in the window its steps read")
    ap.add_argument("--jit-fuser", action="store_true",
                    help="keep TorchScript's fused kernels on CUDA (the runner turns them off: models/scripted.py)")
    ap.add_argument("--roofline", action="store_true",
                    help="measure this machine's gemm and memcpy rates first, and give each row the model step's "
                         "bound (max of FLOPs over gemm, bytes over memcpy: profile_step's cost model) and the "
                         "model and whole runner steps over it")
    ap.add_argument("--guidance-only", action="store_true",
                    help="time the guidance alone: per session in Python against all slots as tensors")
    add_path_arguments(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.guidance_only:
        for b in args.batch:
            print(json.dumps(guidance_cost(b, args.steps, args.device)))
        return 0
    from livespeech.server.runner import codec_runtime, matmul_weights

    bundle = load_bundle(random_init=True, model_preset=args.preset, codec_preset_name=args.codec, device=args.device)
    out = {"preset": args.preset, "threads": args.threads, "device": args.device,
           "cuda_graphs": args.cuda_graphs, "compile_step": args.compile_step, "device_guidance": args.device_guidance,
           "frozen_step": None, "rows": [],
           "matmul_weights": matmul_weights(args.matmul_weights, args.device),
           "codec_runtime": codec_runtime(args.codec_runtime, args.device)}
    if args.roofline:
        out["machine"] = measure_machine(bundle.device, weights=out["matmul_weights"])
        out["analytic"] = analytic_cost(bundle.model, cuda=bundle.device.type == "cuda")
        print(json.dumps({"machine": out["machine"]}))
    rows = (first_call_rows(bundle, args, out) if args.first_calls else gap_rows(bundle, args, out) if args.gaps
            else step_cost_rows(bundle, args, out))
    for row in rows:
        out["rows"].append(row)
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def step_cost_rows(bundle, args, out: dict):
    """Per batch size (a runner of its own): the model step, the whole runner step and a
    codec packet, each the median of --steps calls."""
    for b in args.batch:
        t0 = time.perf_counter()
        runner, guides = runner_with_sessions(bundle, args, out, b)
        setup_s = time.perf_counter() - t0
        slots = list(range(b))
        st = runner.state
        low = b >= runner.low_precision_from_batch  # the step runs the lower-precision weights
        with torch.inference_mode():
            def model_only():
                view = st.view(slots)
                mask = st.window_mask(view, [0] * b, [0] * b)
                if runner.captured is not None:
                    runner.captured(slots, view.inputs, view.step, mask)
                else:
                    runner.model_step(view.inputs, view.step, view, mask, runner.low_precision if low else None)
            t_model = bench(model_only, args.steps)
            def full_step():
                runner.step(slots, [(0, 0)] * b, guides, [False] * b)
            t_full = bench(full_step, args.steps)
            pf = runner.steady_packet_frames  # (the streams' first call pads it where it is short)
            frames = [[[1] * bundle.model.cfg.n_acoustic_codebooks] * pf] * b
            t_codec = bench(lambda: runner.decode(slots, frames), max(10, args.steps // 5))
        row = {
            "batch": b, "runner_setup_s": round(setup_s, 2), "model_step_ms": t_model * 1e3, "full_step_ms": t_full * 1e3,
            "codec_packet_frames": pf, "codec_packet_ms": t_codec * 1e3,
            "per_frame_ms": (t_full + t_codec / pf) * 1e3,
            "realtime_sessions_bound": b * (1000 / FRAME_RATE) / ((t_full + t_codec / pf) * 1e3),
        }
        if "machine" in out:  # --roofline: the model step's bound on this machine, and the steps against it
            m = model_step_cost(out["analytic"], b, out["matmul_weights"] if low else "float32")
            bound = roofline(m["flops"], m["bytes"], t_model, out["machine"], m["low_flops"])
            row.update(step_bound_ms=max(bound["t_flops_ms"], bound["t_bytes_ms"]), step_bytes_mb=bound["mbytes"],
                       step_gflop=bound["gflop"], model_step_over_bound=1 / bound["roofline_fraction"],
                       full_step_over_bound=t_full * 1e3 / max(bound["t_flops_ms"], bound["t_bytes_ms"]))
        yield row


def runner_with_sessions(bundle, args, out: dict, capacity: int):
    """A runner of `capacity` slots, each holding a session with a text chunk of
    --text-tokens tokens in memory; returns it and the sessions' guidance."""
    from livespeech.models import graphemes
    from livespeech.models.guidance import GuidanceState
    from livespeech.server.runner import ModelRunner

    runner = ModelRunner(bundle, capacity, cuda_graphs=args.cuda_graphs, compile_step=args.compile_step,
                         frozen_step=not args.eager_step,
                         matmul_weights=out["matmul_weights"], codec_runtime=out["codec_runtime"],
                         device_guidance=args.device_guidance)
    out["frozen_step"] = runner.frozen
    # torch.compile's step in use (the runner falls back to the uncompiled one where it fails)
    out["compiled_step"] = runner.captured is not None and runner.captured.compiled
    # the graphs record the sampling and commit too: model_step_ms is then that whole replay
    out["graph_samples"] = runner.captured is not None and runner.captured.after is not None
    if args.jit_fuser:
        kernel_fusion(True)
    out["jit_fuser"] = args.jit_fuser
    voice = runner.make_voice("v", noise_reference(), 24000)
    guides = []
    for s in range(capacity):
        text = GuidanceState(graphemes.text_to_ids("hello world this is a test " * 40))
        guides.append(runner.admit(s, voice, seed=s, guidance=text))
        runner.add_chunk(s, list(range(100, 100 + args.text_tokens)), 0, 0)
    return runner, guides


def first_call_rows(bundle, args, out: dict):
    """Each batch size's first runner step, in the order given, against the median of its
    next five: a server's batch grows through sizes it has not stepped yet."""
    runner, guides = runner_with_sessions(bundle, args, out, max(args.batch))

    def step(b: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():  # the step's results come back to the host: it waits for the device
            runner.step(list(range(b)), [(0, 0)] * b, guides[:b], [False] * b)
        return time.perf_counter() - t

    for b in args.batch:
        first = step(b)
        yield {"batch": b, "first_step_ms": first * 1e3,
               "next_steps_ms": statistics.median(step(b) for _ in range(5)) * 1e3}


def gap_rows(bundle, args, out: dict):
    """Per K/N of `--gaps`: K sessions spread over slots 0..N-1 of one runner (the first and
    the last among them), the whole runner step with their run stepped as a slice of the
    state and with the batch gathered, alternated five times (medians of --steps each)."""
    specs = [tuple(map(int, spec.split("/"))) for spec in args.gaps]
    if any(not 1 < k <= n for k, n in specs):
        raise SystemExit("--gaps: each K/N needs 1 < K <= N")
    runner, guides = runner_with_sessions(bundle, args, out, max(n for _, n in specs))
    spanning = runner.span_max_rows_per_session
    for k, n in specs:
        slots = sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})
        times: dict[str, list[float]] = {"run_ms": [], "gathered_ms": []}
        for rep in range(5):
            for key in (("run_ms", "gathered_ms") if rep % 2 else ("gathered_ms", "run_ms")):
                runner.span_max_rows_per_session = 0.0 if key == "gathered_ms" else math.inf
                with torch.inference_mode():
                    times[key].append(1e3 * bench(lambda: runner.step(
                        slots, [(0, 0)] * len(slots), [guides[s] for s in slots], [False] * len(slots)), args.steps))
        yield {"sessions": len(slots), "run": n, "slots": slots,
               **{key: statistics.median(v) for key, v in times.items()},
               "run_over_gathered": statistics.median(a / b for a, b in zip(times["run_ms"], times["gathered_ms"])),
               "runner_chooses": "run" if n <= spanning * len(slots) else "gathered"}

if __name__ == "__main__":
    raise SystemExit(main())
