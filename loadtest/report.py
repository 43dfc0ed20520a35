"""Markdown report and PNG plots of a load-test result (result.json).

    python -m livespeech.loadtest.report runs/loadtest/<stamp>/result.json   # re-render

Plots need matplotlib (`pip install matplotlib`); without it the report is text only.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

from .driver import SENTENCE, STREAMING
from .sweep import stall_positions, steps_where_stalls_began


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def _f(v: Optional[float], fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _get(d: Optional[dict], *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


def levels_by_mode(result: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {STREAMING: [], SENTENCE: []}
    for lv in result.get("levels", []):
        out.setdefault(lv["mode"], []).append(lv)
    for v in out.values():
        v.sort(key=lambda x: x["n"])
    return out


# ------------------------------------------------------------------ plots


def _cdf(ax, values: list[float], style: str, **kw) -> None:
    xs = sorted(values)
    if xs:
        ax.step([xs[0]] + xs, [0.0] + [(i + 1) / len(xs) for i in range(len(xs))], style, where="post", **kw)


def make_plots(result: dict, out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir = Path(out_dir)
    files: list[str] = []
    by = levels_by_mode(result)
    bound = result.get("criteria", {}).get("ttfa_bound_s")

    # 1. latency CDFs: user TTFA per N (streaming solid, sentence dashed), server TTFA parts
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    cmap = plt.get_cmap("viridis")
    ns = sorted({lv["n"] for lv in result.get("levels", [])})
    color = {n: cmap(i / max(1, len(ns) - 1)) for i, n in enumerate(ns)}
    for mode, style in ((STREAMING, "-"), (SENTENCE, "--")):
        for lv in by.get(mode, []):
            _cdf(axes[0], [1000 * r["ttfa_user_s"] for r in lv["records"] if r.get("ttfa_user_s") is not None],
                 style, color=color[lv["n"]], label=f"{mode} N={lv['n']}")
    if bound:
        axes[0].axvline(1000 * bound, color="red", lw=0.8, ls=":", label="bound")
    axes[0].set_title("TTFA (first token -> first audio, client)")
    for ax, key, title in ((axes[1], "lookahead_wait_s", "lookahead wait (server, streaming)"),
                           (axes[2], "compute_fpl_s", "compute FPL (server, streaming)")):
        for lv in by.get(STREAMING, []):
            _cdf(ax, [1000 * r[key] for r in lv["records"] if r.get(key) is not None], "-", color=color[lv["n"]],
                 label=f"N={lv['n']}")
        ax.set_title(title)
    for ax in axes:
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of sessions")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "latency_cdf.png", dpi=110)
    plt.close(fig)
    files.append("latency_cdf.png")

    # 2. TTFA and underruns vs N
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for mode, style in ((STREAMING, "o-"), (SENTENCE, "s--")):
        lvs = by.get(mode, [])
        if not lvs:
            continue
        n = [lv["n"] for lv in lvs]
        for q, alpha in (("p50", 0.5), ("p95", 1.0)):
            y = [_get(lv, "client", "ttfa_user_s", q) for lv in lvs]
            a1.plot(n, [1000 * v if v is not None else float("nan") for v in y], style, alpha=alpha,
                    label=f"{mode} {q}")
        a2.plot(n, [_get(lv, "client", "underruns") or 0 for lv in lvs], style, label=f"{mode} underruns")
        a2.plot(n, [1000 * (_get(lv, "client", "starved_s") or 0) / max(1, _get(lv, "client", "sessions") or 1)
                    for lv in lvs], style, alpha=0.4, label=f"{mode} starved ms / session")
    if bound:
        a1.axhline(1000 * bound, color="red", lw=0.8, ls=":", label="bound")
    rated = _get(result, "sweep", "rated_n")
    for ax in (a1, a2):
        if rated:
            ax.axvline(rated, color="green", lw=0.8, ls=":", label=f"rated N={rated}")
        ax.set_xlabel("concurrent sessions N")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    a1.set_ylabel("TTFA ms")
    a1.set_title("TTFA vs N")
    a2.set_title("underruns vs N")
    a2.set_yscale("symlog")
    fig.tight_layout()
    fig.savefig(out_dir / "ttfa_underruns_vs_n.png", dpi=110)
    plt.close(fig)
    files.append("ttfa_underruns_vs_n.png")

    # 3. step time, batch size, engine busy vs N (server metrics)
    lvs = [lv for lv in by.get(STREAMING, []) if lv.get("server")]
    if lvs:
        fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4.5))
        n = [lv["n"] for lv in lvs]

        def series(*path: str, scale: float = 1.0) -> list[float]:
            return [(v * scale if (v := _get(lv, "server", *path)) is not None else float("nan")) for lv in lvs]

        a1.plot(n, series("step_seconds", "mean", scale=1000), "o-", label="step mean")
        a1.plot(n, series("step_seconds", "p95", scale=1000), "o--", label="step p95 (bucketed)")
        a1.plot(n, series("codec_decode_seconds", "mean", scale=1000), "s-", alpha=0.6, label="codec decode mean")
        a1.axhline(1000 / 75, color="red", lw=0.8, ls=":", label="13.3 ms (1 frame)")
        a1.set_ylabel("ms")
        a1.set_title("decode step time vs N")
        a2.plot(n, series("batch_size", "mean"), "o-", label="mean batch")
        a2.plot(n, n, ":", color="gray", label="N")
        a2.set_title("batch size vs N")
        a3.plot(n, series("engine_busy_fraction"), "o-", label="engine busy (step+codec)/wall")
        a3.plot(n, series("machine_rtf"), "s-", label="machine RTF (engine s / audio s)")
        a3.plot(n, series("rtf_per_session", "mean"), "^-", label="per-session RTF mean")
        a3.set_title("saturation vs N")
        for ax in (a1, a2, a3):
            ax.set_xlabel("concurrent sessions N")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "step_batch_vs_n.png", dpi=110)
        plt.close(fig)
        files.append("step_batch_vs_n.png")
    return files


# ------------------------------------------------------------------ markdown


def _stall_steps_text(st: Optional[dict]) -> str:
    """The engine's steps where stalls began against the level's (sweep.steps_where_stalls_began)."""
    if not st or not st.get("where_stalls_began"):
        return ""
    hit, lv = st["where_stalls_began"], st["level"]
    return (f"; stalls began in {st['with_stalls']} of {st['intervals']} intervals of the engine's timeline, "
            f"at {hit['steps_per_s']:.0f} steps/s, batch {hit['batch']:.1f} (the level: {lv['steps_per_s']:.0f}, "
            f"{lv['batch']:.1f})")


def _stall_positions_text(bins: list[tuple[float, float, int]]) -> str:
    """`sweep.stall_positions` as text: "0.0-0.1 s 3, 0.3-0.4 s 5"."""
    if not bins:
        return ""
    return "; stalls by position in a session's audio: " + ", ".join(
        f"{lo:.1f}-{hi:.1f} s {n}" if math.isfinite(hi) else f"from {lo:.1f} s {n}" for lo, hi, n in bins)


def render_markdown(result: dict, plots: list[str]) -> str:
    L: list[str] = []
    host = result.get("host", {})
    crit = result.get("criteria", {})
    wl = result.get("workload", {})
    srv = result.get("server", {})
    L.append(f"# Load test {result.get('created_utc', '')}\n")
    L.append(f"`{result.get('command', '')}`\n")
    L.append(f"- machine: {host.get('cpu_model', '?')}, {host.get('nproc', '?')} CPUs; torch {host.get('torch', '?')}; "
             f"git {result.get('git', {}).get('commit', '?')}{' (dirty)' if result.get('git', {}).get('dirty') else ''}")
    la = [" / ".join(f"{v:.2f}" for v in x) if x else "?" for x in (host.get("loadavg_start"), host.get("loadavg_end"))]
    L.append(f"- load average (1/5/15 min) at start {la[0]}, at end {la[1]} on {host.get('nproc', '?')} CPUs"
             + ("  **machine was busy: treat timings as noisy**" if result.get("noisy") else ""))
    L.append(f"- server: {srv.get('mode')} {srv.get('target')} model `{srv.get('model_path')}` device {srv.get('device')}"
             f" torch threads {srv.get('torch_threads') or ('auto' if srv.get('mode') == 'spawn' else 'as the server set them')};"
             f" metrics {srv.get('metrics_url') or 'off'}")
    L.append(f"- workload: {wl.get('pacing')}; {wl.get('sentences_per_turn')} sentence(s)/turn from "
             f"{wl.get('text_source')}; {wl.get('duration_s')} s per level, at most "
             f"{wl.get('max_sessions') or '4 x N a second of it as'} turns; "
             f"session config {wl.get('config')}")
    L.append(f"- pass: no failed session, zero underruns, TTFA p95 <= {_ms(crit.get('ttfa_bound_s'))} ms "
             f"(TTFA = first upstream token -> first audio packet received, client clock)\n")
    sw = result.get("sweep", {})
    if sw:
        L.append(f"**Rated N = {sw.get('rated_n')}** (largest passing N: {sw.get('largest_passing_n')}, first failing N: "
                 f"{sw.get('first_failing_n')}{'' if sw.get('monotone', True) else '; NOT monotone: re-run in a quiet window'})\n")

    by = levels_by_mode(result)
    L.append("## Streaming\n")
    L.append("| N | pass | sessions | errors | TTFA p50 / p95 ms | lookahead p50 ms | FPL p50 / p95 ms | underruns (sessions) "
             "| starved ms | min slack p1 / p10 ms | step mean / p95 ms | batch mean | busy | RTF/session | spoken | load1 "
             "| host CPU steal ms (worst second) |")
    L.append("|" + "---|" * 17)
    for lv in by.get(STREAMING, []):
        c, s = lv["client"], lv.get("server") or {}
        L.append(
            f"| {lv['n']} | {'yes' if lv.get('passed') else 'NO'} | {c['sessions']} | {c['errors']} "
            f"| {_ms(_get(c, 'ttfa_user_s', 'p50'))} / {_ms(_get(c, 'ttfa_user_s', 'p95'))} "
            f"| {_ms(_get(c, 'lookahead_wait_s', 'p50'))} "
            f"| {_ms(_get(c, 'compute_fpl_s', 'p50'))} / {_ms(_get(c, 'compute_fpl_s', 'p95'))} "
            f"| {c['underruns']} ({c['sessions_with_underruns']}) | {_ms(c['starved_s'])} "
            f"| {_ms(_get(c, 'min_slack_s', 'p1'))} / {_ms(_get(c, 'min_slack_s', 'p10'))} "
            f"| {_ms2(_get(s, 'step_seconds', 'mean'))} / "
            f"{_ms2(_get(s, 'step_seconds', 'p95'))} | {_f(_get(s, 'batch_size', 'mean'), '{:.1f}')} "
            f"| {_f(s.get('engine_busy_fraction'))} | {_f(_get(s, 'rtf_per_session', 'mean'), '{:.3f}')} "
            f"| {_f(_get(c, 'spoken_fraction', 'mean'), '{:.0%}')} "
            f"| {_f((_get(lv, 'loadavg', 'start') or [None])[0], '{:.1f}')} "
            f"| {_ms(_get(lv, 'host_steal', 'steal_s'))} ({_ms(_get(lv, 'host_steal', 'worst_second_s'))}) |")
    fails = [lv for lv in by.get(STREAMING, []) if lv.get("fail_reasons")]
    if fails:
        L.append("")
        for lv in fails:
            st = lv.get("stall_steps") or steps_where_stalls_began(lv.get("records") or [], lv.get("engine_timeline"))
            L.append(f"- N={lv['n']}: " + "; ".join(lv["fail_reasons"]) + _stall_steps_text(st)
                     + _stall_positions_text(stall_positions(lv.get("records") or [])))
    if by.get(SENTENCE):
        L.append("\n## Sentence-level baseline (same model, same texts and upstream timing)\n")
        L.append("Each sentence waits for its last token, then is synthesised offline (n_past_chunks=-1, sent at once); "
                 "ratios are baseline / streaming at the same N (> 1: streaming is better).\n")
        L.append("| N | TTFA p50 / p95 ms | TTFA p50 ratio | TTFA p95 ratio | underruns (sessions) | starved ms "
                 "| streaming underruns | errors |")
        L.append("|" + "---|" * 8)
        comp = {c["n"]: c for c in sw.get("comparison", [])}
        for lv in by[SENTENCE]:
            c, r = lv["client"], comp.get(lv["n"], {})
            L.append(f"| {lv['n']} | {_ms(_get(c, 'ttfa_user_s', 'p50'))} / {_ms(_get(c, 'ttfa_user_s', 'p95'))} "
                     f"| {_f(r.get('ttfa_p50_ratio'))} | {_f(r.get('ttfa_p95_ratio'))} "
                     f"| {c['underruns']} ({c['sessions_with_underruns']}) | {_ms(c['starved_s'])} "
                     f"| {r.get('underruns_streaming', '-')} | {c['errors']} |")
    prof = result.get("profile")
    if prof:
        L.append("\n## Step profile\n")
        L.append(render_profile_markdown(prof))
    if plots:
        L.append("\n## Plots\n")
        for p in plots:
            L.append(f"![{p}]({p})\n")
    L.append("\n## Client health\n")
    L.append("| level | client loop lag p99 / max ms | server CPU s | loadtest CPU s | wall s |")
    L.append("|---|---|---|---|---|")
    for lv in result.get("levels", []):
        L.append(f"| {lv['mode']} N={lv['n']} | {_ms2(_get(lv, 'client_loop_lag_s', 'p99'))} / "
                 f"{_ms2(_get(lv, 'client_loop_lag_s', 'max'))} | {_f(lv.get('server_cpu_s'))} "
                 f"| {_f(lv.get('loadtest_cpu_s'))} | {_f(lv.get('wall_s'), '{:.1f}')} |")
    return "\n".join(L) + "\n"


def _ms2(v: Optional[float]) -> str:
    return "-" if v is None else f"{1000 * v:.1f}"


def render_profile_markdown(prof: dict) -> str:
    L: list[str] = []
    m = prof.get("machine", {})
    L.append(f"Machine, measured in the same run ({prof.get('threads')} torch thread(s)): sgemm "
             f"{_f(m.get('sgemm_gflops'), '{:.1f}')} GFLOP/s"
             f"{', bf16 gemm ' + _f(m['bf16_gemm_gflops'], '{:.1f}') + ' GFLOP/s' if m.get('bf16_gemm_gflops') else ''}"
             f"{', int8 linear ' + _f(m['int8_gemm_gops'], '{:.1f}') + ' GOP/s' if m.get('int8_gemm_gops') else ''}, memcpy {_f(m.get('memcpy_gbs'), '{:.1f}')} GB/s "
             f"(read + write); load average {' / '.join(f'{v:.2f}' for v in prof.get('loadavg') or [])}; "
             f"{prof.get('text_chars', '?')} characters of text per session.\n")
    for row in prof.get("batches", []):
        graphs = (", the model step replayed from a CUDA graph" if prof.get("cuda_graphs") else
                  ", the model step as one native call (one scope)" if prof.get("native_step") else
                  ", the model step as a frozen TorchScript graph (one scope)" if prof.get("frozen_step") else "")
        if prof.get("matmul_weights", "float32") != "float32":
            graphs += f", {prof['matmul_weights']} matmul weights from batch {prof.get('low_precision_from_batch')}"
        L.append(f"### batch {row['batch']}  (model `{prof.get('model')}`{graphs})\n")
        L.append(f"- engine step (instrumented): {_f(row['step_ms'], '{:.2f}')} ms per step, "
                 f"uninstrumented {_f(row.get('step_ms_plain'), '{:.2f}')} ms (the engine's own work "
                 f"{_f(row.get('engine_own_ms_plain'), '{:.2f}')} ms, median a step "
                 f"{_f(row.get('engine_own_ms_median'), '{:.2f}')} ms); mean batch {_f(row.get('mean_batch'), '{:.1f}')}"
                 f"; {row.get('aten_ops_per_step', '-')} aten ops per model+sampling step "
                 f"({_f(row.get('us_per_aten_op'), '{:.1f}')} us each)")
        c = row.get("cost", {})
        L.append(f"- cost per step: {_f(c.get('gflop'), '{:.4f}')} GFLOP (analytic; FlopCounter "
                 f"{_f(c.get('gflop_counted'), '{:.4f}')}{'; ' + _f(c['low_gflop'], '{:.4f}') + ' of it in ' + prof['matmul_weights'] if c.get('low_gflop') else ''}), "
                 f"{_f(c.get('mbytes'), '{:.2f}')} MB moved "
                 f"(weights {_f(c.get('weight_mbytes'), '{:.2f}')} MB once + state {_f(c.get('state_mbytes_per_session'), '{:.3f}')} MB per session)")
        L.append(f"- physical limit: {_f(c.get('t_flops_ms'), '{:.3f}')} ms (compute) / {_f(c.get('t_bytes_ms'), '{:.3f}')} ms "
                 f"(memory) -> the step runs at **{_f(100 * c['roofline_fraction'] if c.get('roofline_fraction') is not None else None, '{:.1f}')}%** "
                 f"of the roofline bound ({_f(c.get('achieved_gflops'), '{:.2f}')} GFLOP/s, {_f(c.get('achieved_gbs'), '{:.2f}')} GB/s); "
                 f"uninstrumented **{_f(100 * c['roofline_fraction_plain'] if c.get('roofline_fraction_plain') is not None else None, '{:.1f}')}%**\n")
        L.append("| scope | ms / step | % | calls / step |")
        L.append("|---|---|---|---|")
        for s in row.get("scopes", []):
            L.append(f"| {'&nbsp;&nbsp;' * s['depth']}{s['name']} | {s['ms_per_step']:.3f} | {s['pct']:.1f} | {s['calls_per_step']:.1f} |")
        cats = row.get("categories")
        if cats:
            L.append("\n| category | ms / step | % |")
            L.append("|---|---|---|")
            for k, v in cats.items():
                L.append(f"| {k} | {v['ms_per_step']:.3f} | {v['pct']:.1f} |")
        L.append("")
    return "\n".join(L)


def write_report(result: dict, out_dir: Path, plots: bool = True) -> Path:
    out_dir = Path(out_dir)
    files = make_plots(result, out_dir) if plots else []
    path = out_dir / "report.md"
    path.write_text(render_markdown(result, files))
    return path


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(__doc__)
        return 2
    p = Path(argv[0])
    result = json.loads(p.read_text())
    print(write_report(result, p.parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
