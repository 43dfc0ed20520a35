"""The wire protocol: `protos/livespeech/v1/livespeech.proto`, compiled on first import.

Generated code is never committed. On import this module runs `grpc_tools.protoc` into
`protos/gen/` (gitignored) when the generated module is missing or stale (the stamp
is a hash of the .proto and the protoc/protobuf versions), or into a per-user cache
directory when the package directory is read-only (an installed package); set
`LIVESPEECH_GEN_DIR` to choose the directory. Only the message module (`_pb2`) is
generated: the service's method table is read from its descriptor (`method_handlers`,
`Stub`), so no generated module imports another by a top-level name.

Requests whose bytes do not decode reach the handlers as `Malformed` (see there).

It also holds the one mapping between proto messages and the session types
(protos/session.py), used by the server and the client both ways: `config_*_proto`,
`event_*_proto` (Started, AudioPacket, WordTiming, Summary), `summary_*_proto`,
`voice_info_*_proto`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import grpc

from .cache import user_cache
from .session import (AudioPacket, ChunkingConfig, ConfigError, Encoding, SessionConfig, Started, Summary,
                      VoiceInfo, WordTiming)

PROTO_REL = "livespeech/v1/livespeech.proto"
# what may follow "Bearer " in the `authorization` metadata (RFC 6750 b64token); the
# server (server/auth.py) and the client library check tokens against it
BEARER_TOKEN_RE = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
SERVICE_NAME = "livespeech.v1.LiveSpeech"
_MODULE_NAME = "livespeech.api.gen.livespeech_pb2"


def _proto_root() -> Path:
    """The folder holding `livespeech/v1/livespeech.proto`: this package's own (a source
    checkout's `protos/`, or the installed package data)."""
    root = Path(__file__).resolve().parent
    if not (root / PROTO_REL).is_file():
        raise FileNotFoundError(f"{PROTO_REL} not found in {root}")
    return root


def _stamp(proto_text: bytes) -> str:
    import google.protobuf
    import grpc_tools

    versions = f"{getattr(grpc_tools, '__version__', '')}|{google.protobuf.__version__}"
    try:
        from importlib.metadata import version

        versions += "|" + version("grpcio-tools")
    except Exception:  # pragma: no cover - metadata missing
        pass
    return hashlib.sha256(proto_text + versions.encode()).hexdigest()[:16]


def _gen_dirs() -> list[Path]:
    env = os.environ.get("LIVESPEECH_GEN_DIR")
    if env:
        return [Path(env)]
    return [Path(__file__).resolve().parent / "gen", user_cache("gen")]


def _generate(root: Path, out_dir: Path, stamp: str) -> Path:
    """Compile into out_dir/<stamp>/ atomically; returns the _pb2.py path."""
    from grpc_tools import protoc
    import grpc_tools

    target = out_dir / stamp / "livespeech_pb2.py"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(
        ["protoc", f"-I{root}", f"-I{well_known}", f"--python_out={tmp}", str(root / PROTO_REL)]
    )
    produced = tmp / "livespeech" / "v1" / "livespeech_pb2.py"
    if rc != 0 or not produced.is_file():
        raise RuntimeError(f"protoc failed ({rc}) compiling {root / PROTO_REL}")
    (out_dir / stamp).mkdir(exist_ok=True)
    os.replace(produced, target)  # atomic: concurrent importers see a whole file or none
    _rmtree(tmp)
    return target


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _load() -> ModuleType:
    if _MODULE_NAME in sys.modules:
        return sys.modules[_MODULE_NAME]
    root = _proto_root()
    stamp = _stamp((root / PROTO_REL).read_bytes())
    errors = []
    for out_dir in _gen_dirs():
        try:
            path = _generate(root, out_dir, stamp)
            break
        except OSError as e:  # read-only install dir: try the next candidate
            errors.append(f"{out_dir}: {e}")
    else:
        raise RuntimeError("cannot write generated protocol code: " + "; ".join(errors))
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE_NAME] = module
    spec.loader.exec_module(module)
    return module


pb = _load()
"""The generated message module: `pb.SynthesizeRequest`, `pb.AudioPacket`, ..."""

SERVICE = pb.DESCRIPTOR.services_by_name["LiveSpeech"]


def _message_class(descriptor) -> Any:
    return getattr(pb, descriptor.name)


def rpc_shape(client_streaming: bool, server_streaming: bool) -> str:
    """grpc's name for a method's shape: unary_unary, unary_stream, stream_unary, stream_stream."""
    return f"{'stream' if client_streaming else 'unary'}_{'stream' if server_streaming else 'unary'}"


def rpc_method_handler(behavior: Any, client_streaming: bool, server_streaming: bool, **kw: Any) -> grpc.RpcMethodHandler:
    """`grpc.<shape>_rpc_method_handler(behavior, **kw)` for a method of that shape."""
    return getattr(grpc, f"{rpc_shape(client_streaming, server_streaming)}_rpc_method_handler")(behavior, **kw)


class Malformed:
    """A request whose bytes did not decode (invalid UTF-8 in a string field, corrupt wire
    format). The request deserializer returns this instead of raising: grpc.aio answers a
    deserializer's exception with INTERNAL or UNKNOWN and logs a traceback, where the
    client's mistake is INVALID_ARGUMENT (the service decides, `message` says why)."""

    __slots__ = ("type_name", "reason")

    def __init__(self, type_name: str, reason: str) -> None:
        self.type_name = type_name
        self.reason = reason

    @property
    def message(self) -> str:
        return f"malformed {self.type_name}: {self.reason}"


def _lenient_decoder(cls: Any) -> Any:
    from google.protobuf.empty_pb2 import Empty
    from google.protobuf.message import DecodeError

    def decode(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except DecodeError:
            # protobuf's own message names the cause in some versions only: tell the two
            # apart here. Empty keeps every field as an unknown one, unchecked, so bytes it
            # takes are sound wire format whose fields are not (a string that is not UTF-8)
            try:
                Empty.FromString(data)
                reason = "a string field is not valid UTF-8"
            except DecodeError:
                reason = "corrupt wire format"
            return Malformed(cls.DESCRIPTOR.name, reason)

    return decode


def method_handlers(servicer: object) -> grpc.GenericRpcHandler:
    """A generic handler routing each method of the service to `servicer.<Method>`;
    requests that do not decode arrive as `Malformed`."""
    handlers = {}
    for m in SERVICE.methods:
        handlers[m.name] = rpc_method_handler(
            getattr(servicer, m.name),
            m.client_streaming,
            m.server_streaming,
            request_deserializer=_lenient_decoder(_message_class(m.input_type)),
            response_serializer=_message_class(m.output_type).SerializeToString,
        )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


class Stub:
    """Client stub for a sync `grpc.Channel` or a `grpc.aio.Channel`."""

    def __init__(self, channel: Any) -> None:
        for m in SERVICE.methods:
            factory = getattr(channel, rpc_shape(m.client_streaming, m.server_streaming))
            setattr(
                self,
                m.name,
                factory(
                    f"/{SERVICE_NAME}/{m.name}",
                    request_serializer=_message_class(m.input_type).SerializeToString,
                    response_deserializer=_message_class(m.output_type).FromString,
                ),
            )


# --------------------------------------------------------------------------- config

_ENCODINGS = {
    pb.AUDIO_ENCODING_UNSPECIFIED: Encoding.PCM16,
    pb.AUDIO_ENCODING_PCM16_LE: Encoding.PCM16,
    pb.AUDIO_ENCODING_MULAW: Encoding.MULAW,
}
_ENCODINGS_BACK = {Encoding.PCM16: pb.AUDIO_ENCODING_PCM16_LE, Encoding.MULAW: pb.AUDIO_ENCODING_MULAW}


@dataclass(frozen=True)
class Enrollment:
    """Inline reference speech from a config (decoded later, under the server's limits)."""

    pcm16_le: bytes
    sample_rate: int


def config_from_proto(msg: "pb.SynthesizeConfig") -> tuple[SessionConfig, Optional[Enrollment]]:
    """The one place a wire config becomes a validated `SessionConfig`.

    Unset optional fields take `SessionConfig`'s defaults. Raises `ConfigError` with a
    message naming the field."""
    d = SessionConfig()
    c = msg.chunking
    dc = d.chunking

    def opt(m: Any, name: str, default: Any) -> Any:
        return getattr(m, name) if m.HasField(name) else default

    if msg.encoding not in _ENCODINGS:
        raise ConfigError(f"encoding: unknown value {msg.encoding}")
    lam = opt(msg, "guidance_lambda", d.guidance_lambda)
    if math.isnan(lam):
        raise ConfigError("guidance_lambda must be >= 0 (inf for hard guidance), got NaN")
    enrollment = None
    voice_id = ""
    which = msg.WhichOneof("voice")
    if which == "voice_id":
        voice_id = msg.voice_id
        if not voice_id:
            raise ConfigError("voice_id: empty (leave the voice unset for the default voice)")
    elif which == "enrollment":
        enrollment = Enrollment(bytes(msg.enrollment.pcm16_le), msg.enrollment.sample_rate)
    cfg = SessionConfig(
        voice_id=voice_id,
        sample_rate=opt(msg, "sample_rate", d.sample_rate),
        encoding=_ENCODINGS[msg.encoding],
        packet_ms=opt(msg, "packet_ms", d.packet_ms),
        min_packet_ms=opt(msg, "min_packet_ms", d.min_packet_ms),
        n_past_chunks=opt(msg, "n_past_chunks", d.n_past_chunks),
        n_future_chunks=opt(msg, "n_future_chunks", d.n_future_chunks),
        start_future_chunks=opt(msg, "start_future_chunks", d.start_future_chunks),
        max_buffer_delay_ms=opt(msg, "max_buffer_delay_ms", d.max_buffer_delay_ms),
        chunking=ChunkingConfig(
            min_words=opt(c, "min_words", dc.min_words),
            max_words=opt(c, "max_words", dc.max_words),
            timer_ms=opt(c, "timer_ms", dc.timer_ms),
            flush_on_punctuation=opt(c, "flush_on_punctuation", dc.flush_on_punctuation),
            first_max_words=opt(c, "first_max_words", dc.first_max_words),
            release_when_waiting=opt(c, "release_when_waiting", dc.release_when_waiting),
        ),
        guidance_lambda=lam,
        top_k=opt(msg, "top_k", d.top_k),
        grapheme_top_k=opt(msg, "grapheme_top_k", d.grapheme_top_k),
        grapheme_temperature=opt(msg, "grapheme_temperature", d.grapheme_temperature),
        first_codebook_temperature=opt(msg, "first_codebook_temperature", d.first_codebook_temperature),
        acoustic_temperature=opt(msg, "acoustic_temperature", d.acoustic_temperature),
        seed=opt(msg, "seed", d.seed),
        timestamps_are_speech_time=msg.timestamps_are_speech_time,
    )
    return cfg.validate(), enrollment


def config_to_proto(cfg: SessionConfig, enrollment: Optional[Enrollment] = None) -> "pb.SynthesizeConfig":
    """Every field set explicitly (the client's request; the server's `started` echo)."""
    ch = cfg.chunking
    msg = pb.SynthesizeConfig(
        sample_rate=cfg.sample_rate,
        encoding=_ENCODINGS_BACK[cfg.encoding],
        packet_ms=cfg.packet_ms,
        min_packet_ms=cfg.min_packet_ms,
        n_past_chunks=cfg.n_past_chunks,
        n_future_chunks=cfg.n_future_chunks,
        start_future_chunks=cfg.start_future_chunks,
        max_buffer_delay_ms=cfg.max_buffer_delay_ms,
        chunking=pb.ChunkingPolicy(
            min_words=ch.min_words,
            max_words=ch.max_words,
            timer_ms=ch.timer_ms,
            flush_on_punctuation=ch.flush_on_punctuation,
            first_max_words=ch.first_chunk_words,
            release_when_waiting=ch.release_when_waiting,
        ),
        guidance_lambda=cfg.guidance_lambda,
        top_k=cfg.top_k,
        grapheme_top_k=cfg.grapheme_top_k,
        grapheme_temperature=cfg.grapheme_temperature,
        first_codebook_temperature=cfg.first_codebook_temperature,
        acoustic_temperature=cfg.acoustic_temperature,
        timestamps_are_speech_time=cfg.timestamps_are_speech_time,
    )
    if cfg.seed is not None:
        msg.seed = cfg.seed
    if enrollment is not None:
        msg.enrollment.pcm16_le = enrollment.pcm16_le
        msg.enrollment.sample_rate = enrollment.sample_rate
    elif cfg.voice_id:
        msg.voice_id = cfg.voice_id
    return msg


_SUMMARY_OPTIONAL = ("ttfa_s", "lookahead_wait_s", "compute_fpl_s", "all_words_spoken")


def summary_to_proto(s: Summary) -> "pb.SessionSummary":
    """A session's `Summary` on the wire (None fields left unset); `summary_from_proto`
    reads it back."""
    msg = pb.SessionSummary(frames=s.frames, audio_s=s.audio_s, cancelled=s.cancelled, spoken_text=s.spoken_text,
                            unspoken_words=s.unspoken_words)
    for name in _SUMMARY_OPTIONAL:
        value = getattr(s, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def summary_from_proto(msg: "pb.SessionSummary") -> Summary:
    opt = {name: getattr(msg, name) if msg.HasField(name) else None for name in _SUMMARY_OPTIONAL}
    return Summary(frames=msg.frames, audio_s=msg.audio_s, cancelled=msg.cancelled, spoken_text=msg.spoken_text,
                   unspoken_words=tuple(msg.unspoken_words), **opt)


def event_to_proto(ev: "Started | AudioPacket | WordTiming | Summary") -> "pb.SynthesizeResponse":
    """A session event as the server sends it; `event_from_proto` reads it back."""
    if isinstance(ev, AudioPacket):
        return pb.SynthesizeResponse(audio=pb.AudioPacket(seq=ev.seq, data=ev.data, start_s=ev.start_s,
                                                          duration_s=ev.duration_s))
    if isinstance(ev, WordTiming):
        return pb.SynthesizeResponse(word=pb.WordTiming(word=ev.word, start_s=ev.start_s, end_s=ev.end_s))
    if isinstance(ev, Summary):
        return pb.SynthesizeResponse(summary=summary_to_proto(ev))
    if isinstance(ev, Started):
        return pb.SynthesizeResponse(started=pb.Started(session_id=ev.session_id, config=config_to_proto(ev.config)))
    raise TypeError(f"not a session event: {type(ev).__name__}")


def event_from_proto(msg: "pb.SynthesizeResponse") -> "Optional[Started | AudioPacket | WordTiming | Summary]":
    """A response as an event; None for a message kind this side does not know (a newer
    server's)."""
    kind = msg.WhichOneof("response")
    if kind == "audio":
        a = msg.audio
        return AudioPacket(a.seq, a.data, a.start_s, a.duration_s)
    if kind == "word":
        return WordTiming(msg.word.word, msg.word.start_s, msg.word.end_s)
    if kind == "started":
        cfg, _ = config_from_proto(msg.started.config)
        return Started(msg.started.session_id, cfg)
    if kind == "summary":
        return summary_from_proto(msg.summary)
    return None


def voice_info_to_proto(info: VoiceInfo) -> "pb.VoiceInfo":
    return pb.VoiceInfo(voice_id=info.voice_id, builtin=info.builtin, reference_s=info.reference_s,
                        created_unix_ms=info.created_unix_ms)


def voice_info_from_proto(msg: "pb.VoiceInfo") -> VoiceInfo:
    return VoiceInfo(msg.voice_id, msg.builtin, msg.reference_s, msg.created_unix_ms)
