"""`ServerConfig`: every server setting, validated once at the edge; and `EngineConfig`,
the engine's settings, which default to the server's where the server has them.

Sources, highest precedence first: command-line flags, `LIVESPEECH_<FIELD>` environment
variables (e.g. `LIVESPEECH_PORT=50051`, `LIVESPEECH_MAX_SESSIONS=8`), defaults.
Secrets have no flag (`ENV_ONLY`): a command line is readable by every local user.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from livespeech.api.session import ConfigError

ENV_PREFIX = "LIVESPEECH_"
_ALIASES = {"model_path": ("--model",)}
# settings that hold secrets: env (or a file) only, never a flag, never in repr()
ENV_ONLY = frozenset({"auth_tokens"})
# ServerConfig.matmul_weights (server/runner.py resolves auto); EngineConfig's is one of the rest
MATMUL_WEIGHTS = ("auto", "int8", "bfloat16", "float32")
# a CPU-only choice, in the order (auto, on, off) that server/runner.py reads
CODEC_RUNTIMES = ("auto", "native", "onnx", "torch")  # ServerConfig.codec_runtime


def default_voices_dir() -> Path:
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "livespeech" / "voices"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 50051  # 0 = any free port
    # Prometheus exporter; 0 = disabled, -1 = any free port. Not 9090 (Prometheus's own):
    # 9464 is the OpenTelemetry Prometheus exporter's, the convention for an application's /metrics
    metrics_port: int = 9464
    # WebSocket and OpenAI-compatible HTTP endpoints (server/web.py); 0 = disabled (the
    # default: a deployment opens only the ports it names), -1 = any free port. Same
    # host, TLS and tokens as gRPC
    http_port: int = 0
    model_path: Optional[Path] = None  # None = the embedded default model
    device: str = "cpu"  # cpu | cuda | cuda:N
    # replay the decode step, and the codec's steady packets, from CUDA graphs
    # (models/step_graph.py); CUDA devices only
    cuda_graphs: bool = False
    # the CUDA graphs record the decode step compiled by torch.compile (Inductor: its
    # elementwise ops fused into fewer kernels; compiled at start-up, ~2 graphs); off
    # until a GPU run measures it (docs/loadtest.md)
    compile_step: bool = False
    # on the CPU, run the model step (and the streaming codec under codec_runtime torch) as
    # frozen TorchScript graphs (models/step_graph.py): the same ops without Python
    # between them; false = eager
    frozen_step: bool = True
    # on the CPU, run the model step as one native call (models/native_step.py: the
    # matmuls in MKL and fbgemm, everything between them fused into loops), built once by
    # the C++ compiler (at install, else at the first start); without a build or a
    # compiler, the frozen graph
    native_step: bool = True
    # on the CPU, decode steady-state packets on a second thread, beside the next model step
    codec_thread: bool = True
    # the weights of the decode step's widest matmuls (output heads, Mamba in/out
    # projections): int8 (x86 CPUs, fbgemm; each call's activations quantised to int8),
    # bfloat16 (on the CPU from 2 sessions a step; on a GPU at every step, the
    # cross-attention's projections and the text memory in bfloat16 too) or float32;
    # auto = int8 on an x86 CPU with AVX2, else bfloat16 where the CPU has bf16 dot
    # products or the GPU bfloat16, else float32 (server/runner.py; docs/loadtest.md)
    matmul_weights: str = "auto"
    # on the CPU, what runs the streaming codec: native = one native call (models/native/
    # codec.cpp, built with the native step; where it cannot be built, onnx), onnx = ONNX
    # Runtime (its kernels run the codec's small ops ~1.3-2.2x faster than TorchScript),
    # torch = the frozen graph above; auto = native (server/runner.py; docs/loadtest.md)
    codec_runtime: str = "auto"
    # every session's grapheme guidance as tensors on the model's device
    # (models/guidance_batch.py: no per-session Python and no device read for it in a
    # step); off by default: on the CPU it costs more than the per-session Python
    # (docs/loadtest.md), on a GPU it is not measured yet
    device_guidance: bool = False
    # classifier-free guidance on the text: each step's logits moved this many times
    # their difference further from the decoder's prediction without text
    # (models/livespeech.py text_guided; the decoder without text steps beside every
    # session, about doubling the step); 0 = off
    text_cfg_scale: float = 0.0
    # the model's letter schedule (models/front_end.py), where the model directory has
    # one: each session's letters forced on a predicted timeline and codebook 1 drawn
    # given each frame's phone; off = the decoder's own graphemes
    letter_schedule: bool = True
    # numbers, money, times, symbols, initialisms, addresses and abbreviations said in
    # words before the model reads them (models/spoken_form.py); off = every word read as written
    spoken_form: bool = True
    max_sessions: int = 16
    max_sessions_per_tenant: int = 0  # open sessions one tenant may hold; 0 = no limit but max_sessions
    voices_dir: Optional[Path] = None  # None = voices kept in memory only
    # replicas may share voices_dir (a ReadWriteMany volume): a lookup re-reads its own
    # voice's file and ListVoices its tenant's directory at once; this re-reads the whole
    # directory every this many seconds, so voices others registered are enrolled before
    # their first session and deleted ones leave memory (server/voices.py); 0 = never
    voices_rescan_s: float = 30.0
    # limits
    max_text_piece_chars: int = 2_000
    max_session_text_chars: int = 100_000
    max_enrollment_seconds: float = 30.0
    max_voices: int = 1_000
    max_voices_per_tenant: int = 100  # registered voices one tenant may hold
    # Synthesize streams open at once; more are refused (RESOURCE_EXHAUSTED with
    # retry-after-ms) before they are read. Streams waiting for their config hold no
    # engine slot, so without this bound abandoned streams could pile up. The cap is
    # Synthesize's alone: health checks, reflection and the voice methods are never
    # refused for it; 0 = 8 * max_sessions + 64
    max_synthesize_streams: int = 0
    # timeouts
    config_timeout_s: float = 10.0  # first message -> DEADLINE_EXCEEDED
    idle_timeout_s: float = 60.0  # no message and nothing to generate -> DEADLINE_EXCEEDED
    max_session_wall_s: float = 3_600.0  # a session open this long -> DEADLINE_EXCEEDED (frees its slot)
    drain_grace_s: float = 30.0  # SIGTERM: in-flight sessions may finish for this long
    # a session whose client has read less audio than real time allows, by more than
    # this many seconds, while the server had audio waiting for it: RESOURCE_EXHAUSTED
    # "client is not reading", slot freed. What the client's gRPC library took into its
    # flow-control window counts as read. Stalls shorter than this are not cut off
    slow_reader_grace_s: float = 5.0
    # events queued per session for a client that does not take them (memory backstop;
    # the grace ends a stalled client first: the engine makes ~1x real time, and this
    # holds 2 s of lead + the grace in 20 ms packets); more and the client "is not reading"
    max_buffered_packets: int = 1024
    torch_threads: int = 0  # intra-op threads; 0 = auto (app.torch_threads: half the CPUs beside the codec thread)
    # engines in child processes of the server (server/engine_pool.py), the slots split
    # over them: one engine steps on one thread. 0 = auto (app.engine_processes: one per
    # CPU on the cpu device, one on a GPU). On a GPU the K engines share the card, each
    # with its own CUDA context, weights and graphs: the host's work of a step, which
    # grows with the sessions, spreads over K cores
    engine_processes: int = 1
    retry_after_ms: int = 1_000  # advertised to clients refused for capacity
    # security (server/auth.py): TLS with a PEM certificate chain and key; mutual TLS
    # when a client CA is set (clients without a certificate it signed cannot connect)
    tls_cert: Optional[Path] = None
    tls_key: Optional[Path] = None
    tls_client_ca: Optional[Path] = None
    # bearer tokens, `tenant:token` per line; `auth_tokens` (env LIVESPEECH_AUTH_TOKENS
    # only, `tenant:token,...`) adds more. Neither set: no authentication (every caller
    # is the anonymous tenant). Parsed by server/auth.py at startup
    auth_tokens_file: Optional[Path] = None
    auth_tokens: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        for name in ("model_path", "voices_dir", "tls_cert", "tls_key", "tls_client_ca", "auth_tokens_file"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(bool(self.host), "host must not be empty")
        need(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        need(-1 <= self.metrics_port <= 65535, f"metrics_port must be in [-1, 65535], got {self.metrics_port}")
        need(-1 <= self.http_port <= 65535, f"http_port must be in [-1, 65535], got {self.http_port}")
        need(
            self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:"),
            f"device must be cpu, cuda or cuda:N, got {self.device!r}",
        )
        need(not self.cuda_graphs or self.device.startswith("cuda"), "cuda_graphs needs a cuda device")
        need(not self.compile_step or self.cuda_graphs, "compile_step needs cuda_graphs")
        need(self.matmul_weights in MATMUL_WEIGHTS,
             f"matmul_weights must be one of {', '.join(MATMUL_WEIGHTS)}, got {self.matmul_weights!r}")
        need(self.matmul_weights != "int8" or self.device == "cpu", "matmul_weights int8 applies to the cpu device")
        need(self.codec_runtime in CODEC_RUNTIMES,
             f"codec_runtime must be one of {', '.join(CODEC_RUNTIMES)}, got {self.codec_runtime!r}")
        need(self.codec_runtime not in ("native", "onnx") or self.device == "cpu",
             f"codec_runtime {self.codec_runtime} applies to the cpu device")
        need(0 <= self.text_cfg_scale <= 10, f"text_cfg_scale must be in [0, 10], got {self.text_cfg_scale}")
        need(1 <= self.max_sessions <= 4096, f"max_sessions must be in [1, 4096], got {self.max_sessions}")
        need(self.max_text_piece_chars >= 1, "max_text_piece_chars must be >= 1")
        need(
            self.max_session_text_chars >= self.max_text_piece_chars,
            "max_session_text_chars must be >= max_text_piece_chars",
        )
        need(0 < self.max_enrollment_seconds <= 600, "max_enrollment_seconds must be in (0, 600]")
        need(self.max_voices >= 0, "max_voices must be >= 0")
        need(self.voices_rescan_s >= 0, f"voices_rescan_s must be >= 0 (0 = never), got {self.voices_rescan_s}")
        need(self.config_timeout_s > 0, "config_timeout_s must be > 0")
        need(self.idle_timeout_s > 0, "idle_timeout_s must be > 0")
        need(self.max_session_wall_s > 0, "max_session_wall_s must be > 0")
        need(self.max_sessions_per_tenant >= 0, "max_sessions_per_tenant must be >= 0 (0 = no limit)")
        need(self.drain_grace_s >= 0, "drain_grace_s must be >= 0")
        need(self.max_buffered_packets >= 1, "max_buffered_packets must be >= 1")
        need(0 < self.slow_reader_grace_s <= 3_600, f"slow_reader_grace_s must be in (0, 3600], got {self.slow_reader_grace_s}")
        need(self.torch_threads >= 0, "torch_threads must be >= 0")
        need(0 <= self.engine_processes <= 64, f"engine_processes must be in [0, 64], got {self.engine_processes}")
        need(self.retry_after_ms >= 0, "retry_after_ms must be >= 0")
        need(self.max_voices_per_tenant >= 0, "max_voices_per_tenant must be >= 0")
        need(self.max_synthesize_streams >= 0, "max_synthesize_streams must be >= 0 (0 = automatic)")
        need((self.tls_cert is None) == (self.tls_key is None), "tls_cert and tls_key go together")
        need(self.tls_client_ca is None or self.tls_cert is not None, "tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_tokens_file"):
            path = getattr(self, name)
            need(path is None or path.is_file(), f"{name}: {path} is not a file")

    @property
    def synthesize_stream_limit(self) -> int:
        """`max_synthesize_streams`, resolved: room for every slot's stream and several
        queued streams per slot (clients racing for capacity get the engine's "at
        capacity" refusal)."""
        return self.max_synthesize_streams or 8 * self.max_sessions + 64

    @property
    def max_message_bytes(self) -> int:
        """The largest request message taken: enrollment audio (PCM16 at 48 kHz, or a WAV
        of up to 32-bit stereo at 48 kHz) for max_enrollment_seconds, plus headroom; at
        least 4 MiB. In JSON (server/web.py) the audio is base64: 4/3 of this."""
        return max(int(self.max_enrollment_seconds * 48_000 * 8) + (1 << 20), 4 << 20)

    def replace(self, **kw: Any) -> "ServerConfig":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------ flags and env

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One `--flag-name` per field; unset flags fall back to env, then defaults."""
        for f in fields(cls):
            if f.name in ENV_ONLY:
                continue
            flag = "--" + f.name.replace("_", "-")
            kind = _field_type(f)
            parser.add_argument(
                flag,
                *_ALIASES.get(f.name, ()),
                dest=f.name,
                default=None,
                type=str if kind in (Path, _parse_bool) else kind,
                metavar=f.name.upper(),
                help=f"default {f.default!r} (env {ENV_PREFIX}{f.name.upper()})",
            )

    @classmethod
    def from_sources(
        cls, args: Optional[argparse.Namespace] = None, env: Optional[Mapping[str, str]] = None
    ) -> "ServerConfig":
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw: Any = getattr(args, f.name, None) if args is not None else None
            if raw is None:
                raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            kind = _field_type(f)
            try:
                if kind is Path and raw in ("", "none", "None"):  # "": no path (e.g. voices in memory)
                    values[f.name] = None
                else:
                    values[f.name] = kind(raw)
            except (TypeError, ValueError):
                what = "true/false" if kind is _parse_bool else kind.__name__
                raise ConfigError(f"{f.name}: cannot parse {raw!r} as {what}") from None
        return cls(**values)

    @classmethod
    def from_args(cls, argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None) -> "ServerConfig":
        # no prefix matching: "--auth-tokens SECRET" must not become --auth-tokens-file
        parser = argparse.ArgumentParser(prog="livespeech serve", allow_abbrev=False)
        cls.add_arguments(parser)
        return cls.from_sources(parser.parse_args(argv), env)


def _parse_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def _field_type(f: dataclasses.Field):
    t = str(f.type)
    for name, kind in (("bool", _parse_bool), ("Path", Path), ("float", float), ("int", int), ("str", str)):
        if name in t:
            return kind
    raise TypeError(f"unsupported field type {t}")  # pragma: no cover


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings; those the server also has default to the server's
    (`ServerConfig`, their one home), which `livespeech.server.app.engine_config` passes on."""
    max_sessions: int = ServerConfig.max_sessions
    # a session this far ahead of its playback is skipped for a step (others go first)
    max_lead_s: float = 2.0
    # ... and this far ahead while another session is starting (first packet and packet
    # ramp), so that one steps at a smaller batch (server/scheduler.py)
    yield_lead_s: float = 0.5
    # runaway guard: once the text is complete, speech may run this long past the
    # expected end of its text, or this long without transcript progress
    max_overrun_s: float = 3.0
    max_session_s: float = 600.0
    max_text_piece_chars: int = ServerConfig.max_text_piece_chars
    max_session_text_chars: int = ServerConfig.max_session_text_chars
    idle_poll_s: float = 0.01
    # a session's first packet holds at least this many step periods of audio, and while
    # its packets ramp up to packet_ms a shorter one goes out as soon as its listener has
    # less than that left. 6, not 3: with 3 the first packet was mostly 2 frames (27 ms)
    # and nearly every listener's least audio in hand came just before the second packet
    # (p1 -2 to 5 ms at 10-16 sessions on 2 cores), where levels failed with one underrun
    # (docs/loadtest.md, "Measured choices")
    low_water_steps: float = 6.0
    # ... and at least this much audio whatever the step period: the wait for the second
    # packet is also its codec call and its delivery, which do not shrink with the step.
    # A 2-frame (27 ms) first packet left listeners 13-19 ms to spare at 10-16 sessions
    # through gRPC (p10 to median), down to -1 ms: the only underrun of levels passing
    # above it; 3 frames left 23-28 ms (docs/loadtest.md, "Measured choices")
    first_packet_min_ms: float = 40.0
    # the model step and the codec's steady packets replayed from CUDA graphs, one per
    # batch-size bucket (models/step_graph.py)
    cuda_graphs: bool = ServerConfig.cuda_graphs
    # the step the CUDA graphs record compiled by torch.compile (models/step_graph.py)
    compile_step: bool = ServerConfig.compile_step
    # on the CPU, the model step and the codec as frozen TorchScript graphs (models/step_graph.py)
    frozen_step: bool = ServerConfig.frozen_step
    # on the CPU, the model step as one native call where it builds (models/native_step.py)
    native_step: bool = ServerConfig.native_step
    # the weights of the step's widest matmuls: float32, bfloat16 or int8 (server/runner.py)
    matmul_weights: str = "float32"
    # the batch size bfloat16 or int8 weights start at (None: server/runner.py's
    # LOW_PRECISION_FROM_BATCH on the CPU, 1 on a GPU)
    low_precision_from_batch: Optional[int] = None
    # what runs the streaming codec on the CPU: native, onnx or torch (server/runner.py
    # `codec_runtime`)
    codec_runtime: str = "torch"
    # the text tokens with the lowest ids (the BPE's first merges, its most frequent)
    # projected into the text K/V cache at start-up, so a fresh server's first sessions
    # do not pay a projection a word (models/inference.py, TextKV); the server: 2,048
    warm_text_tokens: int = 0
    # `Engine.start` returns after short sessions of a built-in voice went through the
    # engine, so that the first clients' sessions do not meet its first calls
    # (server/engine.py); the server: on
    warm_up: bool = False
    # every session's guidance as tensors in the runner (server/runner.py, SlotGuidance)
    device_guidance: bool = ServerConfig.device_guidance
    # classifier-free guidance on the text (server/runner.py)
    text_cfg_scale: float = ServerConfig.text_cfg_scale
    # the letter schedule, where the bundle has a front end (server/session.py)
    letter_schedule: bool = ServerConfig.letter_schedule
    # written words said in words (server/text_memory.py)
    spoken_form: bool = ServerConfig.spoken_form
    # packets after a session's first are decoded on a codec thread while the next model
    # step runs (on the CPU on the other core, on CUDA on a stream of its own; their audio
    # goes out a step later; a session's first and last packets stay on the engine
    # thread). On 2 CPU cores it cut the starved audio at four sessions four- to
    # sevenfold (docs/loadtest.md); its memory cost was within the soak's noise
    # (docs/reliability.md, section 4). Unmeasured on CUDA yet.
    codec_thread: bool = ServerConfig.codec_thread

    def validate(self) -> "EngineConfig":
        if not 1 <= self.max_sessions <= 4096:
            raise ConfigError("max_sessions must be in [1, 4096]")
        if self.max_lead_s <= 0 or self.max_overrun_s <= 0 or self.max_session_s <= 0:
            raise ConfigError("engine time limits must be positive")
        if self.yield_lead_s <= 0:
            raise ConfigError("yield_lead_s must be positive")
        if not 0 <= self.text_cfg_scale <= 10:
            raise ConfigError(f"text_cfg_scale must be in [0, 10], got {self.text_cfg_scale}")
        if not 0 <= self.low_water_steps <= 100:
            raise ConfigError("low_water_steps must be in [0, 100]")
        if not 0 <= self.first_packet_min_ms <= 1000:
            raise ConfigError("first_packet_min_ms must be in [0, 1000]")
        if self.warm_text_tokens < 0:
            raise ConfigError("warm_text_tokens must be >= 0")
        if self.matmul_weights not in MATMUL_WEIGHTS[1:]:
            raise ConfigError(f"matmul_weights must be one of {', '.join(MATMUL_WEIGHTS[1:])}, "
                              f"got {self.matmul_weights!r}")
        if self.low_precision_from_batch is not None and self.low_precision_from_batch < 1:
            raise ConfigError("low_precision_from_batch must be >= 1")
        return self
