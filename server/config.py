"""`ServerConfig`: every server setting, validated once at the edge.

Sources, highest precedence first: command-line flags, `LIVESPEECH_<FIELD>` environment
variables (e.g. `LIVESPEECH_PORT=50051`, `LIVESPEECH_MAX_SESSIONS=8`), defaults.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from .session_api import ConfigError

ENV_PREFIX = "LIVESPEECH_"
_ALIASES = {"model_path": ("--model",)}


def default_voices_dir() -> Path:
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "livespeech" / "voices"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 50051  # 0 = any free port
    metrics_port: int = 9090  # Prometheus exporter; 0 = disabled, -1 = any free port
    model_path: Optional[Path] = None  # None = the embedded default model
    device: str = "cpu"  # cpu | cuda | cuda:N
    max_sessions: int = 16
    voices_dir: Optional[Path] = None  # None = voices kept in memory only
    # limits
    max_text_piece_chars: int = 2_000
    max_session_text_chars: int = 100_000
    max_enrollment_seconds: float = 30.0
    max_voices: int = 1_000
    # timeouts
    config_timeout_s: float = 10.0  # first message -> DEADLINE_EXCEEDED
    idle_timeout_s: float = 60.0  # no message and nothing to generate -> DEADLINE_EXCEEDED
    drain_grace_s: float = 30.0  # SIGTERM: in-flight sessions may finish for this long
    max_buffered_packets: int = 256  # per session; more and the client "is not reading"
    torch_threads: int = 0  # 0 = torch's default
    retry_after_ms: int = 1_000  # advertised to clients refused for capacity

    def __post_init__(self) -> None:
        if self.model_path is not None and not isinstance(self.model_path, Path):
            object.__setattr__(self, "model_path", Path(self.model_path))
        if self.voices_dir is not None and not isinstance(self.voices_dir, Path):
            object.__setattr__(self, "voices_dir", Path(self.voices_dir))
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(bool(self.host), "host must not be empty")
        need(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        need(-1 <= self.metrics_port <= 65535, f"metrics_port must be in [-1, 65535], got {self.metrics_port}")
        need(
            self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:"),
            f"device must be cpu, cuda or cuda:N, got {self.device!r}",
        )
        need(1 <= self.max_sessions <= 4096, f"max_sessions must be in [1, 4096], got {self.max_sessions}")
        need(self.max_text_piece_chars >= 1, "max_text_piece_chars must be >= 1")
        need(
            self.max_session_text_chars >= self.max_text_piece_chars,
            "max_session_text_chars must be >= max_text_piece_chars",
        )
        need(0 < self.max_enrollment_seconds <= 600, "max_enrollment_seconds must be in (0, 600]")
        need(self.max_voices >= 0, "max_voices must be >= 0")
        need(self.config_timeout_s > 0, "config_timeout_s must be > 0")
        need(self.idle_timeout_s > 0, "idle_timeout_s must be > 0")
        need(self.drain_grace_s >= 0, "drain_grace_s must be >= 0")
        need(self.max_buffered_packets >= 1, "max_buffered_packets must be >= 1")
        need(self.torch_threads >= 0, "torch_threads must be >= 0")
        need(self.retry_after_ms >= 0, "retry_after_ms must be >= 0")

    def replace(self, **kw: Any) -> "ServerConfig":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------ flags and env

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One `--flag-name` per field; unset flags fall back to env, then defaults."""
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind = _field_type(f)
            parser.add_argument(
                flag,
                *_ALIASES.get(f.name, ()),
                dest=f.name,
                default=None,
                type=str if kind is Path else kind,
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
                raise ConfigError(f"{f.name}: cannot parse {raw!r} as {kind.__name__}") from None
        return cls(**values)

    @classmethod
    def from_args(cls, argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None) -> "ServerConfig":
        parser = argparse.ArgumentParser(prog="livespeech serve")
        cls.add_arguments(parser)
        return cls.from_sources(parser.parse_args(argv), env)


def _field_type(f: dataclasses.Field) -> type:
    t = str(f.type)
    for name, kind in (("Path", Path), ("float", float), ("int", int), ("str", str)):
        if name in t:
            return kind
    raise TypeError(f"unsupported field type {t}")  # pragma: no cover
