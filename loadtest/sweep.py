"""Pass/fail of one load level and the rated load of a sweep (pure functions).

A level (N concurrent streaming sessions) passes when
- at least one session completed and none failed (gRPC error, timeout, capacity),
- no session had an underrun (client-side playback simulation, playback.py), and
- the p95 of the client-side TTFA (first text piece sent -> first audio packet
  received) is at most the bound.

The rated N is the largest N such that it and every smaller N of the sweep passed: a
pass above a failure is reported (`largest_passing_n`, `monotone: false`) but not
trusted, since on a shared machine it usually means the failure was noise.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional


def level_verdict(summary: dict, ttfa_bound_s: float) -> tuple[bool, list[str]]:
    """summary: a level's client-side aggregate (see driver.aggregate)."""
    reasons: list[str] = []
    completed = summary.get("completed", 0)
    errors = summary.get("errors", 0)
    if completed <= 0:
        reasons.append("no session completed")
    if errors:
        reasons.append(f"{errors} session(s) failed: {summary.get('error_codes', {})}")
    if summary.get("underruns", 0) > 0:
        reasons.append(
            f"{summary['underruns']} underrun(s) in {summary.get('sessions_with_underruns', '?')} session(s), "
            f"{1000 * summary.get('starved_s', 0.0):.0f} ms starved")
    p95 = (summary.get("ttfa_user_s") or {}).get("p95")
    if p95 is None:
        reasons.append("no TTFA measured")
    elif p95 > ttfa_bound_s:
        reasons.append(f"TTFA p95 {1000 * p95:.0f} ms > bound {1000 * ttfa_bound_s:.0f} ms")
    return not reasons, reasons


def steps_where_stalls_began(records: Iterable[dict], timeline: Optional[list[list]]) -> Optional[dict]:
    """The engine's step rate and batch in the intervals of its `timeline` (rows [end time,
    steps, seconds in steps, mean batch, ...], run.py's `engine_timeline`) in which a
    listener ran dry, against the whole level's. A stall begins when playback reaches its
    audio position: the turn's first packet (`t_start` + `ttfa_user_s`) plus the position
    plus the stalls before it. None without a timeline."""
    rows = [r for r in timeline or [] if r[1] > 0]
    if len(rows) < 2:
        return None
    period = (rows[-1][0] - rows[0][0]) / (len(rows) - 1)
    starts = []
    for rec in records:
        if rec.get("ttfa_user_s") is None:  # no audio came: no playback, no stall
            continue
        paused = 0.0
        for at, dur in rec.get("stalls") or []:
            starts.append(rec["t_start"] + rec["ttfa_user_s"] + at + paused)
            paused += dur

    def rates(rs: list[list]) -> dict:
        steps = sum(r[1] for r in rs)
        return {"steps_per_s": steps / (period * len(rs)),
                "batch": sum((r[3] or 0.0) * r[1] for r in rs) / steps}
    hit = [r for r in rows if any(r[0] - period < t <= r[0] for t in starts)]
    return {"intervals": len(rows), "with_stalls": len(hit), "level": rates(rows),
            "where_stalls_began": rates(hit) if hit else None}


def stall_positions(records: Iterable[dict], bin_s: float = 0.1, until_s: float = 1.0
                    ) -> list[tuple[float, float, int]]:
    """Where in their audio the listeners ran dry: the stalls recorded (`stalls`:
    [position s, length s]) counted in bins of `bin_s` seconds of a session's audio up to
    `until_s`, and all later ones in one bin (to infinity): (from, to, count) for the bins
    with any, in order. Which packet came late shows there: the second (right after the
    first packet's audio), the first after the ramp hands off to the packet clock, or a
    clocked one (later: the engine does not keep up)."""
    last = round(until_s / bin_s)
    counts: dict[int, int] = {}
    for rec in records:
        for at, _ in rec.get("stalls") or []:
            k = min(int(at // bin_s), last)
            counts[k] = counts.get(k, 0) + 1
    return [(k * bin_s, (k + 1) * bin_s if k < last else math.inf, counts[k]) for k in sorted(counts)]


def select_rated(levels: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """levels: dicts with "n" and "passed". Returns rated_n (None if the smallest N
    failed), largest_passing_n, first_failing_n, monotone."""
    ls = sorted(levels, key=lambda x: x["n"])
    rated: Optional[int] = None
    first_fail: Optional[int] = None
    for lv in ls:
        if lv["passed"] and first_fail is None:
            rated = lv["n"]
        elif not lv["passed"] and first_fail is None:
            first_fail = lv["n"]
    passing = [lv["n"] for lv in ls if lv["passed"]]
    largest = max(passing) if passing else None
    return {
        "rated_n": rated,
        "largest_passing_n": largest,
        "first_failing_n": first_fail,
        "monotone": largest == rated,
        "tested_n": [lv["n"] for lv in ls],
    }


def should_stop(levels: Iterable[dict[str, Any]], max_failures: int) -> bool:
    """Stop the sweep after `max_failures` failing levels (0: never stop early)."""
    if max_failures <= 0:
        return False
    return sum(1 for lv in levels if not lv["passed"]) >= max_failures


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return a / b


def compare_modes(streaming: dict, sentence: dict) -> dict[str, Any]:
    """Sentence-level baseline vs streaming at the same N (ratios > 1: streaming wins)."""
    s_t, b_t = streaming.get("ttfa_user_s") or {}, sentence.get("ttfa_user_s") or {}
    return {
        "ttfa_p50_ratio": ratio(b_t.get("p50"), s_t.get("p50")),
        "ttfa_p95_ratio": ratio(b_t.get("p95"), s_t.get("p95")),
        "underruns_streaming": streaming.get("underruns", 0),
        "underruns_sentence": sentence.get("underruns", 0),
        "underruns_ratio": ratio(sentence.get("underruns", 0), streaming.get("underruns", 0)),
        "starved_s_streaming": streaming.get("starved_s", 0.0),
        "starved_s_sentence": sentence.get("starved_s", 0.0),
        "starved_ratio": ratio(sentence.get("starved_s", 0.0), streaming.get("starved_s", 0.0)),
    }
