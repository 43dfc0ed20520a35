#!/usr/bin/env python3
"""Writes the Grafana dashboard for LiveSpeech: deploy/base/monitoring/livespeech-dashboard.json.

    python deploy/tools/build_dashboard.py            # rewrite the JSON
    python deploy/tools/build_dashboard.py --check    # exit 1 if the JSON is stale

Every query uses the server's real metric names (server/metrics.py); tests/test_deploy.py
checks both that and that the committed JSON matches this script.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "base" / "monitoring" / "livespeech-dashboard.json"

SEL = 'namespace="$namespace", pod=~"$pod"'
FRAME_BUDGET_S = 1 / 75  # one decode step per 75 Hz codec frame


def q(expr: str, legend: str) -> dict:
    return {"expr": expr, "legendFormat": legend}


def quantiles(metric: str, qs=(0.5, 0.95, 0.99), by: str = "le") -> list[dict]:
    return [
        q(f"histogram_quantile({x}, sum by ({by}) (rate({metric}_bucket{{{SEL}}}[$__rate_interval])))", f"p{int(x * 100)}")
        for x in qs
    ]


class Layout:
    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.y = 0
        self.x = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        if self.x:
            self.y += 8
            self.x = 0
        self.panels.append({"type": "row", "title": title, "id": self._id(), "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def panel(self, title: str, targets: list[dict], unit: str, *, kind: str = "timeseries", w: int = 8,
              description: str = "", thresholds: list[tuple[float, str]] = (), stack: bool = False) -> None:
        if self.x + w > 24:
            self.y += 8
            self.x = 0
        steps = [{"color": "green", "value": None}] + [{"color": c, "value": v} for v, c in thresholds]
        custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                  "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
        if thresholds:
            custom["thresholdsStyle"] = {"mode": "line"}
        panel = {
            "type": kind,
            "title": title,
            "id": self._id(),
            "description": description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": w, "x": self.x, "y": self.y},
            "fieldConfig": {
                "defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps},
                             **({"custom": custom} if kind == "timeseries" else {})},
                "overrides": [],
            },
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}}
            if kind == "timeseries" else {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"},
            "targets": [dict(t, refId=chr(ord("A") + i)) for i, t in enumerate(targets)],
        }
        self.panels.append(panel)
        self.x += w

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def build() -> dict:
    L = Layout()
    L.row("Load")
    L.panel("Replicas", [q(f"count(livespeech_active_sessions{{{SEL}}})", "replicas")], "short", kind="stat", w=4)
    L.panel("Active sessions", [q(f"sum(livespeech_active_sessions{{{SEL}}})", "sessions")], "short", kind="stat", w=4)
    L.panel("Active sessions per pod", [q(f"livespeech_active_sessions{{{SEL}}}", "{{pod}}")], "short", w=8,
            description="Sessions holding an engine slot (HPA metric livespeech_active_sessions).")
    L.panel("Engine busy ratio per pod",
            [q(f"sum by (pod) (rate(livespeech_step_seconds_sum{{{SEL}}}[$__rate_interval]))"
               f" + sum by (pod) (rate(livespeech_codec_decode_seconds_sum{{{SEL}}}[$__rate_interval]))", "{{pod}}")],
            "percentunit", w=8, thresholds=[(0.7, "orange"), (0.9, "red")],
            description="Wall-time share of decode steps + codec decodes (HPA metric livespeech_engine_busy_ratio).")
    L.panel("Sessions / s by outcome",
            [q(f"sum by (outcome) (rate(livespeech_sessions_total{{{SEL}}}[$__rate_interval]))", "{{outcome}}")],
            "reqps", w=8, stack=True)
    L.panel("Errors / s by gRPC code",
            [q(f"sum by (code) (rate(livespeech_errors_total{{{SEL}}}[$__rate_interval]))", "{{code}}")],
            "reqps", w=8, stack=True)
    L.panel("Audio generated (real-time streams)",
            [q(f"sum(rate(livespeech_audio_seconds_total{{{SEL}}}[$__rate_interval]))", "audio s / s")], "short", w=8,
            description="Seconds of audio per second: the number of listeners kept in real time.")
    L.row("Latency")
    L.panel("Time to first audio (TTFA)", quantiles("livespeech_ttfa_seconds"), "s", thresholds=[(1.0, "red")],
            description="First text message received -> first PCM packet sent.")
    L.panel("Lookahead wait", quantiles("livespeech_lookahead_wait_seconds"), "s",
            description="Part of TTFA spent waiting for text (depends on the client's pace).")
    L.panel("Compute first-packet latency (FPL)", quantiles("livespeech_compute_fpl_seconds"), "s",
            thresholds=[(0.3, "red")], description="Moment generation may start -> first packet sent.")
    L.row("Real time")
    L.panel("Decode step time", quantiles("livespeech_step_seconds"), "s", thresholds=[(FRAME_BUDGET_S, "red")],
            description="One batched decode step; above 13.3 ms (one 75 Hz frame) the batch falls behind real time.")
    L.panel("Batch size (mean)",
            [q(f"sum by (pod) (rate(livespeech_batch_size_sum{{{SEL}}}[$__rate_interval]))"
               f" / sum by (pod) (rate(livespeech_batch_size_count{{{SEL}}}[$__rate_interval]))", "{{pod}}")], "short")
    L.panel("Underruns / s",
            [q(f"sum by (pod) (rate(livespeech_underruns_total{{{SEL}}}[$__rate_interval]))", "{{pod}}")], "short",
            thresholds=[(1e-9, "red")], description="Packets sent after their playback deadline: must be zero at the rated load.")
    L.panel("Real-time factor per session", quantiles("livespeech_rtf_ratio", (0.5, 0.95)), "short",
            thresholds=[(1.0, "red")], description="Compute time / audio duration.")
    L.panel("Codec decode time", quantiles("livespeech_codec_decode_seconds"), "s")
    L.panel("Text tokens / s",
            [q(f"sum(rate(livespeech_text_tokens_total{{{SEL}}}[$__rate_interval]))", "tokens / s")], "short")
    L.row("Process")
    L.panel("Resident memory per pod", [q(f"process_resident_memory_bytes{{{SEL}}}", "{{pod}}")], "bytes",
            description="A slow climb at steady load is a leak (docs/reliability.md).")
    L.panel("CPU per pod", [q(f"rate(process_cpu_seconds_total{{{SEL}}}[$__rate_interval])", "{{pod}}")], "short",
            description="CPU seconds per second (cores in use).")
    L.panel("Build per pod",
            [q(f"max by (pod, version, torch, python) (livespeech_build_info{{{SEL}}})",
               "{{pod}}: {{version}}, torch {{torch}}, Python {{python}}")], "short",
            description="livespeech_build_info: which release each pod runs, e.g. mid-rollout.")
    return {
        "title": "LiveSpeech",
        "uid": "livespeech",
        "description": "LiveSpeech streaming TTS: load, latency (TTFA, lookahead wait, compute FPL), real-time health.",
        "tags": ["livespeech", "tts", "grpc"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "timezone": "browser",
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            {"name": "namespace", "label": "Namespace", "type": "query",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(livespeech_active_sessions, namespace)", "refId": "namespace"},
             "definition": "label_values(livespeech_active_sessions, namespace)", "refresh": 2, "current": {}},
            {"name": "pod", "label": "Pod", "type": "query", "includeAll": True, "multi": True, "allValue": ".*",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": 'label_values(livespeech_active_sessions{namespace="$namespace"}, pod)', "refId": "pod"},
             "definition": 'label_values(livespeech_active_sessions{namespace="$namespace"}, pod)', "refresh": 2,
             "current": {}},
        ]},
        "annotations": {"list": []},
        "panels": L.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the committed JSON differs")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is stale: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
