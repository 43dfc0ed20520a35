"""Load test: N concurrent sessions over real gRPC against a loopback server.

    # one level, against a running server (loopback only)
    python -m livespeech.loadtest.run --target 127.0.0.1:50051 --sessions 8 --duration 30
    # start a server itself, sweep N, compare with the sentence-level baseline, profile
    python -m livespeech.loadtest.run --spawn --model-path random:tiny --sweep 1,2,4,8,16,24,32 \
        --duration 60 --ttfa-bound-ms 1000 --profile
    livespeech loadtest ...                  # the same (the CLI forwards here)

Each session speaks a turn (a few sentences) fed like an LLM (~4-char pieces at
--llm-rate tokens/s with jitter, optional pauses) or, with --paced, like an upstream
that already runs at speech rate (--words-per-s). Every level also runs the
sentence-level baseline (--no-baseline to skip). Results: <out>/result.json,
<out>/report.md and PNG plots; the machine's load average is recorded next to them.

An untrained model (--model-path random:...) follows its text only under hard
guidance, so the sessions then use guidance_lambda=inf (override: --guidance-lambda).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from . import prom
from .driver import SENTENCE, STREAMING, LevelSpec, ensure_voice, jsonable, run_level, session_overrides
from .server_proc import NotLoopback, SpawnedServer, check_loopback, proc_cpu_seconds, split_target
from .sweep import compare_modes, level_verdict, select_rated, should_stop, steps_where_stalls_began
from .workload import Pacing, load_sentences

REPO = Path(__file__).resolve().parent.parent


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="livespeech loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server")
    x = g.add_mutually_exclusive_group(required=True)
    x.add_argument("--target", help="HOST:PORT of a running server (loopback only)")
    x.add_argument("--spawn", action="store_true", help="start a server on 127.0.0.1 for the run")
    g.add_argument("--model-path", default=None,
                   help="--spawn: model directory or random:<preset>[/<codec>] (default: the embedded model)")
    g.add_argument("--device", default="cpu", help="--spawn: cpu | cuda[:N]")
    g.add_argument("--server-threads", type=int, default=0, help="--spawn: torch threads of the server (0: default)")
    g.add_argument("--server-max-sessions", type=int, default=0, help="--spawn: slots (default: the largest N)")
    g.add_argument("--server-cuda-graphs", action="store_true",
                   help="--spawn: the server replays its decode step from a CUDA graph (CUDA devices)")
    g.add_argument("--server-eager-step", action="store_true",
                   help="--spawn: the server runs its CPU decode step eagerly, not as a frozen graph")
    g.add_argument("--server-frozen-step", action="store_true",
                   help="--spawn: the server's CPU decode step as the frozen graph, not the native step")
    g.add_argument("--server-device-guidance", action="store_true",
                   help="--spawn: the server keeps every session's guidance as tensors on its device")
    g.add_argument("--server-engine-processes", type=int, default=-1,
                   help="--spawn: the server's engine processes (0: one per CPU; default: the server's default)")
    g.add_argument("--metrics-port", type=int, default=9464,
                   help="--target: the server's Prometheus port on the same host (0: do not scrape)")
    g.add_argument("--voice", default=None, help="voice id (default: 'default', else a noise voice registered for the run)")

    g = p.add_argument_group("load")
    g.add_argument("--sessions", type=int, default=2, help="concurrent sessions (one level)")
    g.add_argument("--sweep", default=None, help="comma-separated N, e.g. 1,2,4,8,16,24,32 (overrides --sessions)")
    g.add_argument("--duration", type=float, default=30.0, help="seconds per level and mode in which turns start")
    g.add_argument("--max-sessions", type=int, default=0,
                   help="at most this many turns per level and mode (0: four a second of --duration for each of the "
                        "N workers, which turns of a second or more never reach: a cap against turns that fail "
                        "at once, not a limit on the level)")
    g.add_argument("--session-timeout", type=float, default=120.0, help="client deadline per call, seconds")
    g.add_argument("--ramp", type=float, default=1.0, help="worker i starts at i*RAMP/N seconds")
    g.add_argument("--no-baseline", action="store_true", help="skip the sentence-level baseline")
    g.add_argument("--ttfa-bound-ms", type=float, default=1000.0, help="pass: TTFA p95 at most this")
    g.add_argument("--max-failures", type=int, default=2,
                   help="stop the sweep after this many failing levels (0: run every N)")
    g.add_argument("--prebuffer-ms", type=float, default=0.0,
                   help="simulated player starts this long after the first packet (0 = the definition)")
    g.add_argument("--seed", type=int, default=0, help="workload seed (texts, timing); session seeds derive from it")

    g = p.add_argument_group("upstream text")
    g.add_argument("--text-file", default=None, help="sentences from this file (default: built-in list)")
    g.add_argument("--sentences-per-turn", type=int, default=2)
    g.add_argument("--llm-rate", type=float, default=40.0, help="LLM tokens (pieces) per second")
    g.add_argument("--piece-chars", type=int, default=4)
    g.add_argument("--jitter", type=float, default=0.3, help="relative jitter of each gap")
    g.add_argument("--pause-prob", type=float, default=0.0, help="probability of a pause after a piece")
    g.add_argument("--pause-ms", type=float, default=0.0, help="length of such a pause")
    g.add_argument("--paced", action="store_true", help="send words at speech rate instead of LLM pieces")
    g.add_argument("--words-per-s", type=float, default=2.5)

    g = p.add_argument_group("session config")
    g.add_argument("--packet-ms", type=int, default=80)
    g.add_argument("--start-future-chunks", type=int, default=None,
                   help="start policy (server default 1; = --nf for the paper's: wait for nf chunks)")
    g.add_argument("--min-packet-ms", type=int, default=None,
                   help="shortest early packet (server default 20; = --packet-ms for fixed-size packets)")
    g.add_argument("--np", dest="n_past", type=int, default=4)
    g.add_argument("--nf", dest="n_future", type=int, default=2)
    g.add_argument("--baseline-nf", type=int, default=None, help="nf of the baseline calls (default: --nf)")
    g.add_argument("--guidance-lambda", type=float, default=None,
                   help="default: inf for random:* models (untrained), else the server's default")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--session-seed", type=int, default=None, help="fixed sampling seed (default: per turn)")

    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="output directory (default runs/loadtest/<UTC time>)")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--profile", action="store_true",
                   help="--spawn: after the sweep, profile the decode step at batch 1 and the rated N")
    g.add_argument("--profile-steps", type=int, default=200)
    g.add_argument("--profile-batch", type=int, nargs="+", default=None,
                   help="batches to profile (default: 1 and the rated N, else the largest N tested)")
    g.add_argument("--quiet", action="store_true")
    return p


def host_info() -> dict:
    info: dict[str, Any] = {"nproc": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    info["loadavg_start"] = list(os.getloadavg())
    return info


def git_info() -> dict:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return {"commit": git("rev-parse", "--short", "HEAD") or None, "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {}


def cpu_steal_seconds() -> Optional[float]:
    """CPU seconds the hypervisor ran something else while this VM's CPUs were ready to
    run, summed over the CPUs since boot (Linux /proc/stat: the `cpu` line's steal field);
    None where unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class StealSampler:
    """The host's CPU steal through a level, read every `period_s` on a thread of its own:
    a VM's stalls that no server change explains show here. `stop()` gives the total,
    the worst second and the intervals that had any (at the end of each, on the clock
    of the turns' `t_start`), or None where the host does not count steal."""

    def __init__(self, period_s: float = 0.25, read=cpu_steal_seconds, clock=time.monotonic):
        self.period_s, self._read, self._clock = period_s, read, clock
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loadtest-steal", daemon=True)

    def start(self) -> "StealSampler":
        self._sample()
        self._thread.start()
        return self

    def _sample(self) -> None:
        v = self._read()
        if v is not None:
            self._samples.append((self._clock(), v))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def stop(self) -> Optional[dict]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sample()
        return steal_summary(self._samples)


def steal_summary(samples: list[tuple[float, float]]) -> Optional[dict]:
    """(time, cumulative steal seconds) readings -> the steal between the first and last,
    the most within any one second (intervals ending within a second of one another) and
    the intervals with any steal as [end time, steal seconds]."""
    if len(samples) < 2:
        return None
    deltas = [(t1, v1 - v0) for (_, v0), (t1, v1) in zip(samples, samples[1:])]
    worst, lo, window = 0.0, 0, 0.0
    for t, d in deltas:
        window += d
        while deltas[lo][0] <= t - 1.0:
            window -= deltas[lo][1]
            lo += 1
        worst = max(worst, window)
    return {"steal_s": samples[-1][1] - samples[0][1], "worst_second_s": worst,
            "intervals": [[round(t, 3), round(d, 3)] for t, d in deltas if d > 0]}


def is_noisy(loadavg_1m: float, nproc: int) -> bool:
    """Background load before the run: more than a few tenths of a CPU busy elsewhere."""
    return loadavg_1m > max(0.5, 0.15 * nproc)


def parse_sweep(s: Optional[str], sessions: int) -> list[int]:
    if not s:
        return [sessions]
    ns = sorted({int(v) for v in s.replace(" ", "").split(",") if v})
    if not ns or ns[0] < 1:
        raise ValueError("--sweep needs positive integers")
    return ns


def turn_cap(max_sessions: int, n: int, duration_s: float) -> int:
    """Turns a level may start: `max_sessions`, or (0) four a second for each of its N
    workers, more than workers whose turns last a second or more can start, so the level
    keeps N sessions to its end (a fixed 500 runs out after two turns a worker at 256
    sessions: 8 s into a 20 s level of 4 s turns), while turns that fail at once still stop."""
    return max_sessions or 4 * n * max(1, math.ceil(duration_s))


def _cpu_self() -> float:
    t = os.times()
    return t.user + t.system


async def _wait_idle(url: Optional[str], timeout_s: float = 10.0) -> None:
    if not url:
        await asyncio.sleep(0.5)
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            snap = await asyncio.to_thread(prom.scrape, url)
            if snap.scalar(prom.PREFIX + "active_sessions", 0.0) <= 0:
                return
        except OSError:
            return
        await asyncio.sleep(0.1)


async def _scrape(url: Optional[str]) -> Optional[prom.Snapshot]:
    if not url:
        return None
    try:
        return await asyncio.to_thread(prom.scrape, url)
    except OSError as e:
        print(f"loadtest: cannot scrape {url}: {e}", file=sys.stderr)
        return None


async def _engine_timeline(url: str, stop: asyncio.Event, period_s: float = 0.5) -> list[list]:
    """The engine's steps through a level, from its metrics every `period_s` until `stop`:
    an interval a row, [its end (the clock of the turns' `t_start`), steps, seconds in
    steps, mean batch, seconds in codec calls]. Stalls where the steps thin out are the
    engine held up; with as many steps each slower, a slower core."""
    rows: list[list] = []
    prev = await _scrape(url)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), period_s)
        except asyncio.TimeoutError:
            pass
        snap, t = await _scrape(url), time.monotonic()
        if snap is not None and prev is not None:
            d = prom.delta(prev, snap).histograms
            step, batch, codec = (d.get(prom.PREFIX + n) for n in ("step_seconds", "batch_size", "codec_decode_seconds"))
            rows.append([round(t, 3), step.count if step else 0, round(step.sum, 4) if step else 0.0,
                         round(batch.mean, 2) if batch and batch.mean is not None else None,
                         round(codec.sum, 4) if codec else 0.0])
        prev = snap
    return rows


async def measure_level(client, spec: LevelSpec, metrics_url: Optional[str], server_pid: Optional[int],
                        ttfa_bound_s: float) -> dict:
    await _wait_idle(metrics_url)
    before = await _scrape(metrics_url)
    la0, cpu0, self0 = list(os.getloadavg()), proc_cpu_seconds(server_pid), _cpu_self()
    steal = StealSampler().start()
    stop = asyncio.Event()
    timeline = asyncio.create_task(_engine_timeline(metrics_url, stop)) if metrics_url else None
    level = await run_level(client, spec)
    stop.set()
    level["host_steal"] = steal.stop()
    level["engine_timeline"] = await timeline if timeline is not None else None
    await _wait_idle(metrics_url)
    after = await _scrape(metrics_url)
    cpu1 = proc_cpu_seconds(server_pid)
    level["loadavg"] = {"start": la0, "end": list(os.getloadavg())}
    level["server_cpu_s"] = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    level["loadtest_cpu_s"] = _cpu_self() - self0
    level["server"] = prom.engine_summary(prom.delta(before, after), level["wall_s"]) if after is not None else None
    if spec.mode == STREAMING:
        level["passed"], level["fail_reasons"] = level_verdict(level["client"], ttfa_bound_s)
        level["stall_steps"] = steps_where_stalls_began(level["records"], level["engine_timeline"])
    return level


def _print_level(lv: dict) -> None:
    c, s = lv["client"], lv.get("server") or {}
    t = c["ttfa_user_s"]

    def ms(v: Optional[float]) -> str:
        return "-" if v is None else f"{1000 * v:.0f}"

    step = (s.get("step_seconds") or {}).get("mean")
    batch = (s.get("batch_size") or {}).get("mean")
    verdict = "" if "passed" not in lv else ("  PASS" if lv["passed"] else "  FAIL: " + "; ".join(lv["fail_reasons"]))
    print(f"  {lv['mode']:9s} N={lv['n']:<3d} sessions {c['sessions']:3d} err {c['errors']} "
          f"TTFA p50/p95 {ms(t['p50'])}/{ms(t['p95'])} ms  underruns {c['underruns']} "
          f"(starved {ms(c['starved_s'])} ms)  step {ms(step) if step is None else f'{1000 * step:.1f}'} ms "
          f"batch {'-' if batch is None else f'{batch:.1f}'}  load {lv['loadavg']['start'][0]:.1f}"
          f"{_steal_text(lv.get('host_steal'))}{verdict}",
          flush=True)


def _steal_text(steal: Optional[dict]) -> str:
    if not steal:
        return ""
    return f"  steal {1000 * steal['steal_s']:.0f} ms (worst s {1000 * steal['worst_second_s']:.0f})"


async def _run(args: argparse.Namespace, result: dict, target: str, metrics_url: Optional[str],
               server_pid: Optional[int]) -> None:
    from livespeech.client.client import AsyncLiveSpeechClient

    ns = result["sweep"]["requested_n"]
    pacing = Pacing(**result["workload"]["pacing"]).validate()
    corpus = load_sentences(args.text_file)
    bound = args.ttfa_bound_ms / 1000.0
    async with AsyncLiveSpeechClient(target) as client:
        voice_id, registered = await ensure_voice(client, args.voice)
        result["workload"]["voice_id"] = voice_id
        lam = result["workload"]["guidance_lambda"]
        base_cfg = dict(voice_id=voice_id, packet_ms=args.packet_ms, min_packet_ms=args.min_packet_ms,
                        start_future_chunks=args.start_future_chunks,
                        n_past=args.n_past, n_future=args.n_future,
                        guidance_lambda=lam, top_k=args.top_k, seed=args.session_seed)
        cfg = session_overrides(**base_cfg)
        bcfg = session_overrides(**{**base_cfg, "n_past": -1,
                                    "n_future": args.n_future if args.baseline_nf is None else args.baseline_nf})
        result["workload"]["config"] = jsonable(cfg)
        result["workload"]["baseline_config"] = jsonable(bcfg)
        try:
            streaming_levels: list[dict] = []
            for n in ns:
                for mode in (STREAMING,) if args.no_baseline else (STREAMING, SENTENCE):
                    spec = LevelSpec(n=n, mode=mode, duration_s=args.duration,
                                     max_sessions=turn_cap(args.max_sessions, n, args.duration),
                                     corpus=corpus, sentences_per_turn=args.sentences_per_turn, pacing=pacing,
                                     config=cfg, baseline_config=bcfg, session_timeout_s=args.session_timeout,
                                     ramp_s=args.ramp, seed=args.seed, prebuffer_s=args.prebuffer_ms / 1000.0)
                    lv = await measure_level(client, spec, metrics_url, server_pid, bound)
                    result["levels"].append(lv)
                    if not args.quiet:
                        _print_level(lv)
                    if mode == STREAMING:
                        streaming_levels.append(lv)
                if should_stop(streaming_levels, args.max_failures) and n != ns[-1]:
                    print(f"loadtest: stopping the sweep after {args.max_failures} failing level(s)", flush=True)
                    break
        finally:
            if registered:
                try:
                    await client.delete_voice(voice_id)
                except Exception:  # noqa: BLE001 - best effort
                    pass


def finalize(result: dict) -> None:
    """Sweep selection and baseline ratios from the levels."""
    stream = [lv for lv in result["levels"] if lv["mode"] == STREAMING]
    sentence = {lv["n"]: lv for lv in result["levels"] if lv["mode"] == SENTENCE}
    result["sweep"].update(select_rated([{"n": lv["n"], "passed": lv["passed"]} for lv in stream]))
    result["sweep"]["comparison"] = [
        {"n": lv["n"], **compare_modes(lv["client"], sentence[lv["n"]]["client"])} for lv in stream if lv["n"] in sentence
    ]


def profile_batches(args: argparse.Namespace, sweep: dict) -> list[int]:
    """Batch 1 and the rated N (or, when no level passed, the largest N tested)."""
    if args.profile_batch:
        return sorted(set(args.profile_batch))
    loaded = sweep.get("rated_n") or max(sweep.get("tested_n") or [1])
    return sorted({1, loaded})


def step_paths(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The spawned server's step paths (`--server-cuda-graphs`, `--server-eager-step`,
    `--server-frozen-step`, `--server-device-guidance`) as the server's flags and as
    profile_step's, so that the profile after a sweep steps as the server did."""
    server: list[str] = []
    profile: list[str] = []
    for on, server_flag, profile_flag in ((args.server_cuda_graphs, ["--cuda-graphs", "true"], "--cuda-graphs"),
                                          (args.server_eager_step, ["--frozen-step", "false"], "--eager-step"),
                                          (args.server_frozen_step, ["--native-step", "false"], "--no-native-step"),
                                          (args.server_device_guidance, ["--device-guidance", "true"],
                                           "--device-guidance")):
        if on:
            server += server_flag
            profile.append(profile_flag)
    return server, profile


def run_profile(args: argparse.Namespace, out: Path, batches: list[int]) -> Optional[dict]:
    cmd = [sys.executable, "-m", "livespeech.loadtest.profile_step", "--steps", str(args.profile_steps),
           "--json", str(out / "profile.json"), "--batch", *map(str, batches), *step_paths(args)[1]]
    cmd += ["--model-path", args.model_path or "default"]  # the same model the server ran
    if args.device:
        cmd += ["--device", args.device]
    if args.server_threads:
        cmd += ["--threads", str(args.server_threads)]
    print("loadtest: " + shlex.join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=REPO)
    if r.returncode != 0 or not (out / "profile.json").exists():
        print("loadtest: the step profile failed", file=sys.stderr)
        return None
    return json.loads((out / "profile.json").read_text())


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        ns = parse_sweep(args.sweep, args.sessions)
        pacing = Pacing(mode="paced" if args.paced else "llm", llm_rate=args.llm_rate, piece_chars=args.piece_chars,
                        words_per_s=args.words_per_s, jitter=args.jitter, pause_prob=args.pause_prob,
                        pause_ms=args.pause_ms).validate()
        load_sentences(args.text_file)
        if args.target:
            check_loopback(args.target)
            if args.model_path:
                raise ValueError("--model-path is for --spawn (the target server has its own model)")
        if args.profile and not args.spawn:
            raise ValueError("--profile needs --spawn (it profiles the same model in a separate process)")
    except (NotLoopback, ValueError, OSError) as e:
        print(f"loadtest: {e}", file=sys.stderr)
        return 2

    out = Path(args.out) if args.out else REPO / "runs" / "loadtest" / dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    lam = args.guidance_lambda
    if lam is None and args.spawn and str(args.model_path or "").startswith("random:"):
        lam = math.inf  # an untrained model speaks its text only under hard guidance
    host = host_info()
    result: dict[str, Any] = {
        "schema": "livespeech-loadtest/1",
        "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m livespeech.loadtest.run " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "host": host,
        "noisy": is_noisy(host["loadavg_start"][0], host.get("nproc") or 1),
        "git": git_info(),
        "server": {"mode": "spawn" if args.spawn else "target", "model_path": args.model_path, "device": args.device,
                   "torch_threads": args.server_threads},
        "workload": {
            "pacing": pacing.__dict__, "sentences_per_turn": args.sentences_per_turn,
            "text_source": args.text_file or "built-in", "duration_s": args.duration,
            "max_sessions": args.max_sessions, "ramp_s": args.ramp, "seed": args.seed,
            "guidance_lambda": lam, "prebuffer_s": args.prebuffer_ms / 1000.0,
        },
        "criteria": {"ttfa_bound_s": args.ttfa_bound_ms / 1000.0, "ttfa": "client: first upstream piece -> first packet",
                     "underruns": 0, "errors": 0},
        "sweep": {"requested_n": ns},
        "levels": [],
    }
    if result["noisy"]:
        print(f"loadtest: load average {host['loadavg_start']} on {host.get('nproc')} CPUs: the machine is busy, "
              "timings will be noisy (recorded in the result)", file=sys.stderr)

    server: Optional[SpawnedServer] = None
    rc = 0
    try:
        if args.spawn:
            server = SpawnedServer(args.model_path, max_sessions=args.server_max_sessions or max(ns),
                                   log_path=out / "server.log", device=args.device, torch_threads=args.server_threads,
                                   extra_args=step_paths(args)[0]
                                   + (["--engine-processes", str(args.server_engine_processes)]
                                      if args.server_engine_processes >= 0 else []))
            t = time.monotonic()
            server.start()
            target, metrics_url, pid = server.target, server.metrics_url, server.pid
            result["server"].update(target=target, metrics_url=metrics_url, startup_s=time.monotonic() - t,
                                    max_sessions=server.max_sessions, command=shlex.join(server.command()))
        else:
            target, pid = args.target, None
            host_, _ = split_target(args.target)
            metrics_url = f"http://{host_ if ':' not in host_ else '[' + host_ + ']'}:{args.metrics_port}/metrics" \
                if args.metrics_port else None
            result["server"].update(target=target, metrics_url=metrics_url)
        if not args.quiet:
            print(f"loadtest: {target} N={ns} {args.duration:g} s/level -> {out}", flush=True)
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:
            loop_factory = None
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(_run(args, result, target, metrics_url, pid))
    except KeyboardInterrupt:
        print("loadtest: interrupted; writing what was measured", file=sys.stderr)
        rc = 130
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"loadtest: {e}", file=sys.stderr)
        rc = 1
    except Exception as e:  # noqa: BLE001 - e.g. grpc.RpcError: the server is not there
        import grpc

        if not isinstance(e, grpc.RpcError):
            raise
        print(f"loadtest: {target}: {e.code().name if hasattr(e, 'code') else ''} {getattr(e, 'details', lambda: e)()}",
              file=sys.stderr)
        rc = 1
    finally:
        if server is not None:
            server.stop()
    result["host"]["loadavg_end"] = list(os.getloadavg())
    if result["levels"]:
        finalize(result)
        if args.profile and rc == 0:
            result["profile"] = run_profile(args, out, profile_batches(args, result["sweep"]))
    (out / "result.json").write_text(json.dumps(jsonable(result), indent=1))
    report = None
    if result["levels"]:
        try:
            from .report import write_report

            report = write_report(jsonable(result), out, plots=not args.no_plots)
        except Exception as e:  # noqa: BLE001 - the JSON is what matters
            print(f"loadtest: report failed: {type(e).__name__}: {e}", file=sys.stderr)
    if not args.quiet:
        sw = result["sweep"]
        if "rated_n" in sw:
            print(f"loadtest: rated N = {sw['rated_n']} (TTFA p95 <= {args.ttfa_bound_ms:g} ms, zero underruns)")
        print(f"loadtest: wrote {out / 'result.json'}" + (f" and {report}" if report else ""))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
