"""Transport security and caller identity: TLS credentials and bearer tokens.

TLS (`ServerConfig.tls_cert`/`tls_key`, optional `tls_client_ca` for mutual TLS) is
the server's credentials object. Tokens (`auth_tokens_file`, and/or `auth_tokens`, set
only from the env `LIVESPEECH_AUTH_TOKENS`) map a bearer token to a tenant, one `tenant:token` pair per
line (file) or separated by commas/whitespace (env); `#` starts a comment line. A
tenant may hold several tokens (rotation); a token belongs to one tenant.

With tokens configured, `AuthInterceptor` checks every call's `authorization: Bearer
<token>` metadata before any handler runs, so an unauthenticated call never reaches
the service or the engine:
- no or malformed `authorization` metadata: UNAUTHENTICATED "missing bearer token";
- a well-formed token that is not configured: UNAUTHENTICATED "invalid token" (gRPC's
  meaning: the credentials are not valid; PERMISSION_DENIED would say "we know who you
  are, and you may not do this", which no tenant is told: every tenant may call every
  method on its own voices);
- the health service (`grpc.health.v1.Health`) stays open, so load balancers and
  orchestrators can probe without a secret; it reveals only SERVING / NOT_SERVING.
Reflection and every LiveSpeech method need a token. The handler learns the caller's
tenant from `current_tenant()` (a context variable: grpc.aio runs the interceptors and
the handler in one `contextvars.Context`); without tokens every caller is tenant "".

Secrets never reach a log or an error message: tokens are kept only as SHA-256 digests,
refusals name the reason and the peer, and parse errors name the line, not its text.
Refusals are logged at most once per `REFUSAL_LOG_INTERVAL_S` per reason (`RefusalLog`);
the metric `livespeech_errors_total{code="UNAUTHENTICATED"}` counts every one.
"""
from __future__ import annotations

import contextvars
import hashlib
import logging
import re
import stat
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Optional

import grpc

from livespeech.api.protocol import BEARER_TOKEN_RE, rpc_method_handler
from livespeech.api.session import ConfigError

from .config import ServerConfig
from .grpc_drain import drain_requests
from .metrics import Metrics
from .voices import VOICE_ID_RE

log = logging.getLogger(__name__)

TOKEN_RE = BEARER_TOKEN_RE
MIN_TOKEN_CHARS = 16  # a guessable token is a configuration error, not a weak default
MAX_TOKEN_CHARS = 4096
# a tenant names a directory under voices_dir: the voice id alphabet
TENANT_RE = VOICE_ID_RE
# methods open without a token (probes); exact names, not prefixes
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
REFUSAL_LOG_INTERVAL_S = 10.0

_tenant: contextvars.ContextVar[str] = contextvars.ContextVar("livespeech_tenant", default="")


def current_tenant() -> str:
    """The authenticated caller's tenant ("" when authentication is off)."""
    return _tenant.get()


def set_tenant(tenant: str) -> None:
    """Name the authenticated caller of the current task (server/web.py's handlers)."""
    _tenant.set(tenant)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenTable:
    """token -> tenant, holding only digests (a heap dump or repr shows no token)."""

    def __init__(self, pairs: Iterable[tuple[str, str]]) -> None:
        self._by_digest: dict[bytes, str] = {}
        for tenant, token in pairs:
            d = _digest(token)
            if d in self._by_digest:
                raise ConfigError(f"auth tokens: a token is listed twice (tenants {self._by_digest[d]!r}, {tenant!r})")
            self._by_digest[d] = tenant

    def __len__(self) -> int:
        return len(self._by_digest)

    def __repr__(self) -> str:
        return f"TokenTable({len(self)} tokens, tenants={sorted(set(self._by_digest.values()))})"

    @property
    def tenants(self) -> set[str]:
        return set(self._by_digest.values())

    def tenant_for(self, token: str) -> Optional[str]:
        # a dict lookup by digest: timing depends on the digest, which tells an attacker
        # nothing about any configured token
        return self._by_digest.get(_digest(token))


def parse_tokens(text: str, source: str, *, lines: bool) -> list[tuple[str, str]]:
    """`tenant:token` pairs, one per line (`lines`) or separated by commas/whitespace.
    Errors name the source and entry number, never the entry (it holds a secret)."""
    entries = text.splitlines() if lines else re.split(r"[\s,]+", text)
    out = []
    for i, raw in enumerate(entries, 1):
        entry = raw.strip()
        if not entry or entry.startswith("#"):
            continue
        where = f"{source} {'line' if lines else 'entry'} {i}"
        tenant, sep, token = entry.partition(":")
        if not sep:
            raise ConfigError(f"{where}: expected tenant:token")
        tenant, token = tenant.strip(), token.strip()
        if not TENANT_RE.fullmatch(tenant):
            raise ConfigError(f"{where}: tenant must match {TENANT_RE.pattern}")
        if not TOKEN_RE.fullmatch(token):
            raise ConfigError(f"{where}: token must be an RFC 6750 b64token ([A-Za-z0-9-._~+/]+=*)")
        if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
            raise ConfigError(f"{where}: token must be {MIN_TOKEN_CHARS}..{MAX_TOKEN_CHARS} characters")
        out.append((tenant, token))
    return out


def load_tokens(config: ServerConfig) -> Optional[TokenTable]:
    """The configured tokens (file and env together), or None: authentication off."""
    pairs: list[tuple[str, str]] = []
    path = config.auth_tokens_file
    if path is not None:
        try:
            text = path.read_text()
            mode = path.stat().st_mode
        except OSError as e:
            raise ConfigError(f"auth_tokens_file: cannot read {path}: {e.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("auth_tokens_file %s is readable by group/others; chmod 600 it", path)
        pairs += parse_tokens(text, f"auth_tokens_file {path}", lines=True)
        if not pairs:
            raise ConfigError(f"auth_tokens_file {path}: no tokens (an empty file would lock everyone out)")
    if config.auth_tokens:
        pairs += parse_tokens(config.auth_tokens, "LIVESPEECH_AUTH_TOKENS", lines=False)
    return TokenTable(pairs) if pairs else None


def server_credentials(config: ServerConfig) -> Optional[grpc.ServerCredentials]:
    """TLS for the listening port (mutual TLS with `tls_client_ca`), or None: plaintext."""
    if config.tls_cert is None:
        return None
    assert config.tls_key is not None  # ServerConfig.validate pairs them

    def read(name: str, path: Path) -> bytes:
        try:
            return path.read_bytes()
        except OSError as e:
            raise ConfigError(f"{name}: cannot read {path}: {e.strerror}") from None

    chain, key = read("tls_cert", config.tls_cert), read("tls_key", config.tls_key)
    if b"PRIVATE KEY" not in key:
        raise ConfigError(f"tls_key: {config.tls_key} is not a PEM private key")
    if b"CERTIFICATE" not in chain:
        raise ConfigError(f"tls_cert: {config.tls_cert} is not a PEM certificate")
    client_ca = read("tls_client_ca", config.tls_client_ca) if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def bearer_token(metadata: Iterable[tuple[str, Any]]) -> Optional[str]:
    """The token of the one `authorization: Bearer <token>` entry, else None."""
    values = [v for k, v in metadata or () if k == "authorization"]  # gRPC lowercases keys
    if len(values) != 1 or not isinstance(values[0], str):
        return None
    scheme, _, token = values[0].strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not TOKEN_RE.fullmatch(token) or len(token) > MAX_TOKEN_CHARS:
        return None
    return token


class RefusalLog:
    """Refused calls, logged at most once per `interval_s` for each reason: a client that
    retries without a valid token, or a scan, would otherwise write a line per call. The
    next line after a quiet interval says how many were left out since the last one."""

    def __init__(
        self,
        interval_s: float = REFUSAL_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        emit: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.emit = emit if emit is not None else log.info
        self._last: dict[str, float] = {}  # reason -> when it was last logged
        self._left_out: dict[str, int] = {}

    def refused(self, code: str, method: str, reason: str, peer: str) -> None:
        now = self.clock()
        last = self._last.get(reason)
        if last is not None and now - last < self.interval_s:
            self._left_out[reason] = self._left_out.get(reason, 0) + 1
            return
        self._last[reason] = now
        left_out = self._left_out.pop(reason, 0)
        more = f"; {left_out} more refused for this reason in the {now - last:.0f} s before" if left_out else ""
        self.emit(f"{code} {method}: {reason} (peer {peer}){more}")


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid bearer token before their handler runs."""

    def __init__(self, tokens: TokenTable, metrics: Metrics) -> None:
        self.tokens = tokens
        self.metrics = metrics
        self.refusals = RefusalLog()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method in OPEN_METHODS:
            return await continuation(details)
        token = bearer_token(details.invocation_metadata)
        tenant = self.tokens.tenant_for(token) if token is not None else None
        if tenant is not None:
            _tenant.set(tenant)  # the handler runs in this context (see the module doc)
            return await continuation(details)
        reason = "missing bearer token" if token is None else "invalid token"
        self.metrics.errors_total.labels(code="UNAUTHENTICATED").inc()
        handler = await continuation(details)  # only to answer in the method's shape
        return _refusal(handler, details.method, grpc.StatusCode.UNAUTHENTICATED, reason, self.refusals)


def _refusal(
    handler: Optional[grpc.RpcMethodHandler], method: str, code: grpc.StatusCode, reason: str, refusals: RefusalLog
) -> grpc.RpcMethodHandler:
    """A handler of the refused method's kind that ends the call with `code`. Requests
    are never deserialized: an unauthenticated peer's bytes are not parsed."""
    streaming_in = bool(handler and handler.request_streaming)
    streaming_out = bool(handler and handler.response_streaming)

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        refusals.refused(code.name, method, reason, context.peer())
        if streaming_in:
            # as the service does before refusing a stream: a status that overtakes a
            # client write in flight turns into INTERNAL on grpc's asyncio client
            # (grpc_drain.REFUSE_READ_S); the messages are raw bytes, bounded by
            # max_receive_message_length, and dropped
            await drain_requests(request.__aiter__())
        await context.abort(code, reason)

    return rpc_method_handler(refuse, streaming_in, streaming_out)
