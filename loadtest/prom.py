"""Scrape the server's Prometheus endpoint and difference two scrapes.

A `Snapshot` holds every counter/gauge sample and every histogram (cumulative buckets,
sum, count). `delta(before, after)` isolates one load level; `hist_quantile` is
Prometheus' `histogram_quantile` (linear inside the bucket).
"""
from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass, field
from typing import Optional

PREFIX = "livespeech_"


@dataclass
class Histogram:
    buckets: list[tuple[float, float]] = field(default_factory=list)  # (le, cumulative count), +inf last
    sum: float = 0.0
    count: float = 0.0

    def minus(self, other: Optional["Histogram"]) -> "Histogram":
        if other is None:
            return Histogram(list(self.buckets), self.sum, self.count)
        prev = dict(other.buckets)
        return Histogram([(le, c - prev.get(le, 0.0)) for le, c in self.buckets], self.sum - other.sum,
                         self.count - other.count)

    @property
    def mean(self) -> Optional[float]:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> Optional[float]:
        return hist_quantile(q, self.buckets)

    def per_bucket(self) -> list[tuple[float, float]]:
        """(le, count in this bucket) — non-cumulative."""
        out, prev = [], 0.0
        for le, c in self.buckets:
            out.append((le, c - prev))
            prev = c
        return out

    def summary(self) -> dict:
        return {
            "count": self.count, "sum": self.sum, "mean": self.mean,
            "p50": self.quantile(0.5), "p95": self.quantile(0.95), "p99": self.quantile(0.99),
            "buckets": [[le if math.isfinite(le) else "+Inf", c] for le, c in self.buckets],
        }


@dataclass
class Snapshot:
    scalars: dict[str, float] = field(default_factory=dict)  # name{labels} -> value
    histograms: dict[str, Histogram] = field(default_factory=dict)

    def scalar(self, name: str, default: float = 0.0) -> float:
        return self.scalars.get(name, default)


def hist_quantile(q: float, buckets: list[tuple[float, float]]) -> Optional[float]:
    """Prometheus' histogram_quantile on cumulative (le, count) buckets."""
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le  # the highest finite bound, as Prometheus does
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def _key(name: str, labels: dict) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def parse(text: str) -> Snapshot:
    from prometheus_client.parser import text_string_to_metric_families

    snap = Snapshot()
    for fam in text_string_to_metric_families(text):
        if fam.type == "histogram":
            by_labels: dict[str, Histogram] = {}
            for s in fam.samples:
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                h = by_labels.setdefault(_key(fam.name, labels), Histogram())
                if s.name.endswith("_bucket"):
                    h.buckets.append((float(s.labels["le"]), float(s.value)))
                elif s.name.endswith("_sum"):
                    h.sum = float(s.value)
                elif s.name.endswith("_count"):
                    h.count = float(s.value)
            for k, h in by_labels.items():
                h.buckets.sort(key=lambda b: b[0])
                snap.histograms[k] = h
        else:
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                snap.scalars[_key(s.name, s.labels)] = float(s.value)
    return snap


def scrape(url: str, timeout: float = 5.0) -> Snapshot:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback only, checked by the caller)
        return parse(r.read().decode("utf-8"))


def delta(before: Optional[Snapshot], after: Snapshot) -> Snapshot:
    if before is None:
        return after
    out = Snapshot()
    for k, v in after.scalars.items():
        out.scalars[k] = v - before.scalars.get(k, 0.0) if k.endswith("_total") or "_total{" in k else v
    for k, h in after.histograms.items():
        out.histograms[k] = h.minus(before.histograms.get(k))
    return out


def engine_summary(d: Snapshot, wall_s: float) -> dict:
    """The per-load-level numbers the report uses, from a delta snapshot."""
    h = d.histograms
    P = PREFIX

    def hs(name: str) -> Optional[dict]:
        x = h.get(P + name)
        return x.summary() if x is not None else None

    step, codec = h.get(P + "step_seconds"), h.get(P + "codec_decode_seconds")
    busy = None
    if step is not None and wall_s > 0:
        busy = (step.sum + (codec.sum if codec is not None else 0.0)) / wall_s
    audio = d.scalar(P + "audio_seconds_total")
    compute = (step.sum if step else 0.0) + (codec.sum if codec else 0.0)
    sessions = {k.split('outcome="')[1].rstrip('"}'): v for k, v in d.scalars.items()
                if k.startswith(P + "sessions_total{")}
    errors = {k.split('code="')[1].rstrip('"}'): v for k, v in d.scalars.items()
              if k.startswith(P + "errors_total{") and v}
    return {
        "step_seconds": hs("step_seconds"),
        "batch_size": hs("batch_size"),
        "codec_decode_seconds": hs("codec_decode_seconds"),
        "rtf_per_session": hs("rtf_ratio"),
        "ttfa_seconds": hs("ttfa_seconds"),
        "lookahead_wait_seconds": hs("lookahead_wait_seconds"),
        "compute_fpl_seconds": hs("compute_fpl_seconds"),
        "underruns_total": d.scalar(P + "underruns_total"),
        "audio_seconds_total": audio,
        "text_tokens_total": d.scalar(P + "text_tokens_total"),
        "sessions_total": sessions,
        "errors_total": errors,
        # engine time in decode steps + codec per second of wall clock (1.0 = saturated;
        # with the codec thread the two threads' times add up and may pass 1.0)
        "engine_busy_fraction": busy,
        # machine real-time factor: engine compute seconds per audio second produced
        "machine_rtf": compute / audio if audio > 0 else None,
    }
