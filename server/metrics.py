"""Prometheus metrics, one `CollectorRegistry` per `Metrics` (several servers per process).

Who records what (so nothing is counted twice):
- the engine: `sessions_total{outcome}` for every session it admitted (completed: every
  word of its text spoken; incomplete: ended by the runaway guard with words unspoken;
  cancelled, failed, disconnected; a session the service ends with an error status
  reaches the engine as a close, e.g. "client is not reading", or as a stop (its summary
  first), its text limit or a timeout: failed) and for
  refusals at capacity (rejected); `errors_total{code}` for the failures it reports;
  and all latency, step, batch, underrun, RTF, audio, token and codec metrics;
- the service: `sessions_total` for streams that never reached the engine (rejected:
  bad or missing config, unknown voice, draining; disconnected: the client left before
  its config was handled) and `errors_total{code}` for every other non-OK status it
  sends (unary voice RPCs included).
"""
from __future__ import annotations

import platform
import socket
import threading
from importlib import metadata
from typing import Optional
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (
    CollectorRegistry, Counter, GCCollector, Gauge, Histogram, Info, PlatformCollector, ProcessCollector,
    generate_latest, make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer

METRICS_PATH = "/metrics"

SESSION_OUTCOMES = ("completed", "incomplete", "cancelled", "failed", "disconnected", "rejected")

# one decode step at 75 Hz has a 13.3 ms budget: resolve 0.5 ms .. 200 ms
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.0133, 0.02, 0.03, 0.05, 0.1, 0.2)
# time to first audio and its parts: 10 ms .. 10 s
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128)
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)
CODEC_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def build_labels() -> dict[str, str]:
    """What `livespeech_build_info` carries; metadata, not imports (torch stays unloaded)."""
    return {"version": _version("livespeech"), "torch": _version("torch"), "python": platform.python_version()}


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # one line per scrape would drown the server log
        pass


def metrics_only_app(registry: CollectorRegistry):
    """The exposition app on /metrics; every other path is 404 (prometheus_client answers any path)."""
    app = make_wsgi_app(registry)

    def serve(environ, start_response):
        if environ.get("PATH_INFO") != METRICS_PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"Not Found: metrics are on /metrics\n"]
        return app(environ, start_response)

    return serve


class Metrics:
    def __init__(self, registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        p = "livespeech_"
        self.active_sessions = Gauge(p + "active_sessions", "Sessions holding an engine slot", registry=r)
        self.sessions_total = Counter(
            p + "sessions_total", "Synthesize streams by outcome", ["outcome"], registry=r
        )
        self.ttfa_seconds = Histogram(
            p + "ttfa_seconds", "Time to first audio: first text received -> first packet sent",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.lookahead_wait_seconds = Histogram(
            p + "lookahead_wait_seconds", "Part of TTFA spent waiting for text",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.compute_fpl_seconds = Histogram(
            p + "compute_fpl_seconds", "Compute first-packet latency: generation may start -> first packet",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.step_seconds = Histogram(
            p + "step_seconds", "Batched decode step time", buckets=STEP_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            p + "batch_size", "Sessions per decode step", buckets=BATCH_BUCKETS, registry=r
        )
        self.underruns_total = Counter(
            p + "underruns_total", "Packets sent after their playback deadline", registry=r
        )
        # a ratio, so the _ratio suffix (Prometheus naming conventions)
        self.rtf = Histogram(
            p + "rtf_ratio", "Real-time factor per session: compute time / audio duration",
            buckets=RTF_BUCKETS, registry=r,
        )
        self.audio_seconds_total = Counter(p + "audio_seconds_total", "Audio generated", registry=r)
        self.text_tokens_total = Counter(p + "text_tokens_total", "Text tokens consumed", registry=r)
        self.errors_total = Counter(
            p + "errors_total", "RPCs ended with a non-OK status, by gRPC code", ["code"], registry=r
        )
        self.codec_decode_seconds = Histogram(
            p + "codec_decode_seconds", "Batched codec decode time", buckets=CODEC_BUCKETS, registry=r
        )
        self.build_info = Info(p + "build", "Server build: package, torch and Python versions", registry=r)
        self.build_info.info(build_labels())
        # the standard runtime families (process_*, python_gc_*, python_info), on this registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        for outcome in SESSION_OUTCOMES:  # export zeros, so rate() works from the start
            self.sessions_total.labels(outcome=outcome)
        self._http = None

    def render(self) -> bytes:
        """The exposition text (what the exporter serves)."""
        return generate_latest(self.registry)

    def start_http_server(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics (and nothing else) on a daemon thread; returns the bound port (port 0: any)."""
        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

        server = make_server(addr, port, metrics_only_app(self.registry), Server, handler_class=_QuietHandler)
        thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
        thread.start()
        self._http = (server, thread)
        return server.server_port

    def stop_http_server(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._http = None
