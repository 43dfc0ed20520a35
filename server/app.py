"""The server process: gRPC (LiveSpeech + health + reflection), the WebSocket and
OpenAI-compatible HTTP endpoints (server/web.py, when `http_port` is set), metrics, drain.

    app = await build_server(config, engine)   # started; app.port is the bound port
    ...
    await app.drain()                          # what SIGTERM does

`serve(config)` builds the engine from the model bundle and runs until SIGTERM/SIGINT
under uvloop. Drain: health -> NOT_SERVING, new Synthesize calls -> UNAVAILABLE "server
is draining", in-flight sessions get `drain_grace_s` to finish (then UNAVAILABLE
"server is shutting down"), then `server.stop()`, the HTTP server's and `engine.stop()`.
WebSocket and HTTP sessions are drained with gRPC's (they are the service's streams too),
refused while draining with close code 4503 / HTTP 503.

Security (server/auth.py, docs/reliability.md): TLS when `tls_cert` is set (mutual TLS
with `tls_client_ca`), bearer tokens when configured; both are loaded before the engine
starts, so a bad certificate or token file stops startup; SIGHUP re-reads the tokens
(`App.reload_tokens`: rotation and revocation without a restart). The service caps the
Synthesize streams open at once (`synthesize_stream_limit`); gRPC has no server-wide cap
on calls, which would refuse health checks and reflection along with a Synthesize flood.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
from pathlib import Path
from typing import Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from livespeech.api.protocol import SERVICE_NAME, method_handlers
from livespeech.api.session import ConfigError, EngineAPI

from .auth import AuthInterceptor, load_tokens, server_credentials
from .config import EngineConfig, ServerConfig
from .metrics import Metrics
from .service import LiveSpeechService
from .voices import VoiceStore
from .web import WebEndpoints, ssl_context

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class App:
    def __init__(
        self,
        config: ServerConfig,
        engine: EngineAPI,
        metrics: Metrics,
        voices: VoiceStore,
        service: LiveSpeechService,
        server: grpc.aio.Server,
        health: health.aio.HealthServicer,
        port: int,
        metrics_port: Optional[int],
        auth: Optional[AuthInterceptor] = None,
        web: Optional[WebEndpoints] = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.metrics = metrics
        self.voices = voices
        self.service = service
        self.server = server
        self.health = health
        self.port = port
        self.metrics_port = metrics_port
        self.auth = auth
        self.web = web  # the WebSocket/HTTP endpoints (None: http_port 0)
        self._stopped: Optional[asyncio.Task] = None

    @property
    def http_port(self) -> Optional[int]:
        return self.web.port if self.web is not None else None

    @property
    def address(self) -> str:
        host = self.config.host
        if host in ("0.0.0.0", "::", "[::]"):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

    async def drain(self, grace_s: Optional[float] = None) -> None:
        """Graceful shutdown; idempotent (a second call waits for the first)."""
        if self._stopped is None:
            self._stopped = asyncio.ensure_future(self._drain(self.config.drain_grace_s if grace_s is None else grace_s))
        await asyncio.shield(self._stopped)

    async def _drain(self, grace_s: float) -> None:
        log.info("draining: %d in-flight sessions, grace %.1f s", self.service.in_flight, grace_s)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, NOT_SERVING)
        forced = await self.service.drain(grace_s)
        if forced:
            log.warning("drain: ended %d sessions still running after %.1f s", forced, grace_s)
        await self.server.stop(grace=1.0)
        if self.web is not None:
            await self.web.stop()
        await self.voices.close()
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)
        self.metrics.stop_http_server()
        log.info("stopped")

    def reload_tokens(self) -> bool:
        """Re-read the bearer tokens (SIGHUP): new calls are checked against the new table;
        sessions already open keep running. A table that does not load (or would turn
        authentication off) is refused and the old one kept. Returns whether it changed."""
        if self.auth is None:
            log.warning("token reload: authentication is off (it can only be enabled at startup)")
            return False
        try:
            tokens = load_tokens(self.config)
        except ConfigError as e:
            log.error("token reload refused, keeping the old tokens: %s", e)
            return False
        if tokens is None:
            log.error("token reload refused: no tokens configured any more (would turn authentication off)")
            return False
        self.auth.tokens = tokens
        log.info("token reload: %r", tokens)
        return True

    async def stop(self) -> None:
        """Shut down now (no grace for running sessions)."""
        await self.drain(0.0)

    async def wait_closed(self) -> None:
        await self.server.wait_for_termination()
        if self._stopped is not None:
            await asyncio.shield(self._stopped)


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", 16 << 20),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


async def build_server(
    config: ServerConfig,
    engine: EngineAPI,
    *,
    metrics: Optional[Metrics] = None,
    voices: Optional[VoiceStore] = None,
) -> App:
    """Start the engine, load voices, start gRPC and the metrics exporter."""
    metrics = metrics if metrics is not None else Metrics()
    tokens = load_tokens(config)  # ConfigError before anything starts
    credentials = server_credentials(config)
    if tokens is not None and credentials is None and config.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("bearer tokens without TLS on %s: tokens travel in clear text (terminate TLS in front)", config.host)
    engine.start()
    web: Optional[WebEndpoints] = None
    try:
        if voices is None:
            voices = VoiceStore(
                config.voices_dir, engine, max_voices=config.max_voices, max_voices_per_tenant=config.max_voices_per_tenant,
                rescan_s=config.voices_rescan_s,
            )
        await voices.load()
        service = LiveSpeechService(config, engine, voices, metrics)
        auth = AuthInterceptor(tokens, metrics) if tokens is not None else None
        server = grpc.aio.server(
            options=grpc_options(config),
            interceptors=[auth] if auth is not None else None,
        )
        server.add_generic_rpc_handlers((method_handlers(service),))
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, SERVING)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = f"{config.host}:{config.port}"
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind {config.host}:{config.port}")
        metrics_port = None
        if config.metrics_port:  # -1: any free port
            metrics_port = metrics.start_http_server(max(config.metrics_port, 0), config.host)
        if config.http_port:  # -1: any free port
            web = WebEndpoints(config, service, auth)
            await web.start(ssl_context(config))
        await server.start()
    except BaseException:
        if web is not None:
            await web.stop()
        metrics.stop_http_server()
        engine.stop()
        raise
    log.info("listening on %s:%d (metrics: %s, WebSocket/HTTP: %s)", config.host, port, metrics_port or "off",
             web.port if web is not None else "off")
    log.info(
        "security: %s, %s",
        ("mutual TLS" if config.tls_client_ca else "TLS") if credentials else "plaintext",
        f"bearer tokens for {len(tokens.tenants)} tenants" if tokens else "no authentication",
    )
    return App(config, engine, metrics, voices, service, server, health_servicer, port, metrics_port, auth, web)


# ------------------------------------------------------------------ process


def engine_config(config: ServerConfig):
    """The engine's settings that come from the server's."""
    from livespeech.models.inference import TEXT_KV_CAPACITY
    from livespeech.server.runner import codec_runtime, matmul_weights

    return EngineConfig(
        max_sessions=config.max_sessions,
        max_text_piece_chars=config.max_text_piece_chars,
        max_session_text_chars=config.max_session_text_chars,
        cuda_graphs=config.cuda_graphs,
        compile_step=config.compile_step,
        frozen_step=config.frozen_step,
        native_step=config.native_step,
        codec_thread=config.codec_thread,
        matmul_weights=matmul_weights(config.matmul_weights, config.device),
        codec_runtime=codec_runtime(config.codec_runtime, config.device),
        warm_text_tokens=TEXT_KV_CAPACITY,
        warm_up=True,
        device_guidance=config.device_guidance,
        text_cfg_scale=config.text_cfg_scale,
        letter_schedule=config.letter_schedule,
        spoken_form=config.spoken_form,
    )


def available_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may use: its affinity, capped by a cgroup CPU quota (a container's
    CPU limit, which `os.cpu_count()` and torch's default thread count do not see)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_cpu_quota(cgroup_root)
    return max(1, min(cpus, math.ceil(quota)) if quota else cpus)


def _cgroup_cpu_quota(root: Path) -> Optional[float]:
    """The CPU quota in CPUs (cgroup v2 `cpu.max`, else v1 `cpu.cfs_*`); None if unlimited."""
    def read(*names: str) -> Optional[list[str]]:
        try:
            return [(root / n).read_text().strip() for n in names]
        except OSError:
            return None

    v2 = read("cpu.max")  # "quota period" or "max period"
    fields = v2[0].split() if v2 else read("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")
    if not fields or len(fields) != 2:
        return None
    quota, period = fields
    if not (quota.isdigit() and period.isdigit()) or int(period) == 0:
        return None  # "max" / "-1": no limit
    return int(quota) / int(period)


def torch_threads(config: ServerConfig, cpus: int) -> int:
    """Intra-op threads for the engine. Set: as set. Auto (0): with the codec on its own
    thread (the CPU), each of the two stepping threads gets half the CPUs, since both
    run torch ops at once and each would otherwise start a team of `cpus` threads: on 2
    cores 2 threads starved listeners 1.4-3.8x longer than 1 at 2-4 sessions
    (docs/loadtest.md, "Measured choices"). Else all of them."""
    if config.torch_threads:
        return config.torch_threads
    if config.device == "cpu" and config.codec_thread:
        return max(1, cpus // 2)
    return cpus


def engine_processes(config: ServerConfig, cpus: int) -> int:
    """Engine processes: as set, or (auto, 0) one per CPU on the cpu device, capped by
    the slots; one on a GPU."""
    wanted = config.engine_processes or (cpus if config.device == "cpu" else 1)
    return max(1, min(wanted, config.max_sessions))


def make_engine(config: ServerConfig, metrics: Metrics) -> EngineAPI:
    """The real engine on the configured (or embedded default) model bundle: in this
    process, or a pool of engine processes (server/engine_pool.py)."""
    cpus = available_cpus()
    processes = engine_processes(config, cpus)
    if processes > 1:
        from livespeech.server.engine_pool import EnginePool

        log.info("engine processes: %d (%s; %d CPUs available)", processes,
                 "set" if config.engine_processes else "auto", cpus)
        return EnginePool(config, metrics, processes, cpus=max(1, cpus // processes), build=build_engine)
    return build_engine(config, metrics, cpus)


def build_engine(config: ServerConfig, metrics: Metrics, cpus: int) -> EngineAPI:
    """An `Engine` in this process, with `cpus` CPUs for its threads."""
    import torch

    threads = torch_threads(config, cpus)
    torch.set_num_threads(threads)
    log.info("torch threads: %d (%s; %d CPUs available)", threads,
             "set" if config.torch_threads else "auto", cpus)
    from livespeech.models.loading import load_bundle
    from livespeech.server.engine import Engine

    try:
        bundle = load_bundle(config.model_path, device=config.device)
    except FileNotFoundError as e:
        raise SystemExit(f"livespeech: cannot load the model: {e}") from None
    settings = engine_config(config)
    log.info("matmul weights: %s (%s)", settings.matmul_weights, config.matmul_weights)
    engine = Engine(bundle, settings, metrics)
    runner = engine.runner
    log.info("codec runtime: %s (%s)", runner.codec_runtime, config.codec_runtime)
    log.info("model step: %s", runner.model_step_runtime)
    return engine


async def _serve(config: ServerConfig, engine: Optional[EngineAPI]) -> None:
    metrics = Metrics()
    if engine is None:
        engine = make_engine(config, metrics)
    app = await build_server(config, engine, metrics=metrics)
    from livespeech.server.engine import freeze_startup_objects

    freeze_startup_objects()
    http = f", WebSocket/HTTP on {config.host}:{app.http_port}" if app.http_port else ""
    print(f"livespeech: serving on {config.host}:{app.port}{http}", flush=True)
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal(sig: signal.Signals) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            log.warning("%s: draining (again to stop now)", sig.name)
            asyncio.ensure_future(app.drain())
        else:
            log.warning("%s: stopping now", sig.name)
            asyncio.ensure_future(app.server.stop(grace=0))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(signal.SIGHUP, app.reload_tokens)
    await app.wait_closed()


def serve(config: ServerConfig, engine: Optional[EngineAPI] = None) -> None:
    """Run the server until SIGTERM/SIGINT (uvloop when available)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(config, engine))
