"""Before/after table of two load-test results (for docs/loadtest.md).

    python -m livespeech.loadtest.compare runs/loadtest/A/result.json runs/loadtest/B/result.json [--label "fuse heads"]

Prints markdown: the rated N, per-N streaming TTFA p95 / underruns / step time / batch,
and, when both runs carry a step profile, step time and category split per batch. The
load average of both runs is printed next to them: compare only quiet runs.
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


def _delta(a: Optional[float], b: Optional[float]) -> str:
    if a is None or b is None or a == 0:
        return "-"
    return f"{100 * (b - a) / a:+.0f}%"


def streaming(result: dict) -> dict[int, dict]:
    return {lv["n"]: lv for lv in result.get("levels", []) if lv["mode"] == "streaming"}


def render(a: dict, b: dict, label: str = "") -> str:
    L = [f"### {label or 'before / after'}\n"]
    for tag, r in (("before", a), ("after", b)):
        L.append(f"- {tag}: {r.get('created_utc')} git {_get(r, 'git', 'commit')}"
                 f"{' (dirty)' if _get(r, 'git', 'dirty') else ''}, load average at start "
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m livespeech.loadtest.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--label", default="")
    args = ap.parse_args(argv)
    a = json.loads(Path(args.before).read_text())
    b = json.loads(Path(args.after).read_text())
    print(render(a, b, args.label))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
