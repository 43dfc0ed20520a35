"""Client library for the LiveSpeech gRPC service.

Push text as it comes (async; `LiveSpeechClient.session()` is the blocking twin):

    async with AsyncLiveSpeechClient("127.0.0.1:50051") as client:
        async with client.session(voice_id="default", sample_rate=16000) as session:
            await session.send("Hello the")     # sub-word pieces are fine
            await session.send("re, how are you?")
            await session.flush()               # speak what was sent, without more lookahead
            await session.end()                 # or: await session.cancel() (barge-in)
            async for event in session:         # Started, AudioPacket, WordTiming, Summary
                ...

A text source instead (a str, or a sync or async iterable of str / `TextPiece`, sent as
it comes; a blocking sync iterator, e.g. stdin, is read on a worker thread):

    stream = client.synthesize(llm_stream("Hello there, how are you?", rate=40), voice_id="default")
    async for event in stream:
        ...
    # barge-in: await stream.cancel()   -> a Summary with cancelled=True, spoken_text

Sync (a private event loop on a background thread):

    with LiveSpeechClient("127.0.0.1:50051") as client:
        result = client.synthesize_to_result("Hello there.", sample_rate=16000)
        result.write_wav("out.wav")

A call the server refuses before `Started` (UNAVAILABLE, RESOURCE_EXHAUSTED) is made again
under the client's `RetryPolicy`, waiting at least the server's `retry-after-ms`; once the
session started nothing is retried. Errors are `grpc.aio.AioRpcError` with the server's
status code and message. The server ends a started session over its text limit, idle or
open too long with a `Summary` and then the error: the iteration yields the Summary, and
the error raised after it carries it as `error.summary` (None when no summary came);
`collect()` / `synthesize_to_result()` also attach what was received as `error.result`.

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
from typing import Any, AsyncIterable, AsyncIterator, BinaryIO, Callable, Iterable, Iterator, Optional, Union

import grpc

from livespeech.api.protocol import (BEARER_TOKEN_RE, Enrollment, Stub, config_to_proto, event_from_proto, pb,
                                     voice_info_from_proto)
from livespeech.api.session import AudioPacket, Encoding, SessionConfig, Started, Summary, VoiceInfo, WordTiming

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
            from livespeech.api.audio import mulaw_to_pcm16

            return mulaw_to_pcm16(bytes(self.audio)).astype("<i2").tobytes()
        return bytes(self.audio)

    def write_wav(self, path: Union[str, Path, BinaryIO]) -> None:
        """To a file name or a binary file object (e.g. standard output's buffer)."""
        with wave.open(path if hasattr(path, "write") else str(path), "wb") as w:
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


# ------------------------------------------------------------------ retries


RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass(frozen=True)
class RetryPolicy:
    """When a Synthesize call is made again: only when the server answered UNAVAILABLE or
    RESOURCE_EXHAUSTED before `Started` (nothing was spoken, so the new call replays the
    config and the text sent so far), never once the session started. `attempts` counts
    the calls, the first one included. The wait before retry n (from 0) is
    `backoff_s * multiplier**n`, at most `max_backoff_s`, never shorter than the
    server's `retry-after-ms`, and stretched by up to `jitter` (refused clients should
    not come back all at once)."""

    attempts: int = 4
    backoff_s: float = 0.25
    multiplier: float = 2.0
    max_backoff_s: float = 5.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be >= 1")
        if self.backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1 or self.jitter < 0:
            raise ValueError("backoff_s, max_backoff_s, jitter must be >= 0 and multiplier >= 1")

    def delay_s(self, retry: int, retry_after_s: Optional[float], rng: random.Random) -> float:
        wait = min(self.backoff_s * self.multiplier**retry, self.max_backoff_s)
        if retry_after_s is not None:
            wait = max(wait, retry_after_s)
        return wait * (1.0 + rng.uniform(0.0, self.jitter))


NO_RETRY = RetryPolicy(attempts=1)


@dataclass(frozen=True)
class Refusal:
    """A call refused before `Started`, made again after `delay_s`."""

    code: grpc.StatusCode
    details: str
    retry_after_s: Optional[float]  # the server's `retry-after-ms`, when it sent one
    delay_s: float


def retry_after_s(error: grpc.aio.AioRpcError) -> Optional[float]:
    """The server's `retry-after-ms` trailing metadata (sent with capacity refusals)."""
    value = dict(error.trailing_metadata() or ()).get("retry-after-ms")
    try:
        return int(value) / 1000 if value is not None else None
    except ValueError:
        return None


# ------------------------------------------------------------------ async client


_END = pb.SynthesizeRequest(end_of_input=pb.EndOfInput())
_CANCEL = pb.SynthesizeRequest(cancel=pb.Cancel())
_HALF_CLOSE = object()  # an outbox item: close the write side
_WRITE_ENDED = (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError)


class SynthesisSession:
    """One Synthesize call that text is pushed into: `send()`, `flush()`, `end()`,
    `cancel()`; iterate it for events (`Started`, `AudioPacket`, `WordTiming`, then a
    `Summary`). The call is made on first use; a refusal before `Started` is retried
    under `retry` (the text sent so far is replayed; `refusals` lists them), an error
    after it is raised from the iteration.

    One writer task owns the call's write side, so a caller cancelled inside `send()`
    cannot cancel the call (grpc cancels a call whose task is cancelled inside `write`).
    `end()` does not half-close: `cancel()` still reaches the server while the tail of
    the audio streams; the write side closes after a cancel or once the summary arrived
    (so the server ends the call without waiting for more messages)."""

    def __init__(
        self,
        stub: Stub,
        config: "pb.SynthesizeConfig",
        *,
        timeout: Optional[float] = None,
        metadata: tuple = (),
        retry: RetryPolicy = NO_RETRY,
    ) -> None:
        self._stub = stub
        self._timeout = timeout
        self._metadata = metadata or None
        self._retry = retry
        self._rng = random.Random()
        self._sent: list = [pb.SynthesizeRequest(config=config)]  # replayed by a retry; dropped at Started
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._call: Any = None
        self._writer: Optional[asyncio.Task] = None
        self._attempts = 0
        self._ended = False  # end() was called
        self._cancelled = asyncio.Event()
        self._cancel_written = asyncio.Event()
        self._over = False  # the call's status was read, or it was hung up
        self.started: Optional[Started] = None
        self.refusals: list[Refusal] = []
        self.first_text_t: Optional[float] = None
        self.first_audio_t: Optional[float] = None
        self.summary: Optional[Summary] = None  # the server's, once received

    @property
    def client_ttfa_s(self) -> Optional[float]:
        """First text sent -> first audio received (client clock, retries included)."""
        if self.first_text_t is None or self.first_audio_t is None:
            return None
        return self.first_audio_t - self.first_text_t

    @property
    def accepting_text(self) -> bool:
        return not (self._ended or self._over or self._cancelled.is_set())

    # -------------------------------------------------------------- write side

    def _open(self) -> None:
        if self._call is None and not self._over:
            self._connect()

    def _connect(self) -> None:
        self._attempts += 1
        self._call = self._stub.Synthesize(timeout=self._timeout, metadata=self._metadata)
        self._writer = asyncio.create_task(self._write(self._call, list(self._sent)))

    async def _write(self, call: Any, replay: list) -> None:
        try:
            for item in replay:
                if await self._write_one(call, item):
                    return
            while True:
                item = await self._outbox.get()
                if self.started is None and item is not _HALF_CLOSE:
                    self._sent.append(item)
                if await self._write_one(call, item):
                    return
        except _WRITE_ENDED:
            pass  # the call ended: the iteration reads its status

    async def _write_one(self, call: Any, item: Any) -> bool:
        """Write one item; True once the write side is closed."""
        if call.done():
            return True
        if item is _HALF_CLOSE:
            await call.done_writing()
            return True
        await call.write(item)
        if item is _CANCEL:
            await call.done_writing()
            self._cancel_written.set()
            return True
        return False

    async def send(self, text: str, *, timestamp_s: Optional[float] = None, flush: bool = False) -> None:
        """Queue a text piece (sub-word pieces are fine). After `cancel()` or once the
        call is over it is dropped (a barge-in races the text; the iteration reports
        how the call ended); otherwise, after `end()` it is a mistake (ValueError)."""
        if self._over or self._cancelled.is_set():
            return
        if self._ended:
            raise ValueError("send() after end()")
        self._open()
        if self.first_text_t is None and text.strip():
            self.first_text_t = time.monotonic()
        self._outbox.put_nowait(_text_request(TextPiece(text, timestamp_s, flush)))

    async def flush(self) -> None:
        """Speak the text sent so far without waiting for more lookahead."""
        await self.send("", flush=True)

    async def end(self) -> None:
        """End of input: the speech ends with the last text, then the summary."""
        if not self.accepting_text:
            return
        self._ended = True
        self._open()
        self._outbox.put_nowait(_END)

    async def cancel(self) -> None:
        """Barge-in: text not yet written is dropped and the server stops, answering
        with a cancelled summary; returns once the cancel is written. Before `Started`
        nothing is retried any more (and a refused call then ends the events without a
        summary)."""
        if self._cancelled.is_set() or self._over:
            return
        self._cancelled.set()
        if self._call is None:  # nothing was sent: nothing to cancel
            self._over = True
            return
        while not self._outbox.empty():
            self._outbox.get_nowait()
        self._outbox.put_nowait(_CANCEL)
        writer = self._writer
        if writer is not None and not writer.done():  # none while a retry waits: no call to tell
            written = asyncio.ensure_future(self._cancel_written.wait())
            try:
                await asyncio.wait({written, writer}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                written.cancel()

    def abort(self) -> None:
        """Hang up (the server frees the session at once)."""
        self._over = True
        if self._writer is not None:
            self._writer.cancel()
        if self._call is not None:
            self._call.cancel()

    def _close(self) -> None:
        self._over = True
        if self._writer is not None and not self._writer.done():
            self._writer.cancel()

    # -------------------------------------------------------------- read side

    async def _retried(self, error: grpc.aio.AioRpcError) -> bool:
        """Whether `error` is retried: then after the wait a new call is under way."""
        if (
            self.started is not None
            or self._cancelled.is_set()
            or error.code() not in RETRYABLE_CODES
            or self._attempts >= self._retry.attempts
        ):
            return False
        hint = retry_after_s(error)
        delay = self._retry.delay_s(len(self.refusals), hint, self._rng)
        self.refusals.append(Refusal(error.code(), error.details() or "", hint, delay))
        log.info("Synthesize refused (%s: %s); retrying in %.2f s", error.code().name, error.details(), delay)
        if self._writer is not None:
            self._writer.cancel()
        try:
            async with asyncio.timeout(delay):
                await self._cancelled.wait()
            return False  # cancelled while waiting
        except TimeoutError:
            pass
        if self._over:  # hung up while waiting
            return False
        self._connect()
        return True

    def __aiter__(self) -> "SynthesisSession":
        return self

    async def __anext__(self) -> Event:
        self._open()
        while True:
            if self._over:
                raise StopAsyncIteration
            try:
                msg = await self._call.read()
            except grpc.aio.AioRpcError as e:
                if await self._retried(e):
                    continue
                self._close()
                if self.started is None and self._cancelled.is_set():
                    raise StopAsyncIteration from None  # cancelled before anything was spoken
                e.summary = self.summary  # an early ending's: which words were spoken
                raise
            if msg is grpc.aio.EOF:
                self._close()
                raise StopAsyncIteration
            event = event_from_proto(msg)
            if isinstance(event, Started):
                self.started = event
                self._sent.clear()
            elif isinstance(event, AudioPacket):
                if self.first_audio_t is None:
                    self.first_audio_t = time.monotonic()
            elif isinstance(event, Summary):
                self.summary = event
                self._outbox.put_nowait(_HALF_CLOSE)
            if event is not None:
                return event

    async def __aenter__(self) -> "SynthesisSession":
        self._open()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if not self._over:
            self.abort()

    async def collect(self) -> SynthesisResult:
        return await _collect(self)


async def _collect(events: "SynthesisSession | SynthesisStream") -> SynthesisResult:
    """Every event of a session or stream, gathered; its client-side TTFA."""
    result = SynthesisResult()
    try:
        async for event in events:
            result.add(event)
    except grpc.aio.AioRpcError as e:
        result.client_ttfa_s = events.client_ttfa_s
        e.result = result  # the audio and summary received before the error
        raise
    result.client_ttfa_s = events.client_ttfa_s
    return result


class SynthesisStream:
    """A `SynthesisSession` fed from a text source: a task sends its pieces, then end of
    input. Iterate for events; `cancel()` (barge-in: the server answers with a cancelled
    summary), `abort()` (hang up)."""

    def __init__(
        self,
        stub: Stub,
        config: "pb.SynthesizeConfig",
        text: TextSource,
        timeout: Optional[float],
        metadata: tuple = (),
        retry: RetryPolicy = NO_RETRY,
    ) -> None:
        self.session = SynthesisSession(stub, config, timeout=timeout, metadata=metadata, retry=retry)
        self._text = text
        self._pump: Optional[asyncio.Task] = None

    @property
    def client_ttfa_s(self) -> Optional[float]:
        return self.session.client_ttfa_s

    async def _pump_text(self) -> None:
        async for piece in _aiter_text(self._text):
            if not self.session.accepting_text:
                return
            if isinstance(piece, str):
                piece = TextPiece(piece)
            await self.session.send(piece.text, timestamp_s=piece.timestamp_s, flush=piece.flush)
        await self.session.end()

    def __aiter__(self) -> "SynthesisStream":
        return self

    async def __anext__(self) -> Event:
        if self._pump is None:
            self._pump = asyncio.create_task(self._pump_text())
        try:
            return await self.session.__anext__()
        except BaseException:
            self._pump.cancel()
            raise

    async def cancel(self) -> None:
        """Barge-in: stop sending text; the server ends with a cancelled summary."""
        if self._pump is not None:
            self._pump.cancel()
        await self.session.cancel()

    def abort(self) -> None:
        """Hang up (the server frees the session at once)."""
        if self._pump is not None:
            self._pump.cancel()
        self.session.abort()

    async def collect(self) -> SynthesisResult:
        return await _collect(self)


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
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        """`security`, or its fields as keywords (`tls_ca`, `tls_cert`, `tls_key`, `token`).
        `retry`: for every Synthesize call (`NO_RETRY` turns retries off)."""
        if security is None:
            security = ClientSecurity(tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, token=token)
        self.security = security
        self._own_channel = channel is None
        self.channel = channel or security.channel(
            target, options or [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        )
        self.stub = Stub(self.channel)
        self.timeout = timeout
        self.retry = retry
        self._metadata = security.metadata

    async def __aenter__(self) -> "AsyncLiveSpeechClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_channel:
            await self.channel.close()

    def session(
        self,
        config: Optional[SessionConfig] = None,
        *,
        enrollment: Optional[tuple[bytes, int]] = None,
        retry: Optional[RetryPolicy] = None,
        **overrides: Any,
    ) -> SynthesisSession:
        """A Synthesize call to push text into (the call is made on first use). Keyword
        overrides are `SessionConfig` fields (voice_id, sample_rate, encoding, packet_ms,
        ...); `retry` replaces the client's policy for this call."""
        return SynthesisSession(
            self.stub, build_config(config, enrollment=enrollment, **overrides), timeout=self.timeout,
            metadata=self._metadata, retry=retry or self.retry,
        )

    def synthesize(
        self,
        text: TextSource,
        config: Optional[SessionConfig] = None,
        *,
        enrollment: Optional[tuple[bytes, int]] = None,
        retry: Optional[RetryPolicy] = None,
        **overrides: Any,
    ) -> SynthesisStream:
        """A Synthesize call fed from `text`; iterate the result for events. Keywords as
        for `session()`."""
        return SynthesisStream(
            self.stub, build_config(config, enrollment=enrollment, **overrides), text, self.timeout, self._metadata,
            retry or self.retry,
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
        return voice_info_from_proto(info)

    async def list_voices(self) -> list[VoiceInfo]:
        resp = await self.stub.ListVoices(pb.ListVoicesRequest(), timeout=self.timeout, metadata=self._metadata or None)
        return [voice_info_from_proto(v) for v in resp.voices]

    async def delete_voice(self, voice_id: str) -> None:
        await self.stub.DeleteVoice(
            pb.DeleteVoiceRequest(voice_id=voice_id), timeout=self.timeout, metadata=self._metadata or None
        )


# ------------------------------------------------------------------ sync client


class SyncSynthesisSession:
    """Blocking twin of `SynthesisSession`, on a `LiveSpeechClient`'s loop thread. Each
    method waits for its async counterpart; iterate on one thread while another sends
    (or send everything, `end()`, then iterate)."""

    def __init__(self, run: Callable[[Any], Any], session: SynthesisSession) -> None:
        self._run = run
        self.session = session

    @property
    def started(self) -> Optional[Started]:
        return self.session.started

    @property
    def refusals(self) -> list[Refusal]:
        return self.session.refusals

    @property
    def client_ttfa_s(self) -> Optional[float]:
        return self.session.client_ttfa_s

    def send(self, text: str, *, timestamp_s: Optional[float] = None, flush: bool = False) -> None:
        self._run(self.session.send(text, timestamp_s=timestamp_s, flush=flush))

    def flush(self) -> None:
        self._run(self.session.flush())

    def end(self) -> None:
        self._run(self.session.end())

    def cancel(self) -> None:
        self._run(self.session.cancel())

    def abort(self) -> None:
        async def hang_up() -> None:
            self.session.abort()

        self._run(hang_up())

    def __iter__(self) -> "SyncSynthesisSession":
        return self

    def __next__(self) -> Event:
        try:
            return self._run(self.session.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def __enter__(self) -> "SyncSynthesisSession":
        self._run(self.session.__aenter__())
        return self

    def __exit__(self, *exc: Any) -> None:
        self._run(self.session.__aexit__(*exc))

    def collect(self) -> SynthesisResult:
        return self._run(self.session.collect())


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

    def session(self, config: Optional[SessionConfig] = None, **kw: Any) -> SyncSynthesisSession:
        """A Synthesize call to push text into; keywords as for `AsyncLiveSpeechClient.session`."""

        async def make() -> SynthesisSession:
            return self._client.session(config, **kw)

        return SyncSynthesisSession(self._run, self._run(make()))

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


class ServerConnection:
    """What a framework adapter (clients/pipecat_tts.py, clients/livekit_tts.py) holds of
    the server: the client it was given, or one it makes on first use and closes with
    itself; and the session config and options every stream it opens starts from."""

    def __init__(self, address: str, client: Optional[AsyncLiveSpeechClient], token: Optional[str],
                 tls_ca: Optional[Pem], session_config: Optional[SessionConfig],
                 session_options: Optional[dict[str, Any]]) -> None:
        self._address = address
        self._client = client
        self._own_client = client is None
        self._security = {"token": token, "tls_ca": tls_ca}
        self.session_config = session_config
        self.options = dict(session_options or {})

    def client(self) -> AsyncLiveSpeechClient:
        if self._client is None:
            self._client = AsyncLiveSpeechClient(self._address, **self._security)
        return self._client

    def session(self, sample_rate: int, **options: Any) -> SynthesisSession:
        """A push session; `options` over the adapter's own."""
        return self.client().session(self.session_config, sample_rate=sample_rate, **{**self.options, **options})

    async def close(self) -> None:
        """Close the client if this connection made it."""
        if self._own_client and self._client is not None:
            await self._client.close()
            self._client = None
