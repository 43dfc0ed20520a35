"""Client-side playback simulation and latency statistics (pure functions, no I/O).

A simulated player starts playing at the arrival of the first packet (plus an optional
prebuffer) and plays the session's audio timeline continuously. A packet that arrives
after the player reached its start on the timeline is an *underrun*: the player was
starved (silence) from that moment until the packet arrived, and everything after it
plays that much later (a real player resumes; it does not skip audio).

`late_fixed_clock` counts what the server's `underruns_total` counts (server/engine.py):
packets later than `first packet + start_s` on a clock that never shifts after a stall,
so one stall is counted again for every later packet. Both counts are zero together:
the rated load needs zero of either.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence


@dataclass(frozen=True)
class Packet:
    arrival_s: float  # client receive time (any clock, e.g. time.monotonic())
    start_s: float  # offset of the packet's first sample on the session's audio timeline
    duration_s: float


@dataclass
class Playback:
    packets: int = 0
    audio_s: float = 0.0  # end of the audio timeline covered by the packets
    underruns: int = 0  # packets that arrived after the player needed them
    starved_s: float = 0.0  # total silence inserted by those stalls
    max_stall_s: float = 0.0
    late_fixed_clock: int = 0  # the server's definition (never re-based after a stall)
    gaps_s: float = 0.0  # holes in the timeline between consecutive packets (should be 0)
    first_arrival_s: Optional[float] = None
    stalls: list[tuple[float, float]] = field(default_factory=list)  # (timeline position, stall s)
    # the least audio the player still held when a packet arrived (negative: a stall), and
    # where on the timeline: how near a session came to an underrun
    min_slack_s: Optional[float] = None
    min_slack_at_s: Optional[float] = None

    def as_dict(self) -> dict:
        return {
            "packets": self.packets, "audio_s": self.audio_s, "underruns": self.underruns,
            "starved_s": self.starved_s, "max_stall_s": self.max_stall_s,
            "late_fixed_clock": self.late_fixed_clock, "gaps_s": self.gaps_s,
            "min_slack_s": self.min_slack_s, "min_slack_at_s": self.min_slack_at_s,
        }


def simulate_playback(packets: Iterable[Packet], prebuffer_s: float = 0.0, tolerance_s: float = 1e-6) -> Playback:
    """Play `packets` (in arrival order; their timeline offsets must not decrease).

    prebuffer_s: the player starts this long after the first packet arrived (0: at once,
    the definition the rated load uses). tolerance_s absorbs float rounding.
    """
    pb = Playback()
    t_play0: Optional[float] = None  # wall time at which timeline position 0 plays (shifts on stalls)
    t_fixed0: Optional[float] = None
    timeline_end = 0.0
    for p in packets:
        if p.duration_s < 0:
            raise ValueError("negative packet duration")
        if pb.packets and p.start_s < timeline_end - 1e-6:
            raise ValueError(f"packet at {p.start_s:.6f} s overlaps the previous one ending at {timeline_end:.6f} s")
        if t_play0 is None:
            pb.first_arrival_s = p.arrival_s
            t_play0 = p.arrival_s + prebuffer_s - p.start_s
            t_fixed0 = p.arrival_s - p.start_s
        else:
            pb.gaps_s += max(0.0, p.start_s - timeline_end)
            deadline = t_play0 + p.start_s
            late = p.arrival_s - deadline
            if pb.min_slack_s is None or -late < pb.min_slack_s:
                pb.min_slack_s, pb.min_slack_at_s = -late, p.start_s
            if late > tolerance_s:
                pb.underruns += 1
                pb.starved_s += late
                pb.max_stall_s = max(pb.max_stall_s, late)
                pb.stalls.append((p.start_s, late))
                t_play0 += late  # the player waits for the packet, then resumes
            if p.arrival_s - (t_fixed0 + p.start_s) > tolerance_s:
                pb.late_fixed_clock += 1
        pb.packets += 1
        timeline_end = max(timeline_end, p.start_s + p.duration_s)
    pb.audio_s = timeline_end
    return pb


def concat_timelines(calls: Sequence[Sequence[Packet]]) -> list[Packet]:
    """Packets of consecutive calls on one timeline: call i+1's audio plays after call i's
    (sentence-level synthesis played back to back)."""
    out: list[Packet] = []
    offset = 0.0
    for call in calls:
        end = offset
        for p in call:
            q = Packet(p.arrival_s, offset + p.start_s, p.duration_s)
            out.append(q)
            end = max(end, q.start_s + q.duration_s)
        offset = end
    return out


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (q in [0, 100]) of the finite values; None if empty."""
    xs = sorted(v for v in values if v is not None and math.isfinite(v))
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values: Sequence[Optional[float]]) -> dict:
    """n, mean, p50, p90, p95, p99, max of the finite values (None where empty)."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    out: dict = {"n": len(xs)}
    out["mean"] = sum(xs) / len(xs) if xs else None
    for q in (50, 90, 95, 99):
        out[f"p{q}"] = percentile(xs, q)
    out["max"] = max(xs) if xs else None
    return out
