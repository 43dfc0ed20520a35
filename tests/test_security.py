"""Security: TLS, mutual TLS, bearer tokens and tenants, limits, the voice directory,
secrets in logs. Real servers on 127.0.0.1 (random-init tiny model); certificates are
made at test time (the `cryptography` package, else the `openssl` CLI).

- TLS: a client that trusts the CA works; plaintext and a client trusting another CA
  cannot connect. Mutual TLS: a client without a certificate, or with one from another
  CA, cannot connect.
- Tokens: no/malformed `authorization` metadata and unknown tokens get UNAUTHENTICATED
  (see server/auth.py for why not PERMISSION_DENIED) on every method and on reflection,
  before any handler: the engine's `open_session`/`make_voice` are never called and no
  slot is taken. Health checks stay open. Refused streams get their status, not
  INTERNAL, even with writes in flight.
- Tenants: voices are per tenant (listing, use, delete; per-tenant limit), stored under
  `<voices_dir>/<tenant>/`.
- Voice ids that could name another file ("../x", "a/b", absolute paths, NUL, a trailing
  newline, Unicode lookalikes, ...) are INVALID_ARGUMENT, and nothing is written
  outside the voice directory (checked over every file under the test's root, also for
  hypothesis-generated ids).
- Limits: gRPC message size, text per session, reference audio length.
- Logs captured during auth failures never contain a token; nor do config reprs and
  config error messages.
"""
from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from livespeech.client.cli import main as cli_main
from livespeech.client.client import NO_RETRY, AsyncLiveSpeechClient, ClientSecurity
from conftest import END, HARD, config_msg, raw_synthesize, text_msg
from reliability_helpers import ClientLoop, record
from livespeech.api.audio import encode_wav
from livespeech.server.auth import TokenTable, parse_tokens
from livespeech.server.config import ServerConfig
from livespeech.api.protocol import SERVICE_NAME, Stub, pb
from livespeech.api.session import ConfigError

C = grpc.StatusCode
ALICE = "alice-" + "A1b2C3d4E5f6G7h8I9j0K1l2"  # test tokens (b64token, >= 16 chars)
BOB = "bob-" + "Z9y8X7w6V5u4T3s2R1q0P9o8"
ENV_TOKEN = "carol-" + "M1n2B3v4C5x6Z7l8K9j0H1g2"
WRONG = ALICE[:-1] + ("x" if ALICE[-1] != "x" else "y")  # a near miss
TEXT = "Secure hello."


# ---------------------------------------------------------------- certificates


def _make_certs(d: Path) -> dict[str, Path]:
    """CA, server cert (SAN 127.0.0.1, localhost), client cert, and a rogue CA with its
    own client cert. EC P-256 keys: fast to make."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        return _make_certs_openssl(d)

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem: str, key, cert) -> None:
        (d / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (d / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def issue(cn: str, issuer=None, ca: bool = False, server: bool = False):
        key = ec.generate_private_key(ec.SECP256R1())
        signer_key, signer_name = (issuer[0], issuer[1].subject) if issuer else (key, name(cn))
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(signer_name).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if server:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        if not ca:
            usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        return key, b.sign(signer_key, hashes.SHA256())

    ca = issue("livespeech test CA", ca=True)
    rogue = issue("rogue CA", ca=True)
    write("ca", *ca)
    write("rogue-ca", *rogue)
    write("server", *issue("127.0.0.1", ca, server=True))
    write("client", *issue("client", ca))
    write("rogue-client", *issue("rogue client", rogue))
    return {p.stem: p for p in d.iterdir()} | {p.name: p for p in d.iterdir()}


def _make_certs_openssl(d: Path) -> dict[str, Path]:
    if not shutil.which("openssl"):
        pytest.skip("neither the cryptography package nor openssl is available")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    for ca in ("ca", "rogue-ca"):
        run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{ca}.key",
            "-out", f"{ca}.pem", "-days", "1", "-subj", f"/CN={ca}")
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for leaf, ca, ext in (("server", "ca", "server.ext"), ("client", "ca", "client.ext"), ("rogue-client", "rogue-ca", "client.ext")):
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{leaf}.key",
            "-out", f"{leaf}.csr", "-subj", f"/CN={leaf}")
        run("x509", "-req", "-in", f"{leaf}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{leaf}.pem", "-days", "1", "-extfile", ext)
    return {p.name: p for p in d.iterdir()}


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    return _make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def client():
    loop = ClientLoop()
    yield loop
    loop.close()


def health(address: str, creds=None) -> int:
    ch = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
    with ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10).status


SERVING = health_pb2.HealthCheckResponse.SERVING


# ---------------------------------------------------------------- TLS


def synth(client: ClientLoop, address: str, **security) -> tuple:
    async def go():
        # the refusals here are the point: UNAVAILABLE is not retried
        async with AsyncLiveSpeechClient(address, timeout=30, retry=NO_RETRY, **security) as c:
            try:
                r = await c.synthesize_to_result(TEXT, **HARD)
                return C.OK, r.summary.spoken_text
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()

    return client.run(go())


def test_tls_and_mutual_tls(server_factory, certs, client) -> None:
    tls = server_factory(tls_cert=certs["server.pem"], tls_key=certs["server.key"])
    assert synth(client, tls.address, tls_ca=certs["ca.pem"]) == (C.OK, TEXT)
    assert synth(client, tls.address)[0] == C.UNAVAILABLE  # plaintext to a TLS port
    assert synth(client, tls.address, tls_ca=certs["rogue-ca.pem"])[0] == C.UNAVAILABLE  # untrusted server
    assert health(tls.address, grpc.ssl_channel_credentials(certs["ca.pem"].read_bytes())) == SERVING

    mtls = server_factory(tls_cert=certs["server.pem"], tls_key=certs["server.key"], tls_client_ca=certs["ca.pem"])
    ok = dict(tls_ca=certs["ca.pem"], tls_cert=certs["client.pem"], tls_key=certs["client.key"])
    assert synth(client, mtls.address, **ok) == (C.OK, TEXT)
    assert synth(client, mtls.address, tls_ca=certs["ca.pem"])[0] == C.UNAVAILABLE  # no client certificate
    rogue = dict(tls_ca=certs["ca.pem"], tls_cert=certs["rogue-client.pem"], tls_key=certs["rogue-client.key"])
    assert synth(client, mtls.address, **rogue)[0] == C.UNAVAILABLE
    assert mtls.engine.active_sessions == 0


def _noise(seconds: float) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal(int(24000 * seconds)) * 0.1).astype(np.float32)


# ---------------------------------------------------------------- tokens


@pytest.fixture(scope="module")
def voices_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("root")
    (root / "outside.txt").write_text("sentinel")
    return root


@pytest.fixture(scope="module")
def auth_srv(server_factory, voices_root, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("secrets") / "tokens"
    tokens.write_text(f"# tenant:token\nalice:{ALICE}\n\nbob:{BOB}\n")
    tokens.chmod(0o600)
    h = server_factory(auth_tokens_file=tokens, auth_tokens=f"carol:{ENV_TOKEN}", voices_dir=voices_root / "voices",
                       max_voices_per_tenant=2, max_text_piece_chars=200, max_session_text_chars=200,
                       max_enrollment_seconds=1.0)
    for tenant in ("alice", "bob"):
        h.run(h.app.voices.register("default", _noise(1.0), tenant=tenant))
    calls = {"open_session": 0, "make_voice": 0}
    for name in calls:
        real = getattr(h.engine, name)

        def counting(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        setattr(h.engine, name, counting)
    h.calls = calls
    return h


def bearer(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


async def every_method(address: str, metadata) -> dict[str, grpc.StatusCode]:
    """Each method (and reflection) once with `metadata`; the status codes."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    out = {}
    async with grpc.aio.insecure_channel(address) as ch:
        stub = Stub(ch)
        call = stub.Synthesize(metadata=metadata)
        r = await _drain(call, [config_msg(), text_msg("hi there"), END])
        out["Synthesize"] = r
        for name, req in (
            ("RegisterVoice", pb.RegisterVoiceRequest(voice_id="v", wav=encode_wav(_noise(0.2), 24000))),
            ("ListVoices", pb.ListVoicesRequest()),
            ("DeleteVoice", pb.DeleteVoiceRequest(voice_id="v")),
        ):
            try:
                await getattr(stub, name)(req, metadata=metadata, timeout=10)
                out[name] = C.OK
            except grpc.aio.AioRpcError as e:
                out[name] = e.code()
        refl = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(metadata=metadata)
        out["Reflection"] = await _drain(refl, [reflection_pb2.ServerReflectionRequest(list_services="")])
    return out


async def _drain(call, requests) -> grpc.StatusCode:
    for r in requests:
        try:
            await call.write(r)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            break
    try:
        await call.done_writing()
        async for _ in call:
            pass
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
        pass
    return await call.code()


def test_unauthenticated_calls_never_reach_the_engine(auth_srv, client) -> None:
    h = auth_srv
    before = dict(h.calls)
    cases = {
        "none": None,
        "wrong": bearer(WRONG),
        "basic": (("authorization", f"Basic {ALICE}"),),
        "no scheme": (("authorization", ALICE),),
        "empty bearer": (("authorization", "Bearer "),),
        "two headers": (("authorization", f"Bearer {ALICE}"), ("authorization", f"Bearer {BOB}")),
        "bad chars": (("authorization", f"Bearer {ALICE} x"),),
        "oversize": bearer("A" * 5000),
    }
    seen = {}
    for label, md in cases.items():
        codes = client.run(every_method(h.address, md))
        seen[label] = codes
        assert set(codes.values()) == {C.UNAUTHENTICATED}, (label, codes)
        assert h.engine.active_sessions == 0
    assert h.calls == before, "an unauthenticated call reached the engine"
    assert health(h.address) == SERVING  # probes need no token

    async def details():
        async with grpc.aio.insecure_channel(h.address) as ch:
            a = await raw_synthesize(Stub(ch), [config_msg(), text_msg("x"), END])
            call = Stub(ch).Synthesize(metadata=bearer(WRONG))
            await _drain(call, [config_msg(), text_msg("x"), END])
            return a.details, await call.details()

    assert client.run(details()) == ("missing bearer token", "invalid token")
    # every valid token works, from the file and from the env
    for token, tenant in ((ALICE, "alice"), (BOB, "bob")):
        assert synth(client, h.address, token=token) == (C.OK, TEXT), tenant
    assert synth(client, h.address, token=ENV_TOKEN)[0] == C.FAILED_PRECONDITION  # carol has no voice yet: authenticated
    assert h.calls["open_session"] == before["open_session"] + 2
    record("security_auth", dict(cases=len(cases), methods_each=5, unauthenticated=len(cases) * 5, reached_engine=0))


def test_tenants_have_their_own_voices(auth_srv, client, voices_root) -> None:
    h = auth_srv
    wav = encode_wav(_noise(0.3), 24000)

    async def go():
        async with AsyncLiveSpeechClient(h.address, token=ALICE) as alice, AsyncLiveSpeechClient(h.address, token=BOB) as bob:
            await alice.register_voice("shared-name", wav=wav)
            assert "shared-name" in {v.voice_id for v in await alice.list_voices()}
            assert "shared-name" not in {v.voice_id for v in await bob.list_voices()}
            for op in (bob.synthesize_to_result("Hi.", voice_id="shared-name", **HARD), bob.delete_voice("shared-name")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await op
                assert e.value.code() == C.NOT_FOUND
            await bob.register_voice("shared-name", wav=wav)  # the same id in bob's namespace
            r = await alice.synthesize_to_result("Hi.", voice_id="shared-name", **HARD)
            assert r.summary is not None
            # per-tenant limit: alice holds "default" and "shared-name" (limit 2)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await alice.register_voice("third", wav=wav)
            assert e.value.code() == C.RESOURCE_EXHAUSTED and "per tenant" in e.value.details()
            await alice.delete_voice("shared-name")
            await bob.delete_voice("shared-name")

    client.run(go())
    voices = voices_root / "voices"
    # the anonymous tenant's (the harness's) voice at the top, each tenant's in its folder;
    # `.lock` is the writers' lock (server/voices.py)
    assert sorted(p.relative_to(voices).as_posix() for p in voices.rglob("*") if p.is_file()) == [
        ".lock", "alice/default.json", "alice/default.wav", "bob/default.json", "bob/default.wav", "default.json",
        "default.wav"]


BAD_IDS = ["../x", "..", ".", "a/b", "/tmp/abs", "x\x00y", "abc\n", "\nabc", "ｘ", "dеfault", "a b", "a.b", "..\\x",
           "%2e%2e%2fx", "x" * 65, "", "~", "a\u202eb", "tab\t"]


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def test_voice_ids_cannot_name_other_files(auth_srv, client, voices_root) -> None:
    h = auth_srv
    before = files_under(voices_root)
    wav = encode_wav(_noise(0.2), 24000)

    async def go():
        codes = {}
        async with AsyncLiveSpeechClient(h.address, token=ALICE) as c:
            for vid in BAD_IDS:
                ops = [c.register_voice(vid, wav=wav), c.delete_voice(vid)]
                if vid:  # an empty voice_id in a config means the default voice
                    ops.append(c.synthesize_to_result("x", voice_id=vid, **HARD))
                for op in ops:
                    try:
                        await op
                        codes[vid] = C.OK
                    except grpc.aio.AioRpcError as e:
                        codes.setdefault(vid, e.code())
                        assert e.code() == C.INVALID_ARGUMENT, (vid, e.code(), e.details())
        return codes

    codes = client.run(go())
    assert C.OK not in codes.values()
    assert files_under(voices_root) == before, "a file appeared or vanished"


@settings(max_examples=int(os.environ.get("LIVESPEECH_SECURITY_EXAMPLES", "40")), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(vid=st.one_of(st.text(max_size=70), st.from_regex(r"[a-zA-Z0-9_-]{1,64}", fullmatch=True),
                     st.sampled_from(BAD_IDS).flatmap(lambda b: st.text(max_size=3).map(lambda t: b + t))))
def test_any_voice_id_writes_only_its_own_files(auth_srv, client, voices_root, vid) -> None:
    h = auth_srv
    before = files_under(voices_root)
    wav = encode_wav(_noise(0.2), 24000)

    async def go():
        async with grpc.aio.insecure_channel(h.address) as ch:
            try:
                await Stub(ch).RegisterVoice(pb.RegisterVoiceRequest(voice_id=vid, wav=wav), metadata=bearer(BOB), timeout=30)
                await Stub(ch).DeleteVoice(pb.DeleteVoiceRequest(voice_id=vid), metadata=bearer(BOB), timeout=30)
                return C.OK
            except grpc.aio.AioRpcError as e:
                return e.code()

    code = client.run(go())
    legal = bool(re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", vid))
    if vid == "default":
        assert code == C.ALREADY_EXISTS
    else:
        assert code == (C.OK if legal else C.INVALID_ARGUMENT), (vid, code)
    assert files_under(voices_root) == before


# ---------------------------------------------------------------- limits


def test_limits(auth_srv, client) -> None:
    h = auth_srv
    md = bearer(ALICE)

    async def go():
        out = {}
        async with grpc.aio.insecure_channel(h.address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            stub = Stub(ch)
            # one message over the server's max_receive_message_length (4 MiB here): refused by gRPC
            try:
                await stub.RegisterVoice(pb.RegisterVoiceRequest(voice_id="big", wav=b"\0" * (5 << 20)), metadata=md, timeout=30)
            except grpc.aio.AioRpcError as e:
                out["message"] = (e.code(), e.details())
            call = stub.Synthesize(metadata=md)
            pieces = [text_msg("word " * 20) for _ in range(3)]  # 300 chars > 200 per session
            await _drain(call, [config_msg(), *pieces, END])
            out["session_text"] = (await call.code(), await call.details())
            two_s = (np.random.default_rng(0).standard_normal(48000) * 3000).astype("<i2").tobytes()
            call = stub.Synthesize(metadata=md)
            await _drain(call, [config_msg(enrollment=pb.PcmAudio(pcm16_le=two_s, sample_rate=24000)), END])
            out["reference_audio"] = (await call.code(), await call.details())
            try:
                await stub.RegisterVoice(pb.RegisterVoiceRequest(voice_id="long", wav=encode_wav(_noise(2.0), 24000)),
                                         metadata=md, timeout=30)
            except grpc.aio.AioRpcError as e:
                out["register_audio"] = (e.code(), e.details())
        return out

    out = client.run(go())
    assert out["message"][0] == C.RESOURCE_EXHAUSTED and "larger than max" in out["message"][1]
    assert out["session_text"][0] == C.RESOURCE_EXHAUSTED and "max_session_text_chars" in out["session_text"][1]
    assert out["reference_audio"][0] == C.INVALID_ARGUMENT and "limit" in out["reference_audio"][1]
    assert out["register_audio"][0] == C.INVALID_ARGUMENT and "limit" in out["register_audio"][1]


# ---------------------------------------------------------------- secrets


def test_refusals_are_logged_at_most_once_per_interval_with_a_count(auth_srv, client, caplog, monkeypatch) -> None:
    from livespeech.server.auth import RefusalLog

    h = auth_srv
    monkeypatch.setattr(h.app.auth, "refusals", RefusalLog(interval_s=3600.0))  # the whole test in one interval
    caplog.set_level(logging.INFO)
    before = h.metrics.errors_total.labels(code="UNAUTHENTICATED")._value.get()

    async def refused(n: int) -> list:
        async with grpc.aio.insecure_channel(h.address) as ch:
            codes = []
            for _ in range(n):
                try:
                    await Stub(ch).ListVoices(pb.ListVoicesRequest(), metadata=bearer(WRONG), timeout=10)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
            return codes

    assert client.run(refused(20)) == [C.UNAUTHENTICATED] * 20
    lines = [r.getMessage() for r in caplog.records if "UNAUTHENTICATED" in r.getMessage()]
    assert len(lines) == 1 and "invalid token" in lines[0], lines
    # every refusal is still counted
    assert h.metrics.errors_total.labels(code="UNAUTHENTICATED")._value.get() == before + 20


def test_refusal_log_counts_what_it_left_out() -> None:
    from livespeech.server.auth import RefusalLog

    now = [0.0]
    lines = []
    rl = RefusalLog(interval_s=10.0, clock=lambda: now[0], emit=lines.append)
    for _ in range(5):
        rl.refused("UNAUTHENTICATED", "/m", "invalid token", "peer-a")
    now[0] = 5.0
    rl.refused("UNAUTHENTICATED", "/m", "invalid token", "peer-b")
    rl.refused("UNAUTHENTICATED", "/m", "missing bearer token", "peer-c")  # another reason: its own line
    assert len(lines) == 2 and "invalid token" in lines[0] and "missing bearer token" in lines[1]
    assert "more" not in lines[0]
    now[0] = 11.0
    rl.refused("UNAUTHENTICATED", "/m", "invalid token", "peer-d")
    assert len(lines) == 3 and "peer-d" in lines[2] and "5 more" in lines[2], lines


def test_no_secret_in_logs_reprs_or_errors(auth_srv, client, caplog, tmp_path, monkeypatch) -> None:
    from livespeech.server.auth import RefusalLog

    h = auth_srv
    monkeypatch.setattr(h.app.auth, "refusals", RefusalLog())  # earlier tests' refusals must not hide these
    caplog.set_level(logging.DEBUG)
    logging.getLogger().setLevel(logging.DEBUG)
    client.run(every_method(h.address, bearer(WRONG)))
    client.run(every_method(h.address, (("authorization", f"Basic {ALICE}"),)))
    assert synth(client, h.address, token=ALICE)[0] == C.OK
    text = caplog.text
    assert "invalid token" in text and "missing bearer token" in text  # the refusals were logged...
    for secret in (ALICE, WRONG, BOB, ENV_TOKEN):
        assert secret not in text  # ...without the token
    cfg = ServerConfig(auth_tokens=f"carol:{ENV_TOKEN}")
    assert ENV_TOKEN not in repr(cfg) and ENV_TOKEN not in str(cfg)
    assert ALICE not in repr(ClientSecurity(token=ALICE))
    for bad in (f"alice {ALICE}", f"al/ice:{ALICE}", f"alice:{ALICE}!", "alice:short"):
        with pytest.raises(ConfigError) as e:
            parse_tokens(bad, "test", lines=True)
        assert ALICE not in str(e.value)
    with pytest.raises(ConfigError, match="listed twice") as e:
        TokenTable(parse_tokens(f"a:{ALICE}\nb:{ALICE}", "test", lines=True))
    assert ALICE not in str(e.value) and ALICE not in repr(TokenTable([("a", ALICE)]))


def test_security_settings_are_validated_at_the_edge(certs, tmp_path) -> None:
    with pytest.raises(ConfigError, match="go together"):
        ServerConfig(tls_cert=certs["server.pem"])
    with pytest.raises(ConfigError, match="mutual TLS"):
        ServerConfig(tls_client_ca=certs["ca.pem"])
    with pytest.raises(ConfigError, match="not a file"):
        ServerConfig(auth_tokens_file=tmp_path / "missing")
    # secrets have no flag (a command line is public); the env works
    with pytest.raises(SystemExit):
        ServerConfig.from_args(["--auth-tokens", f"a:{ALICE}"], env={})
    cfg = ServerConfig.from_args(["--tls-cert", str(certs["server.pem"]), "--tls-key", str(certs["server.key"])],
                                 env={"LIVESPEECH_AUTH_TOKENS": f"a:{ALICE}"})
    assert cfg.auth_tokens == f"a:{ALICE}" and cfg.tls_cert == certs["server.pem"]
    empty = tmp_path / "empty"
    empty.write_text("# nobody\n")
    from livespeech.server.auth import load_tokens

    with pytest.raises(ConfigError, match="no tokens"):
        load_tokens(ServerConfig(auth_tokens_file=empty))
    with pytest.raises(ValueError, match="b64token"):
        ClientSecurity(token="Bearer abc")


def test_cli_with_tls_and_token(server_factory, certs, tmp_path, capsys, monkeypatch) -> None:
    h = server_factory(tls_cert=certs["server.pem"], tls_key=certs["server.key"], auth_tokens=f"alice:{ALICE}")
    h.run(h.app.voices.register("default", _noise(1.0), tenant="alice"))
    token_file = tmp_path / "token"
    token_file.write_text(ALICE + "\n")
    out = tmp_path / "out.wav"
    common = ["--server", h.address, "--tls-ca", str(certs["ca.pem"])]
    assert cli_main(["say", "Hi there.", "-o", str(out), "--quiet", *common, "--token-file", str(token_file)]) == 0
    assert out.stat().st_size > 44
    monkeypatch.setenv("LIVESPEECH_TOKEN", ALICE)
    assert cli_main(["voices", "list", *common]) == 0
    assert "default" in capsys.readouterr().out
    assert cli_main(["voices", "list", *common, "--token", WRONG]) == 1
    err = capsys.readouterr().err
    assert "UNAUTHENTICATED" in err and WRONG not in err


# ---------------------------------------------------------------- per-tenant quota, wall-clock cap


async def _open(address: str, token: str):
    """A Synthesize stream with text but no end of input (the session stays open).
    Returns (channel, call, first response or the refusal's (code, details, trailing))."""
    ch = grpc.aio.insecure_channel(address)
    call = Stub(ch).Synthesize(metadata=bearer(token), timeout=30)
    await call.write(config_msg())
    await call.write(text_msg("hello there, this stays open"))
    try:
        first = await call.read()
    except grpc.aio.AioRpcError:
        first = None
    if first is None or first is grpc.aio.EOF:
        return ch, call, (await call.code(), await call.details(), dict(await call.trailing_metadata() or ()))
    return ch, call, first


def test_sessions_per_tenant_are_capped(server_factory, tmp_path, client) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice:{ALICE}\nbob:{BOB}\n")
    tokens.chmod(0o600)
    h = server_factory(auth_tokens_file=tokens, max_sessions=4, max_sessions_per_tenant=1, retry_after_ms=250)
    for tenant in ("alice", "bob"):
        h.run(h.app.voices.register("default", _noise(1.0), tenant=tenant))

    async def go():
        ch1, a1, first = await _open(h.address, ALICE)
        assert not isinstance(first, tuple), first
        assert first.WhichOneof("response") == "started"
        ch2, a2, refused = await _open(h.address, ALICE)  # alice's second session
        code, details, trailing = refused
        assert code == C.RESOURCE_EXHAUSTED and "max_sessions_per_tenant" in details
        assert trailing.get("retry-after-ms") == "250"
        ch3, b1, first_b = await _open(h.address, BOB)  # another tenant is not affected
        assert first_b.WhichOneof("response") == "started"
        a1.cancel()  # alice's session ends: her quota is free again
        for _ in range(50):
            ch4, a3, again = await _open(h.address, ALICE)
            if not isinstance(again, tuple):
                break
            await ch4.close()
            await asyncio.sleep(0.1)
        assert again.WhichOneof("response") == "started"
        for c in (a3, b1):
            c.cancel()
        for c in (ch1, ch2, ch3, ch4):
            await c.close()

    client.run(go())
    assert h.wait_idle()
    assert h.app.service.tenant_sessions("alice") == h.app.service.tenant_sessions("bob") == 0  # every slot returned


def test_a_session_open_too_long_is_ended(server_factory, client) -> None:
    """Text every 0.2 s keeps the idle timeout away; the wall-clock cap still ends it."""
    h = server_factory(max_session_wall_s=1.5, idle_timeout_s=30)

    async def go():
        async with grpc.aio.insecure_channel(h.address) as ch:
            call = Stub(ch).Synthesize(timeout=30)
            await call.write(config_msg())
            t0 = asyncio.get_running_loop().time()

            async def keep_talking():
                try:
                    for i in range(100):
                        await call.write(text_msg(f"word{i} "))
                        await asyncio.sleep(0.2)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                    pass

            talker = asyncio.ensure_future(keep_talking())
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError:
                pass
            talker.cancel()
            return await call.code(), await call.details(), asyncio.get_running_loop().time() - t0

    code, details, took = client.run(go())
    assert code == C.DEADLINE_EXCEEDED and "max_session_wall_s" in details, (code, details)
    assert took >= 1.4  # not before the cap
    assert h.wait_idle()


def test_tokens_reload_without_a_restart(server_factory, tmp_path, client) -> None:
    """What SIGHUP does (`livespeech serve` wires it to App.reload_tokens): revoke alice,
    add bob; a token file that does not load keeps the old table."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice:{ALICE}\n")
    tokens.chmod(0o600)
    h = server_factory(auth_tokens_file=tokens)

    def list_voices(token: str) -> grpc.StatusCode:
        async def go():
            async with grpc.aio.insecure_channel(h.address) as ch:
                try:
                    await Stub(ch).ListVoices(pb.ListVoicesRequest(), metadata=bearer(token), timeout=10)
                    return C.OK
                except grpc.aio.AioRpcError as e:
                    return e.code()

        return client.run(go())

    assert (list_voices(ALICE), list_voices(BOB)) == (C.OK, C.UNAUTHENTICATED)
    tokens.write_text(f"bob:{BOB}\n")
    assert h.app.reload_tokens()
    assert (list_voices(ALICE), list_voices(BOB)) == (C.UNAUTHENTICATED, C.OK)
    for broken in ("bob-without-a-colon\n", "# nothing but a comment\n"):
        tokens.write_text(broken)
        assert not h.app.reload_tokens()
        assert (list_voices(ALICE), list_voices(BOB)) == (C.UNAUTHENTICATED, C.OK)
    tokens.unlink()
    assert not h.app.reload_tokens()
    assert list_voices(BOB) == C.OK
