"""The WebSocket and OpenAI-compatible HTTP endpoints (aiohttp), beside gRPC in one process.

Both are transports over the session API that gRPC's `Synthesize` uses
(`service.SessionStream`, `LiveSpeechService.open_session`): the same admission (drain,
`synthesize_stream_limit`, tenant quota, engine capacity), limits, voices, timeouts and
slow-reader rules, and the same bearer tokens (`AuthInterceptor.tokens`, reloaded on
SIGHUP). Statuses keep gRPC's meaning (the proto's list); the HTTP status is
`HTTP_STATUS[code]` and the WebSocket close code 4000 + that status.

`GET /v1/synthesize` (WebSocket). Client messages are JSON text:
    {"type": "config", "config": {...}}       first; `SynthesizeConfig` in protobuf's JSON
                                              mapping (e.g. {"voice_id": "default",
                                              "sample_rate": 16000}), unset = defaults
    {"type": "text", "text": "Hel", "flush": false, "timestamp_s": 0.2}   (flush, timestamp optional)
    {"type": "flush"}  {"type": "end"}  {"type": "cancel"}
The server answers {"type": "started", "session_id", "config"}, then binary messages
(one audio packet each, in the session's encoding and rate) and {"type": "word", "word",
"start_s", "end_s"} as they are made, then {"type": "summary", ...} and close 1000. An
error is {"type": "error", "code", "message"[, "retry_after_ms"]} then the close code
(the close reason: the code name and the message, cut to the 123 bytes a close frame
holds); an error that ends a started session (its text limit, a client error, the idle
timeout, the wall-clock cap) comes after the summary (what was spoken, `unspoken_words`). A client that closes
without "end" has hung up: its session is freed.

`POST /v1/audio/speech` (OpenAI's request): {"model", "input", "voice", "response_format":
"wav" (default) | "pcm", "speed": 1.0 (only)}. The audio of the whole input (24 kHz
16-bit mono; a WAV header with unknown sizes first for "wav") streams as it is made.
Errors before the audio are OpenAI's error JSON with the HTTP status (the input over
the session's text limit: 429, nothing spoken); one after it started, a timeout
included, cuts the response off (no terminating chunk), so it never reads as complete
(a response has no place for a summary after its audio: the unspoken words are logged).

`GET /v1/voices`: the caller's voices, as gRPC's ListVoices answers them, in protobuf's
JSON mapping: {"voices": [{"voice_id", "builtin", "reference_s", "created_unix_ms"}]}.

`GET /` (and `/demo`): the demo page (server/static/demo.html, one self-contained file:
it uses the routes above from the browser, so it needs nothing but this server).

Tokens: `Authorization: Bearer <token>`; a browser, which cannot set headers on a
WebSocket, offers the subprotocols "bearer" and the token (tokens of HTTP token
characters only: no "/" or "=").
"""
from __future__ import annotations

import asyncio
import json
import logging
import ssl
import struct
import time
from pathlib import Path
from typing import Any, Optional

import grpc
from aiohttp import WSMsgType, web
from google.protobuf import json_format

from livespeech.api.protocol import Enrollment, config_from_proto, config_to_proto, pb, voice_info_to_proto
from livespeech.api.session import AudioPacket, ConfigError, Failed, Finished, SessionConfig, Summary, WordTiming

from .auth import AuthInterceptor, bearer_token, current_tenant, set_tenant
from .config import ServerConfig
from .service import LiveSpeechService, RpcError, SessionStream, failed_error, handle_errors
from .voices import VoiceStoreError

log = logging.getLogger(__name__)
Code = grpc.StatusCode

# gRPC status -> HTTP status (google.rpc's mapping; FAILED_PRECONDITION as 409 to tell it apart)
HTTP_STATUS = {
    Code.INVALID_ARGUMENT: 400,
    Code.UNAUTHENTICATED: 401,
    Code.PERMISSION_DENIED: 403,
    Code.NOT_FOUND: 404,
    Code.FAILED_PRECONDITION: 409,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.CANCELLED: 499,
    Code.INTERNAL: 500,
    Code.UNAVAILABLE: 503,
    Code.DEADLINE_EXCEEDED: 504,
}
WS_NORMAL_CLOSE = 1000
WS_CLOSE_BASE = 4000  # + the HTTP status
MAX_CLOSE_REASON_BYTES = 123
OPENAI_SAMPLE_RATE = 24000  # OpenAI's pcm: 24 kHz, 16-bit signed little-endian, mono
RESPONSE_FORMATS = {"wav": "audio/wav", "pcm": "audio/pcm"}
WS_MESSAGE_TYPES = ("config", "text", "flush", "end", "cancel")
DEMO_PAGE = Path(__file__).resolve().parent / "static" / "demo.html"


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)


def ws_close_code(code: grpc.StatusCode) -> int:
    return WS_CLOSE_BASE + http_status(code)


def close_reason(e: RpcError) -> str:
    reason = f"{e.code.name}: {e.message}".encode()[:MAX_CLOSE_REASON_BYTES]
    return reason.decode(errors="ignore")


def error_fields(e: RpcError) -> dict[str, Any]:
    out: dict[str, Any] = {"code": e.code.name, "message": e.message}
    retry = dict(e.metadata).get("retry-after-ms")
    if retry is not None:
        out["retry_after_ms"] = int(retry)
    return out


def summary_json(s: Summary) -> dict[str, Any]:
    return {"type": "summary", "frames": s.frames, "audio_s": s.audio_s, "ttfa_s": s.ttfa_s,
            "lookahead_wait_s": s.lookahead_wait_s, "compute_fpl_s": s.compute_fpl_s, "cancelled": s.cancelled,
            "spoken_text": s.spoken_text, "all_words_spoken": s.all_words_spoken,
            "unspoken_words": list(s.unspoken_words)}


def wav_header(sample_rate: int) -> bytes:
    """A PCM16 mono WAV header for a stream of unknown length (RIFF and data sizes at
    their maximum, as streamed WAV is written)."""
    unknown = 0xFFFFFFFF
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", unknown) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt \
        + b"data" + struct.pack("<I", unknown)


def ws_config(msg: Any) -> tuple[SessionConfig, Optional[Enrollment]]:
    """A WebSocket config message's `config` as a validated `SessionConfig` (through the
    proto, the one mapping of a wire config; enrollment audio is base64, as protobuf's
    JSON writes bytes)."""
    body = msg.get("config", {})
    if not isinstance(body, dict):
        raise RpcError(Code.INVALID_ARGUMENT, "config: expected a JSON object")
    try:
        wire = json_format.ParseDict(body, pb.SynthesizeConfig())
        cfg, enrollment = config_from_proto(wire)
    except json_format.ParseError as e:
        raise RpcError(Code.INVALID_ARGUMENT, f"config: {e}") from None
    except ConfigError as e:
        raise RpcError(Code.INVALID_ARGUMENT, str(e)) from None
    return cfg, enrollment


class WebSessionStream(SessionStream):
    """One WebSocket or HTTP synthesis stream."""

    def __init__(self, service: LiveSpeechService) -> None:
        super().__init__(service)
        self.hung_up = False  # the client went away: its outcome future is cancelled

    def hang_up(self) -> None:
        self.hung_up = True
        self.outcome.cancel()

    async def serve(self, writer: Any) -> None:
        """Run the writer coroutine until the stream's outcome; raise it if an error (a
        hung-up client ends quietly)."""
        task = asyncio.create_task(writer)
        task.add_done_callback(self._task_done)
        try:
            outcome = await self.outcome
        except asyncio.CancelledError:
            if not self.hung_up:
                raise
            return
        finally:
            task.cancel()
        if outcome is not None:
            raise outcome

    def _task_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or self.outcome.done():
            return
        exc = task.exception()
        if isinstance(exc, RpcError):
            self.finish(exc)
        elif isinstance(exc, (ConnectionResetError, ConnectionError)):
            self.hang_up()
        elif exc is not None:
            log.error("web session task failed", exc_info=exc)
            self.finish(RpcError(Code.INTERNAL, "internal error"))


class WebEndpoints:
    """The aiohttp application and its site (`start`, `stop`)."""

    def __init__(self, config: ServerConfig, service: LiveSpeechService, auth: Optional[AuthInterceptor]) -> None:
        self.config = config
        self.service = service
        self.auth = auth
        self.max_json_bytes = config.max_message_bytes * 4 // 3  # base64 audio
        self.app = web.Application(client_max_size=self.max_json_bytes)
        self.app.router.add_get("/v1/synthesize", self.websocket)
        self.app.router.add_post("/v1/audio/speech", self.speech)
        self.app.router.add_get("/v1/voices", self.list_voices)
        self.app.router.add_get("/", self.demo_page)
        self.app.router.add_get("/demo", self.demo_page)
        self.runner: Optional[web.AppRunner] = None
        self.port: Optional[int] = None

    async def start(self, ssl_context: Optional[ssl.SSLContext]) -> int:
        self.runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                                    shutdown_timeout=1.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.config.host, max(self.config.http_port, 0), ssl_context=ssl_context)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # ------------------------------------------------------------ auth

    def _authenticate(self, request: web.Request, offered_protocols: tuple[str, ...] = ()) -> None:
        """Set the caller's tenant, or RpcError UNAUTHENTICATED (tokens configured)."""
        if self.auth is None:
            return
        header = request.headers.get("Authorization")
        token = bearer_token([("authorization", header)]) if header is not None else None
        if token is None and len(offered_protocols) == 2 and offered_protocols[0] == "bearer":
            token = bearer_token([("authorization", "Bearer " + offered_protocols[1])])
        tenant = self.auth.tokens.tenant_for(token) if token is not None else None
        if tenant is None:
            reason = "missing bearer token" if token is None else "invalid token"
            self.auth.refusals.refused("UNAUTHENTICATED", request.path, reason, request.remote or "?")
            raise RpcError(Code.UNAUTHENTICATED, reason)
        set_tenant(tenant)

    def _count_error(self, e: RpcError) -> None:
        if not e.from_engine:
            self.service.metrics.errors_total.labels(code=e.code.name).inc()

    def _end_stream(self, stream: SessionStream, admitted: bool, outcome: str) -> None:
        # the engine counts the sessions it admitted or refused for capacity; the streams
        # that never got that far are counted here (as gRPC's are)
        if stream.handle is None and not stream.capacity_rejected:
            self.service.metrics.sessions_total.labels(outcome=outcome).inc()
        self.service.discharge(stream, admitted)

    # ------------------------------------------------------------ WebSocket

    async def websocket(self, request: web.Request) -> web.WebSocketResponse:
        offered = tuple(p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip())
        ws = web.WebSocketResponse(protocols=("bearer",), max_msg_size=self.max_json_bytes,
                                   heartbeat=30.0)
        await ws.prepare(request)
        stream: Optional[WebSessionStream] = None
        admitted = False
        outcome = "rejected"
        try:
            self._authenticate(request, offered)
            stream = WebSessionStream(self.service)
            self.service.admit(stream)
            admitted = True
            await self._run_websocket(ws, stream)
            if stream.hung_up:
                outcome = "disconnected"
            else:
                await ws.close(code=WS_NORMAL_CLOSE)
        except RpcError as e:
            self._count_error(e)
            await self._ws_error(ws, e)
        except ConnectionResetError:
            outcome = "disconnected"
        except asyncio.CancelledError:
            outcome = "disconnected"
            raise
        except Exception:
            log.exception("WebSocket session failed")
            await self._ws_error(ws, RpcError(Code.INTERNAL, "internal error"))
        finally:
            if stream is not None:
                self._end_stream(stream, admitted, outcome)
        return ws

    async def _ws_error(self, ws: web.WebSocketResponse, e: RpcError) -> None:
        if ws.closed:
            return
        try:
            await ws.send_json({"type": "error", **error_fields(e)})
            await ws.close(code=ws_close_code(e.code), message=close_reason(e).encode())
        except (ConnectionResetError, RuntimeError):  # the client is gone
            pass

    async def _ws_message(self, ws: web.WebSocketResponse, timeout: Optional[float] = None) -> Optional[dict]:
        """The next client message as a JSON object; None when the client closed."""
        try:
            async with asyncio.timeout(timeout):
                msg = await ws.receive()
        except TimeoutError:
            raise RpcError(Code.DEADLINE_EXCEEDED, f"no config received within {timeout:g} s") from None
        if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
            return None
        if msg.type is not WSMsgType.TEXT:
            raise RpcError(Code.INVALID_ARGUMENT, "messages must be JSON text (audio is only sent by the server)")
        try:
            body = json.loads(msg.data)
        except ValueError as e:
            raise RpcError(Code.INVALID_ARGUMENT, f"malformed JSON: {e}") from None
        if not isinstance(body, dict) or body.get("type") not in WS_MESSAGE_TYPES:
            raise RpcError(Code.INVALID_ARGUMENT, f"a message is a JSON object whose type is one of {', '.join(WS_MESSAGE_TYPES)}")
        return body

    async def _run_websocket(self, ws: web.WebSocketResponse, stream: WebSessionStream) -> None:
        first = await self._ws_message(ws, self.config.config_timeout_s)
        if first is None:  # hung up before its config
            stream.hang_up()
            return
        if first["type"] != "config":
            raise RpcError(Code.INVALID_ARGUMENT, "first message must be config")
        effective = await self.service.open_session(stream, *ws_config(first))
        assert stream.handle is not None
        config = json_format.MessageToDict(config_to_proto(effective), preserving_proto_field_name=True)
        await ws.send_json({"type": "started", "session_id": stream.handle.session_id, "config": config})
        reader = asyncio.create_task(self._ws_read(ws, stream))
        reader.add_done_callback(stream._task_done)
        try:
            await stream.serve(self._ws_write(ws, stream))
        finally:
            reader.cancel()

    async def _ws_read(self, ws: web.WebSocketResponse, stream: WebSessionStream) -> None:
        handle = stream.handle
        assert handle is not None
        cancelled = False
        while True:
            msg = await self._ws_message(ws)
            if msg is None:  # the client closed: nobody to speak to
                stream.hang_up()
                return
            stream.last_activity = time.monotonic()
            kind = msg["type"]
            if cancelled or stream.stopping is not None:
                continue  # a text pump may race the cancel, or the session's early end
            try:
                cancelled = self._ws_forward(handle, kind, msg)
            except RpcError as e:  # the client's fault: the summary of what was spoken, then the status
                stream.end_early(e)

    @staticmethod
    def _ws_forward(handle: Any, kind: str, msg: dict) -> bool:
        """One client message to the session handle; True for a cancel."""
        if kind == "text":
            text, flush, ts = msg.get("text", ""), msg.get("flush", False), msg.get("timestamp_s")
            if not isinstance(text, str) or not isinstance(flush, bool) or \
                    (ts is not None and not isinstance(ts, (int, float))) or isinstance(ts, bool):
                raise RpcError(Code.INVALID_ARGUMENT, "text: expected text (string), flush (bool), timestamp_s (number)")
            with handle_errors():
                handle.push_text(text, None if ts is None else float(ts), flush)
        elif kind == "flush":
            with handle_errors():
                handle.push_text("", None, True)
        elif kind == "end":
            with handle_errors():
                handle.end_input()
        elif kind == "cancel":
            handle.cancel()
            return True
        else:
            raise RpcError(Code.FAILED_PRECONDITION, "config already received")
        return False

    async def _ws_write(self, ws: web.WebSocketResponse, stream: WebSessionStream) -> None:
        while True:
            ev = await stream.next_event()
            if isinstance(ev, AudioPacket):
                await stream.timed_write(ws.send_bytes(ev.data), ev.duration_s)
            elif isinstance(ev, WordTiming):
                await stream.timed_write(ws.send_json({"type": "word", "word": ev.word, "start_s": ev.start_s,
                                                       "end_s": ev.end_s}))
            elif isinstance(ev, Finished):
                await stream.timed_write(ws.send_json(summary_json(ev.summary)), last=True)
                stream.finish(stream.ended(ev))
                return
            elif isinstance(ev, Failed):
                raise failed_error(ev)

    # ------------------------------------------------------------ voices and the demo page

    async def list_voices(self, request: web.Request) -> web.Response:
        try:
            self._authenticate(request)
            try:
                infos = await self.service.voices.list(current_tenant())
            except VoiceStoreError as e:
                raise RpcError(Code[e.code], str(e)) from None
        except RpcError as e:
            self._count_error(e)
            return openai_error(e)
        except Exception:
            log.exception("listing voices failed")
            return openai_error(RpcError(Code.INTERNAL, "internal error"))
        listed = pb.ListVoicesResponse(voices=[voice_info_to_proto(v) for v in infos])
        return web.json_response(json_format.MessageToDict(listed, preserving_proto_field_name=True,
                                                           always_print_fields_with_no_presence=True))

    async def demo_page(self, request: web.Request) -> web.FileResponse:
        # public like any static file: the page holds no data, and every call it makes
        # carries the token typed into it
        return web.FileResponse(DEMO_PAGE, headers={"Content-Type": "text/html; charset=utf-8",
                                                     "Cache-Control": "no-cache"})

    # ------------------------------------------------------------ OpenAI's /v1/audio/speech

    async def speech(self, request: web.Request) -> web.StreamResponse:
        stream: Optional[WebSessionStream] = None
        admitted = False
        response: Optional[web.StreamResponse] = None
        outcome = "rejected"
        try:
            self._authenticate(request)
            body = await self._speech_request(request)
            stream = WebSessionStream(self.service)
            self.service.admit(stream)
            admitted = True
            cfg = SessionConfig(voice_id=body["voice"], sample_rate=OPENAI_SAMPLE_RATE)
            await self.service.open_session(stream, cfg, None)
            handle = stream.handle
            assert handle is not None
            text, limit = body["input"], self.config.max_text_piece_chars
            with handle_errors():
                for i in range(0, len(text), limit):
                    handle.push_text(text[i:i + limit])
                handle.end_input()
            response = web.StreamResponse(headers={"Content-Type": RESPONSE_FORMATS[body["response_format"]]})
            await response.prepare(request)
            if body["response_format"] == "wav":
                await response.write(wav_header(OPENAI_SAMPLE_RATE))
            await stream.serve(self._speech_write(response, stream))
            if stream.hung_up:
                outcome = "disconnected"
                return response
            await response.write_eof()
            return response
        except RpcError as e:
            self._count_error(e)
            if response is None:
                return openai_error(e)
            log.info("speech ended after its audio began: %s", e)
            _cut_off(request)
            return response
        except (ConnectionResetError, asyncio.CancelledError):
            outcome = "disconnected"
            raise
        except Exception:
            log.exception("speech failed")
            if response is None:
                return openai_error(RpcError(Code.INTERNAL, "internal error"))
            _cut_off(request)
            return response
        finally:
            if stream is not None:
                self._end_stream(stream, admitted, outcome)

    async def _speech_request(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as e:
            raise RpcError(Code.INVALID_ARGUMENT, f"malformed JSON: {e}") from None
        if not isinstance(body, dict):
            raise RpcError(Code.INVALID_ARGUMENT, "the request body must be a JSON object")
        text, voice = body.get("input"), body.get("voice")
        if not isinstance(text, str) or not text.strip():
            raise RpcError(Code.INVALID_ARGUMENT, "input: a non-empty string is required")
        if not isinstance(voice, str) or not voice:
            raise RpcError(Code.INVALID_ARGUMENT, "voice: a voice id (string) is required")
        if not isinstance(body.get("model", ""), str):
            raise RpcError(Code.INVALID_ARGUMENT, "model: expected a string")
        fmt = body.get("response_format", "wav")
        if fmt not in RESPONSE_FORMATS:
            raise RpcError(Code.INVALID_ARGUMENT, f"response_format: {fmt!r} is not supported (wav or pcm)")
        speed = body.get("speed", 1.0)
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or speed != 1.0:
            raise RpcError(Code.INVALID_ARGUMENT, "speed: only 1.0 is supported")
        if body.get("stream_format", "audio") != "audio":
            raise RpcError(Code.INVALID_ARGUMENT, "stream_format: only audio is supported")
        return {"input": text, "voice": voice, "response_format": fmt}

    async def _speech_write(self, response: web.StreamResponse, stream: WebSessionStream) -> None:
        while True:
            ev = await stream.next_event()
            if isinstance(ev, AudioPacket):
                await stream.timed_write(response.write(ev.data), ev.duration_s)
            elif isinstance(ev, Finished):
                # a response cannot carry the summary after its audio: an early ending
                # (a timeout) is cut off like any error, its unspoken words logged
                if ev.summary.unspoken_words:
                    log.info("speech ended with %d words unspoken: %s", len(ev.summary.unspoken_words),
                             " ".join(ev.summary.unspoken_words)[:200])
                stream.finish(stream.ended(ev))
                return
            elif isinstance(ev, Failed):
                raise failed_error(ev)


def _cut_off(request: web.Request) -> None:
    """End a streamed response without its terminating chunk: the client sees it cut."""
    if request.transport is not None:
        request.transport.close()


def openai_error(e: RpcError) -> web.Response:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    status = http_status(e.code)
    kind = ("authentication_error" if status == 401 else "rate_limit_error" if status == 429
            else "invalid_request_error" if status < 500 else "server_error")
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    retry = dict(e.metadata).get("retry-after-ms")
    if retry is not None:
        headers["Retry-After"] = str(max(1, -(-int(retry) // 1000)))
    body = {"error": {"message": e.message, "type": kind, "param": None, "code": e.code.name.lower()}}
    return web.json_response(body, status=status, headers=headers)


def ssl_context(config: ServerConfig) -> Optional[ssl.SSLContext]:
    """TLS for the HTTP port from gRPC's settings (mutual TLS with `tls_client_ca`)."""
    if config.tls_cert is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(config.tls_cert), str(config.tls_key))
    if config.tls_client_ca is not None:
        ctx.load_verify_locations(str(config.tls_client_ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
