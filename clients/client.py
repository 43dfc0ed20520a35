"""Client library for the LiveSpeech gRPC service.

Async:

    async with AsyncLiveSpeechClient("127.0.0.1:50051") as client:
        stream = client.synthesize(llm_stream("Hello there, how are you?", rate=40), voice_id="default")
        async for event in stream:          # Started, AudioPacket, WordTiming, Summary
            ...
        # barge-in: await stream.cancel()   -> a Summary with cancelled=True, spoken_text

Sync (a private event loop on a background thread):

    with LiveSpeechClient("127.0.0.1:50051") as client:
        result = client.synthesize_to_result("Hello there.", sample_rate=16000)
        result.write_wav("out.wav")

`text` is a str (sent as one piece), or a sync or async iterable of str / `TextPiece`
(sent as they come; a blocking sync iterator, e.g. stdin, is read on a worker thread).
Errors are `grpc.aio.AioRpcError` with the server's status code and message.

A secured server (docs/reliability.md): `tls_ca=` (PEM path or bytes) verifies the
server's certificate, `tls_cert=`/`tls_key=` add a client certificate (mutual TLS),
`token=` sends `authorization: Bearer <token>` with every call:

    AsyncLiveSpeechClient("tts.example:50051", tls_ca="ca.pem", token=os.environ["LIVESPEECH_TOKEN"])
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import re
import threading
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterable, AsyncIterator, Iterable, Iterator, Optional, Union

import grpc

from server.protocol import BEARER_TOKEN_RE, Enrollment, Stub, config_from_proto, config_to_proto, pb
from server.session_api import AudioPacket, Encoding, SessionConfig, Summary, WordTiming

DEFAULT_TARGET = "127.0.0.1:50051"
log = logging.getLogger(__name__)
Pem = Union[str, Path, bytes]  # a PEM file's path, or its contents


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches a secured server: TLS trusting `tls_ca` (else the system's
    roots when `tls`), a client certificate for mutual TLS, a bearer token. Validated
    here, so a mistake fails before a connection is made; the token is kept out of
    repr() (it would end up in logs)."""

    tls: bool = False
    tls_ca: Optional[Pem] = None
    tls_cert: Optional[Pem] = None
    tls_key: Optional[Pem] = field(default=None, repr=False)
    token: Optional[str] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together (mutual TLS)")
        if any(v is not None for v in (self.tls_ca, self.tls_cert)):
            object.__setattr__(self, "tls", True)
        if self.token is not None and not BEARER_TOKEN_RE.fullmatch(self.token):
            raise ValueError("token must be an RFC 6750 b64token ([A-Za-z0-9-._~+/]+=*), without 'Bearer '")

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel(self, target: str, options: list) -> grpc.aio.Channel:
        if not self.tls:
            if self.token and not _is_loopback(target):
                log.warning("sending a bearer token without TLS to %s: it travels in clear text", target)
            return grpc.aio.insecure_channel(target, options=options)
        creds = grpc.ssl_channel_credentials(
            root_certificates=_pem(self.tls_ca), private_key=_pem(self.tls_key), certificate_chain=_pem(self.tls_cert)
        )
        return grpc.aio.secure_channel(target, creds, options=options)


def _pem(value: Optional[Pem]) -> Optional[bytes]:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


def _is_loopback(target: str) -> bool:
    """Whether a gRPC target ("host:port", "[::1]:port", "dns:///host:port") is this machine."""
    host = target.split("///")[-1]
    if host.startswith("["):
        host = host[1 : host.find("]")]
    elif host.count(":") == 1:
        host = host.split(":")[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class TextPiece:
    text: str
    timestamp_s: Optional[float] = None  # client clock (or speech time, see config)
    flush: bool = False


@dataclass(frozen=True)
class Started:
    session_id: str
    config: SessionConfig  # the effective config (voice_id resolved)


@dataclass(frozen=True)
class VoiceInfo:
    voice_id: str
    builtin: bool
    reference_s: float
    created_unix_ms: int


Event = Union[Started, AudioPacket, WordTiming, Summary]
TextSource = Union[str, Iterable[Union[str, TextPiece]], AsyncIterable[Union[str, TextPiece]]]


# ------------------------------------------------------------------ LLM-like text


_WORD = re.compile(r"\s*\S+|\s+$")


def split_pieces(text: str, piece_chars: int = 4) -> list[str]:
    """Split text into sub-word pieces of about `piece_chars`, the way an LLM streams
    BPE tokens: a leading space starts the next piece ("Hello world" -> "Hell", "o",
    " wor", "ld"); the pieces join back into the text."""
    pieces: list[str] = []
    for m in _WORD.finditer(text):
        word = m.group(0)
        lead = len(word) - len(word.lstrip())
        first = max(piece_chars, lead + 1)  # leading whitespace counts, as in BPE
        pieces.append(word[:first])
        pieces += [word[i : i + piece_chars] for i in range(first, len(word), piece_chars)]
    return [p for p in pieces if p]


async def paced(
    pieces: Iterable[str], rate: float, *, jitter: float = 0.3, seed: Optional[int] = None
) -> AsyncIterator[str]:
    """Yield pieces at `rate` per second, each gap scaled by uniform(1-jitter, 1+jitter)."""
    rng = random.Random(seed)
    for i, p in enumerate(pieces):
        if i and rate > 0:
            await asyncio.sleep(rng.uniform(1 - jitter, 1 + jitter) / rate)
        yield p


def llm_stream(
    text: str, rate: float = 40.0, *, piece_chars: int = 4, jitter: float = 0.3, seed: Optional[int] = None
) -> AsyncIterator[str]:
    """Simulate an LLM token stream of `text`: ~4-char pieces at `rate` tokens/s."""
    return paced(split_pieces(text, piece_chars), rate, jitter=jitter, seed=seed)


def chunk_text(text: str, limit: int = 1000) -> list[str]:
    """Split a long string at word boundaries into pieces of at most `limit` chars (the
    server limits a single text message)."""
    out, cur = [], ""
    for m in _WORD.finditer(text):
        word = m.group(0)
        if len(cur) + len(word) > limit and cur:
            out.append(cur)
            cur = ""
        while len(word) > limit:
            out.append(word[:limit])
            word = word[limit:]
        cur += word
    return out + [cur] if cur else out


async def _aiter_text(text: TextSource) -> AsyncIterator[Union[str, TextPiece]]:
    if isinstance(text, str):
        for piece in chunk_text(text):
            yield piece
    elif hasattr(text, "__aiter__"):
        async for piece in text:  # type: ignore[union-attr]
            yield piece
    elif isinstance(text, (list, tuple)):
        for piece in text:
            yield piece
    else:  # a possibly blocking iterator: read it off the event loop
        it, done = iter(text), object()
        while (piece := await asyncio.to_thread(next, it, done)) is not done:
            yield piece  # type: ignore[misc]


def _text_request(piece: Union[str, TextPiece]) -> "pb.SynthesizeRequest":
    if isinstance(piece, str):
        return pb.SynthesizeRequest(text=pb.TextInput(text=piece))
    msg = pb.TextInput(text=piece.text, flush=piece.flush)
    if piece.timestamp_s is not None:
        msg.timestamp_s = piece.timestamp_s
    return pb.SynthesizeRequest(text=msg)


def build_config(
    config: Optional[SessionConfig] = None,
    *,
    enrollment: Optional[tuple[bytes, int]] = None,
    **overrides: Any,
) -> "pb.SynthesizeConfig":
    """A wire config from a `SessionConfig` and/or keyword overrides (validated here, so
    mistakes fail before the call). `encoding` may be "pcm16"/"mulaw"; `enrollment` is
    (PCM16 LE bytes, sample rate)."""
    cfg = config or SessionConfig()
    if isinstance(overrides.get("encoding"), str):
        overrides["encoding"] = Encoding(overrides["encoding"])
    overrides = {k: v for k, v in overrides.items() if v is not None}
    cfg = cfg.replace(**overrides).validate()
    return config_to_proto(cfg, Enrollment(*enrollment) if enrollment else None)


# ------------------------------------------------------------------ results


@dataclass
class SynthesisResult:
    started: Optional[Started] = None
    audio: bytearray = field(default_factory=bytearray)  # in the session's encoding
    packets: list[AudioPacket] = field(default_factory=list)  # data dropped (see .audio)
    words: list[WordTiming] = field(default_factory=list)
    summary: Optional[Summary] = None
    client_ttfa_s: Optional[float] = None  # first text sent -> first audio received

    @property
    def sample_rate(self) -> int:
        return self.started.config.sample_rate if self.started else 24000

    def pcm16(self) -> bytes:
        """The audio as PCM16 LE (mu-law decoded)."""
        if self.started and self.started.config.encoding is Encoding.MULAW:
            from server.audio import mulaw_to_pcm16

            return mulaw_to_pcm16(bytes(self.audio)).astype("<i2").tobytes()
        return bytes(self.audio)

    def write_wav(self, path: Union[str, Path]) -> None:
        with wave.open(str(path), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(self.sample_rate)
            w.writeframes(self.pcm16())

    def add(self, event: Event) -> None:
        if isinstance(event, Started):
            self.started = event
        elif isinstance(event, AudioPacket):
            self.audio += event.data
            self.packets.append(AudioPacket(event.seq, b"", event.start_s, event.duration_s))
        elif isinstance(event, WordTiming):
            self.words.append(event)
        elif isinstance(event, Summary):
            self.summary = event


# ------------------------------------------------------------------ async client


class SynthesisStream:
    """One Synthesize call: an async iterator of events, plus `cancel()` (barge-in:
    the server answers with a cancelled summary) and `abort()` (hang up)."""

    def __init__(
        self, stub: Stub, config: "pb.SynthesizeConfig", text: TextSource, timeout: Optional[float], metadata: tuple = ()
    ) -> None:
        self._call = stub.Synthesize(timeout=timeout, metadata=metadata or None)
        self._config = config
        self._text = text
        self._pump: Optional[asyncio.Task] = None
        self._lock = asyncio.Lock()
        self._closed_writing = False
        self.first_text_sent_t: Optional[float] = None
        self.first_audio_t: Optional[float] = None

    @property
    def client_ttfa_s(self) -> Optional[float]:
        if self.first_text_sent_t is None or self.first_audio_t is None:
            return None
        return self.first_audio_t - self.first_text_sent_t

    async def _send(self, msg: "pb.SynthesizeRequest", last: bool = False) -> None:
        async with self._lock:
            await self._send_locked(msg, last)

    async def _send_locked(self, msg: "pb.SynthesizeRequest", last: bool) -> None:
        if self._closed_writing or self._call.done():
            return  # nothing more to say: the call ended (its status is what matters)
        await self._call.write(msg)
        if last:
            self._closed_writing = True
            await self._call.done_writing()

    async def _pump_text(self) -> None:
        try:
            await self._send(pb.SynthesizeRequest(config=self._config))
            async for piece in _aiter_text(self._text):
                if self._closed_writing:
                    return
                req = _text_request(piece)
                if self.first_text_sent_t is None and req.text.text.strip():
                    self.first_text_sent_t = time.monotonic()
                await self._send(req)
            await self._send(pb.SynthesizeRequest(end_of_input=pb.EndOfInput()), last=True)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            pass  # the call ended; the reader reports its status

    def __aiter__(self) -> "SynthesisStream":
        return self

    async def __anext__(self) -> Event:
        if self._pump is None:
            self._pump = asyncio.create_task(self._pump_text())
        try:
            msg = await self._call.read()
        except BaseException:
            self._pump.cancel()
            raise
        if msg is grpc.aio.EOF:
            self._pump.cancel()
            raise StopAsyncIteration
        kind = msg.WhichOneof("response")
        if kind == "audio":
            a = msg.audio
            if self.first_audio_t is None:
                self.first_audio_t = time.monotonic()
            return AudioPacket(a.seq, a.data, a.start_s, a.duration_s)
        if kind == "word":
            return WordTiming(msg.word.word, msg.word.start_s, msg.word.end_s)
        if kind == "started":
            cfg, _ = config_from_proto(msg.started.config)
            return Started(msg.started.session_id, cfg)
        if kind == "summary":
            s = msg.summary

            def opt(name: str) -> Any:
                return getattr(s, name) if s.HasField(name) else None

            return Summary(
                s.frames, s.audio_s, opt("ttfa_s"), opt("lookahead_wait_s"), opt("compute_fpl_s"), s.cancelled,
                s.spoken_text, opt("all_words_spoken"), tuple(s.unspoken_words),
            )
        return await self.__anext__()  # a newer server's message kind: skip

    async def cancel(self) -> None:
        """Barge-in: stop sending text; the server ends with a cancelled summary."""
        # the pump is stopped between writes: grpc cancels the whole call when a task is
        # cancelled inside `write`
        async with self._lock:
            if self._pump is not None:
                self._pump.cancel()
            try:
                await self._send_locked(pb.SynthesizeRequest(cancel=pb.Cancel()), last=True)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                pass

    def abort(self) -> None:
        """Hang up (the server frees the session at once)."""
        if self._pump is not None:
            self._pump.cancel()
        self._call.cancel()

    async def collect(self) -> SynthesisResult:
        result = SynthesisResult()
        async for event in self:
            result.add(event)
        result.client_ttfa_s = self.client_ttfa_s
        return result


class AsyncLiveSpeechClient:
    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        channel: Optional[grpc.aio.Channel] = None,
        timeout: Optional[float] = None,
        options: Optional[list] = None,
        tls_ca: Optional[Pem] = None,
        tls_cert: Optional[Pem] = None,
        tls_key: Optional[Pem] = None,
        token: Optional[str] = None,
        security: Optional[ClientSecurity] = None,
    ) -> None:
        """`security`, or its fields as keywords (`tls_ca`, `tls_cert`, `tls_key`, `token`)."""
        if security is None:
            security = ClientSecurity(tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, token=token)
        self.security = security
        self._own_channel = channel is None
        self.channel = channel or security.channel(
            target, options or [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        )
        self.stub = Stub(self.channel)
        self.timeout = timeout
        self._metadata = security.metadata

    async def __aenter__(self) -> "AsyncLiveSpeechClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_channel:
            await self.channel.close()

    def synthesize(
        self,
        text: TextSource,
        config: Optional[SessionConfig] = None,
        *,
        enrollment: Optional[tuple[bytes, int]] = None,
        **overrides: Any,
    ) -> SynthesisStream:
        """Start a Synthesize call; iterate the result for events. Keyword overrides are
        `SessionConfig` fields (voice_id, sample_rate, encoding, packet_ms, ...)."""
        return SynthesisStream(
            self.stub, build_config(config, enrollment=enrollment, **overrides), text, self.timeout, self._metadata
        )

    async def synthesize_to_result(self, text: TextSource, config: Optional[SessionConfig] = None, **kw: Any) -> SynthesisResult:
        return await self.synthesize(text, config, **kw).collect()

    async def register_voice(
        self,
        voice_id: str,
        *,
        wav: Optional[bytes] = None,
        path: Optional[Union[str, Path]] = None,
        pcm16: Optional[bytes] = None,
        sample_rate: int = 0,
        overwrite: bool = False,
    ) -> VoiceInfo:
        """Register reference speech: a WAV (bytes or path) or PCM16 LE bytes + rate."""
        req = pb.RegisterVoiceRequest(voice_id=voice_id, overwrite=overwrite)
        if path is not None:
            wav = Path(path).read_bytes()
        if wav is not None:
            req.wav = wav
        elif pcm16 is not None:
            req.pcm.pcm16_le = pcm16
            req.pcm.sample_rate = sample_rate
        info = await self.stub.RegisterVoice(req, timeout=self.timeout, metadata=self._metadata or None)
        return _voice_info(info)

    async def list_voices(self) -> list[VoiceInfo]:
        resp = await self.stub.ListVoices(pb.ListVoicesRequest(), timeout=self.timeout, metadata=self._metadata or None)
        return [_voice_info(v) for v in resp.voices]

    async def delete_voice(self, voice_id: str) -> None:
        await self.stub.DeleteVoice(
            pb.DeleteVoiceRequest(voice_id=voice_id), timeout=self.timeout, metadata=self._metadata or None
        )


def _voice_info(v: "pb.VoiceInfo") -> VoiceInfo:
    return VoiceInfo(v.voice_id, v.builtin, v.reference_s, v.created_unix_ms)


# ------------------------------------------------------------------ sync client


class LiveSpeechClient:
    """Blocking wrapper: runs an `AsyncLiveSpeechClient` on a private loop thread."""

    def __init__(self, target: str = DEFAULT_TARGET, **kw: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="livespeech-client", daemon=True)
        self._thread.start()

        async def make() -> AsyncLiveSpeechClient:
            return AsyncLiveSpeechClient(target, **kw)

        self._client = self._run(make())

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> "LiveSpeechClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()

    def synthesize(self, text: TextSource, config: Optional[SessionConfig] = None, **kw: Any) -> Iterator[Event]:
        """Yield events as they arrive. A sync iterator of text is read on a worker
        thread, so it may block (e.g. an LLM client)."""

        async def start() -> SynthesisStream:
            return self._client.synthesize(text, config, **kw)

        stream = self._run(start())
        try:
            while True:
                try:
                    yield self._run(stream.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._loop.call_soon_threadsafe(stream.abort)

    def synthesize_to_result(self, text: TextSource, config: Optional[SessionConfig] = None, **kw: Any) -> SynthesisResult:
        async def go() -> SynthesisResult:
            return await self._client.synthesize(text, config, **kw).collect()

        return self._run(go())

    def register_voice(self, voice_id: str, **kw: Any) -> VoiceInfo:
        return self._run(self._client.register_voice(voice_id, **kw))

    def list_voices(self) -> list[VoiceInfo]:
        return self._run(self._client.list_voices())

    def delete_voice(self, voice_id: str) -> None:
        self._run(self._client.delete_voice(voice_id))
