"""Before/after table of two load-test results (for docs/loadtest.md).

    python -m livespeech.loadtest.compare runs/loadtest/A/result.json runs/loadtest/B/result.json [--label "fuse heads"]
    python -m livespeech.loadtest.compare A1/result.json,A2/result.json B1/result.json,B2/result.json

Prints markdown: the rated N, per-N streaming TTFA p95 / underruns / step time / batch,
and, when both runs carry a step profile, step time and category split per batch. The
load average of both runs is printed next to them: compare only quiet runs.

Several runs a side (comma-separated, as many on each: sweeps of the two alternated in
one window, paired in the order given) give the paired table instead: each pair's rated
N, and per N each pair's starved audio and the host's CPU steal in that level, and in
how many pairs B starved less, more or the same. One underrun fails a level, and on a
shared VM a level can lose seconds of CPU to the host, so the rated N of single sweeps
moves a lot; the starved audio pair by pair, read with the steal beside it, says more.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional


def _get(d: Any, *path: Any) -> Any:
    for p in path:
        if isinstance(d, dict):
            d = d.get(p)
        elif isinstance(d, list) and isinstance(p, int) and -len(d) <= p < len(d):
            d = d[p]
        else:
            return None
    return d


def _n(v: Optional[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v * scale)


def _commit(result: dict) -> str:
    """The run's git commit, marked when its tree had uncommitted changes."""
    return f"{_get(result, 'git', 'commit')}{' (dirty)' if _get(result, 'git', 'dirty') else ''}"


def _delta(a: Optional[float], b: Optional[float]) -> str:
    if a is None or b is None or a == 0:
        return "-"
    return f"{100 * (b - a) / a:+.0f}%"


def streaming(result: dict) -> dict[int, dict]:
    return {lv["n"]: lv for lv in result.get("levels", []) if lv["mode"] == "streaming"}


def render(a: dict, b: dict, label: str = "") -> str:
    L = [f"### {label or 'before / after'}\n"]
    for tag, r in (("before", a), ("after", b)):
        L.append(f"- {tag}: {r.get('created_utc')} git {_commit(r)}, load average at start "
                 f"{_n(_get(r, 'host', 'loadavg_start', 0), fmt='{:.2f}')}{' NOISY' if r.get('noisy') else ''}; "
                 f"rated N = {_get(r, 'sweep', 'rated_n')}")
    L.append("")
    L.append("| N | TTFA p95 ms | underruns | step mean ms | batch mean | engine busy |")
    L.append("|---|---|---|---|---|---|")
    sa, sb = streaming(a), streaming(b)
    for n in sorted(set(sa) | set(sb)):
        x, y = sa.get(n, {}), sb.get(n, {})

        def pair(*path: str, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
            u, v = _get(x, *path), _get(y, *path)
            return f"{_n(u, scale, fmt)} -> {_n(v, scale, fmt)} ({_delta(u, v)})"

        L.append(f"| {n} | {pair('client', 'ttfa_user_s', 'p95', scale=1000, fmt='{:.0f}')} "
                 f"| {_n(_get(x, 'client', 'underruns'), fmt='{:.0f}')} -> {_n(_get(y, 'client', 'underruns'), fmt='{:.0f}')} "
                 f"| {pair('server', 'step_seconds', 'mean', scale=1000)} | {pair('server', 'batch_size', 'mean')} "
                 f"| {pair('server', 'engine_busy_fraction', fmt='{:.2f}')} |")
    pa = {row["batch"]: row for row in (_get(a, "profile", "batches") or [])}
    pb = {row["batch"]: row for row in (_get(b, "profile", "batches") or [])}
    for batch in sorted(set(pa) & set(pb)):
        x, y = pa[batch], pb[batch]
        L.append(f"\nStep profile, batch {batch}: {_n(x.get('step_ms_plain') or x.get('step_ms'), fmt='{:.2f}')} -> "
                 f"{_n(y.get('step_ms_plain') or y.get('step_ms'), fmt='{:.2f}')} ms per step "
                 f"({_delta(x.get('step_ms_plain') or x.get('step_ms'), y.get('step_ms_plain') or y.get('step_ms'))}), "
                 f"roofline {_n(_get(x, 'cost', 'roofline_fraction'), 100)}% -> {_n(_get(y, 'cost', 'roofline_fraction'), 100)}%\n")
        L.append("| category | ms / step before | after | change |")
        L.append("|---|---|---|---|")
        for cat in x.get("categories", {}):
            u = _get(x, "categories", cat, "ms_per_step")
            v = _get(y, "categories", cat, "ms_per_step")
            L.append(f"| {cat} | {_n(u, fmt='{:.3f}')} | {_n(v, fmt='{:.3f}')} | {_delta(u, v)} |")
    return "\n".join(L) + "\n"


def render_pairs(a_runs: list[dict], b_runs: list[dict], label: str = "") -> str:
    """Runs of A and B alternated in one window, paired by position (module docstring)."""
    L = [f"### {label or 'A / B, alternated'}\n", "| pair | A: git, rated N | B: git, rated N | B / A |",
         "|---|---|---|---|"]
    rated = []
    for i, (a, b) in enumerate(zip(a_runs, b_runs), 1):
        na, nb = _get(a, "sweep", "rated_n"), _get(b, "sweep", "rated_n")
        rated.append((na, nb))
        ratio = f"{nb / na:.2f}" if na and nb else "-"
        L.append(f"| {i} | {_commit(a)}, {na} | {_commit(b)}, {nb} | {ratio} |")
    if all(na and nb for na, nb in rated):
        sa, sb = sum(na for na, _ in rated), sum(nb for _, nb in rated)
        L.append(f"\nRated N summed over the pairs: A {sa}, B {sb} ({sb / sa:.2f}x).")
    else:
        L.append("\nRated N summed over the pairs: not defined (a run rated none of its levels).")
    L += ["", "| N | starved ms A / B, pair by pair | host steal s A / B "
              "| pairs where B starved less / more / the same |", "|---|---|---|---|"]
    levels = [(streaming(a), streaming(b)) for a, b in zip(a_runs, b_runs)]
    for n in sorted(set().union(*(set(x) & set(y) for x, y in levels))):
        pairs = [(x[n], y[n]) for x, y in levels if n in x and n in y]
        starved = [tuple(_get(lv, "client", "starved_s") for lv in p) for p in pairs]
        steal = [tuple(_get(lv, "host_steal", "steal_s") for lv in p) for p in pairs]
        both = [(u, v) for u, v in starved if u is not None and v is not None]
        less, more = sum(v < u for u, v in both), sum(v > u for u, v in both)
        ms = "; ".join(f"{_n(u, 1000, '{:,.0f}')} / {_n(v, 1000, '{:,.0f}')}" for u, v in starved)
        host = "; ".join(f"{_n(u)} / {_n(v)}" for u, v in steal)
        L.append(f"| {n} | {ms} | {host} | {less} / {more} / {len(both) - less - more} |")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m livespeech.loadtest.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", help="result.json, or several comma-separated (alternated with after's)")
    ap.add_argument("after", help="result.json, or as many comma-separated as before")
    ap.add_argument("--label", default="")
    args = ap.parse_args(argv)
    before, after = args.before.split(","), args.after.split(",")
    if len(before) != len(after):
        ap.error(f"{len(before)} run(s) before against {len(after)} after: pairs need as many on each side")
    try:
        a = [json.loads(Path(p).read_text()) for p in before]
        b = [json.loads(Path(p).read_text()) for p in after]
    except OSError as e:
        ap.error(str(e))
    print(render(a[0], b[0], args.label) if len(a) == 1 else render_pairs(a, b, args.label))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
