"""Scale-out, for real: 3 `livespeech serve` processes behind nginx (HTTP/2, grpc_pass,
per-stream round robin), concurrent sessions through ONE client connection, SIGTERM to a
replica mid-run.

Checks (docs/deploy.md, "Drain"):
- streams multiplexed on one client connection are spread over all replicas;
- the draining replica's in-flight sessions finish (summary, not cancelled) and the
  process exits cleanly within its grace period, ending nothing by force;
- sessions started during the drain end up on the other replicas: a refusal from the
  draining replica (UNAVAILABLE before `Started`) is retried by the client, the one
  retry rule this deployment relies on;
- once the drained replica is gone, nginx skips its refused port by itself
  (grpc_next_upstream error): the client sees no refusal at all;
- no session fails.

Voices shared across replicas (`test_voices_are_shared_behind_nginx`): 2 replicas on one
voices directory behind nginx; a voice registered through the balancer is used, listed
and deleted through the replica that did not register it, tenants kept apart.

127.0.0.1 only; bounded (~1-2 min on 2 busy cores); skipped when nginx (Debian `nginx`)
is missing. Deselect with `-m "not slow"`.
"""
from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import grpc
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "deploy" / "nginx" / "livespeech-grpc.conf.template"

pytestmark = pytest.mark.slow

N_REPLICAS = 3
MAX_SESSIONS = 4
DRAIN_GRACE_S = 60.0  # generous: the test asserts nothing was ended by force
TEST_BUDGET_S = 150.0  # hard bound for the whole scenario
TEXT = "The quick brown fox jumps over the lazy dog by the river."
# phase 1 must still be in flight when SIGTERM lands, even on a fast machine: a longer
# text, paced like an LLM (pieces per second), keeps each session open for >= 3 s
LONG_TEXT = TEXT + " It was a quiet morning, and nobody was in a hurry."
TEXT_RATE = 6.0
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# a stream reset by the proxy, not a status from our server (whose INTERNAL says
# "internal error"): seen rarely when nginx relays a refusal while the client is still
# sending; before `Started` it is as safe to retry as a refusal
TRANSPORT_INTERNAL = re.compile(r"Internal error from Core|Stream removed|RST_STREAM", re.I)


def retryable(e: grpc.aio.AioRpcError) -> bool:
    if e.code() in RETRYABLE:
        return True
    return e.code() == grpc.StatusCode.INTERNAL and bool(TRANSPORT_INTERNAL.search(e.details() or ""))


def _find_nginx() -> Optional[str]:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _enrollment() -> tuple[bytes, int]:
    """1 s of a noisy tone: an untrained model has no built-in voice."""
    rate = 24_000
    t = np.arange(rate) / rate
    x = 0.3 * np.sin(2 * np.pi * 220 * t) + np.random.default_rng(0).normal(0, 0.05, rate)
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes(), rate


def _servers(upstreams: list[str]) -> str:
    return "\n".join(f"        server {u} max_fails=1 fail_timeout=30s;" for u in upstreams)


def render_nginx_conf(prefix: Path, listen: str, upstreams: list[str], http_listen: str,
                      http_upstreams: list[str]) -> str:
    """No `http_upstreams` (replicas without an HTTP port): one `down` server, so the
    HTTP block still loads."""
    http_servers = _servers(http_upstreams) if http_upstreams else "        server 127.0.0.1:1 down;"
    # as root, workers would switch to `nobody`, who cannot write into pytest's tmp dir
    user = "user root;" if hasattr(os, "geteuid") and os.geteuid() == 0 else ""
    values = dict(LS_PREFIX=str(prefix), LS_LISTEN=listen, LS_UPSTREAM_SERVERS=_servers(upstreams),
                  LS_HTTP_LISTEN=http_listen, LS_HTTP_UPSTREAM_SERVERS=http_servers, LS_USER=user)
    # comments are left alone (they quote the placeholders); nginx's own $variables
    # are not ours and stay (safe_substitute)
    return "".join(
        line if line.lstrip().startswith("#") else string.Template(line).safe_substitute(values)
        for line in TEMPLATE.read_text().splitlines(keepends=True)
    )


# ------------------------------------------------------------------ processes


@dataclass
class Replica:
    port: int
    log: Path
    proc: subprocess.Popen
    metrics_port: Optional[int] = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        """Unlabelled and labelled samples as {'name{labels}': value}."""
        assert self.metrics_port
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def completed(self) -> float:
        return self.metrics()['livespeech_sessions_total{outcome="completed"}']

    def active(self) -> float:
        return self.metrics()["livespeech_active_sessions"]


def start_replica(tmp: Path, i: int, *extra: str, env: Optional[dict[str, str]] = None) -> Replica:
    """`extra` flags come last (argparse: the last of a repeated flag wins)."""
    port = _free_port()
    log = tmp / f"replica{i}.log"
    env = dict(os.environ, **(env or {}), PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable, "-m", "livespeech.client.cli", "serve",
        "--host", "127.0.0.1", "--port", str(port),
        "--metrics-port", "-1",  # any free port; read back from the log
        "--model-path", "random:tiny",
        "--max-sessions", str(MAX_SESSIONS),
        "--torch-threads", "1",
        "--drain-grace-s", str(DRAIN_GRACE_S),
        "--voices-dir", "",  # in memory
        *extra,
    ]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    return Replica(port, log, proc)


def start_nginx(nginx_bin: str, tmp: Path, port: int, replicas: list[Replica],
                http_port: Optional[int] = None, http_upstreams: tuple[str, ...] = ()) -> subprocess.Popen:
    """nginx on `port` (gRPC) and `http_port` (WebSocket + HTTP; any free port if None)."""
    conf = tmp / "nginx.conf"
    http_listen = f"127.0.0.1:{http_port if http_port is not None else _free_port()}"
    conf.write_text(render_nginx_conf(tmp, f"127.0.0.1:{port}", [r.address for r in replicas],
                                      http_listen, list(http_upstreams)))
    check = subprocess.run(
        [nginx_bin, "-t", "-p", str(tmp), "-e", str(tmp / "error.log"), "-c", str(conf)],
        capture_output=True, text=True,
    )
    if check.returncode != 0:
        if "grpc_pass" in check.stderr or "http2" in check.stderr:
            pytest.skip(f"this nginx lacks gRPC/HTTP2 support: {check.stderr.strip()}")
        pytest.fail(f"nginx -t failed:\n{check.stderr}")
    return subprocess.Popen(
        [nginx_bin, "-g", "daemon off;", "-p", str(tmp), "-e", str(tmp / "error.log"), "-c", str(conf)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def wait_ready(replicas: list[Replica], deadline: float) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    pending = list(replicas)
    while pending:
        if time.monotonic() > deadline:
            logs = "\n".join(r.log.read_text()[-2000:] for r in pending)
            pytest.fail(f"replicas not ready in time:\n{logs}")
        for r in list(pending):
            if r.proc.poll() is not None:
                pytest.fail(f"replica on {r.port} exited ({r.proc.returncode}):\n{r.log.read_text()[-3000:]}")
            m = re.search(r"listening on \S+ \(metrics: (\d+)[,)]", r.log.read_text())
            if not m:
                continue
            r.metrics_port = int(m.group(1))
            with grpc.insecure_channel(r.address) as ch:
                try:
                    resp = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service="livespeech.v1.LiveSpeech"), timeout=2
                    )
                except grpc.RpcError:
                    continue
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                pending.remove(r)
        time.sleep(0.3)


def health_probe(r: Replica) -> tuple[int, str]:
    """The check of deploy/docker/grpc_health_check.py (the container HEALTHCHECK), run
    in-process: a subprocess would start too slowly to catch a short drain.
    tests/test_deploy.py runs the script itself."""
    spec = importlib.util.spec_from_file_location("grpc_health_check", ROOT / "deploy" / "docker" / "grpc_health_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ok, status = module.check(r.address)
    return (0 if ok else 1), status


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM first (nginx's master then stops its workers; SIGKILL would orphan them),
    SIGKILL if that is not enough."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# ------------------------------------------------------------------ sessions


@dataclass
class Outcome:
    name: str
    summary: object = None
    refusals: list = field(default_factory=list)  # status codes retried before Started
    error: Optional[str] = None
    audio_bytes: int = 0


async def run_session(client, name: str, seed: int, text: str = TEXT) -> Outcome:
    """One session with the deployment's retry rule: UNAVAILABLE / RESOURCE_EXHAUSTED
    (or a proxy's stream reset) received before `Started` means no replica took the
    session; try again (nginx sends the retry to the next replica in round-robin order,
    which may be the draining one again: hence several attempts). Anything after
    `Started` is a real failure."""
    from livespeech.client.client import Started, SynthesisResult, llm_stream

    out = Outcome(name)
    for attempt in range(10):
        started = False
        result = SynthesisResult()
        stream = client.synthesize(
            llm_stream(text, rate=TEXT_RATE, seed=seed),
            enrollment=_enrollment(),
            guidance_lambda=math.inf,  # an untrained model speaks all of the text, then ends
            seed=seed,
        )
        try:
            async for event in stream:
                if isinstance(event, Started):
                    started = True
                result.add(event)
        except grpc.aio.AioRpcError as e:
            if not started and retryable(e):
                out.refusals.append((e.code().name, e.details()))
                await asyncio.sleep(0.1 * (attempt + 1))
                continue
            out.error = f"{e.code().name}: {e.details()} (started={started})"
            return out
        out.summary = result.summary
        out.audio_bytes = len(result.audio)
        return out
    out.error = f"gave up after {len(out.refusals)} refusals: {out.refusals}"
    return out


async def _scenario(target: str, replicas: list[Replica], report: dict) -> None:
    from livespeech.client.client import AsyncLiveSpeechClient

    async with AsyncLiveSpeechClient(target) as client:  # ONE HTTP/2 connection to nginx
        # phase 1: 2 sessions per replica, all in flight at once
        n1 = 2 * N_REPLICAS
        phase1 = [asyncio.ensure_future(run_session(client, f"p1-{i}", seed=i, text=LONG_TEXT)) for i in range(n1)]
        deadline = time.monotonic() + 40
        while True:
            active = [r.active() for r in replicas]
            if sum(active) >= n1:
                break
            if time.monotonic() > deadline or all(t.done() for t in phase1):
                raise AssertionError(f"phase-1 sessions never were all in flight: active={active}")
            await asyncio.sleep(0.05)
        report["active_at_sigterm"] = active
        # per-stream balancing: streams on one connection reached every replica
        assert all(a >= 1 for a in active), f"streams not spread over the replicas: {active}"

        victim = max(range(N_REPLICAS), key=lambda i: active[i])
        survivors = [r for i, r in enumerate(replicas) if i != victim]
        before = {id(r): r.completed() for r in survivors}
        report["victim"] = victim
        report["victim_in_flight"] = int(active[victim])
        replicas[victim].proc.send_signal(signal.SIGTERM)
        t_sigterm = time.monotonic()

        # the container HEALTHCHECK's check sees the drain; the survivors stay healthy
        await asyncio.sleep(0.2)
        report["health_victim"] = await asyncio.to_thread(health_probe, replicas[victim])
        report["health_survivor"] = await asyncio.to_thread(health_probe, survivors[0])

        # phase 2: new sessions while the victim drains
        n2 = N_REPLICAS
        phase2 = [asyncio.ensure_future(run_session(client, f"p2-{i}", seed=100 + i)) for i in range(n2)]
        outcomes = await asyncio.gather(*phase1, *phase2)

        # the victim finishes its sessions and exits by itself
        proc = replicas[victim].proc
        while proc.poll() is None and time.monotonic() < t_sigterm + DRAIN_GRACE_S + 10:
            await asyncio.sleep(0.1)
        report["victim_exit_s"] = round(time.monotonic() - t_sigterm, 2)
        report["victim_rc"] = proc.returncode

        # phase 3: the victim's port is closed now; nginx skips it on its own
        phase3 = await asyncio.gather(*(run_session(client, f"p3-{i}", seed=200 + i) for i in range(n2)))
        outcomes += phase3
        after = {id(r): r.completed() for r in survivors}

    report["outcomes"] = outcomes
    report["phase3_refusals"] = [o.refusals for o in phase3]
    report["survivors_completed_delta"] = sum(after[k] - before[k] for k in after)
    report["n"] = (n1, n2, len(phase3))


@pytest.fixture
def nginx_bin() -> str:
    path = _find_nginx()
    if path is None:
        pytest.skip("nginx not installed (Debian: apt-get install nginx)")
    return path


def test_drain_behind_nginx(tmp_path: Path, nginx_bin: str) -> None:
    t0 = time.monotonic()
    procs: list[subprocess.Popen] = []
    try:
        replicas = [start_replica(tmp_path, i) for i in range(N_REPLICAS)]
        procs += [r.proc for r in replicas]

        nginx_port = _free_port()
        procs.append(start_nginx(nginx_bin, tmp_path, nginx_port, replicas))

        wait_ready(replicas, t0 + 90)
        report: dict = {}
        asyncio.run(asyncio.wait_for(_scenario(f"127.0.0.1:{nginx_port}", replicas, report), TEST_BUDGET_S))

        outcomes: list[Outcome] = report["outcomes"]
        print("\nmulti-replica report:", {k: v for k, v in report.items() if k != "outcomes"})
        for o in outcomes:
            print(f"  {o.name}: refusals={o.refusals} error={o.error} audio_s={getattr(o.summary, 'audio_s', None)}")

        failed = [o for o in outcomes if o.error or o.summary is None or o.summary.cancelled or not o.audio_bytes]
        assert not failed, f"sessions failed: {failed}\n{(tmp_path / 'access.log').read_text()}"
        refusals = [r for o in outcomes for r in o.refusals]
        transport = [r for r in refusals if r[0] == "INTERNAL"]
        assert len(transport) <= 2, f"too many proxy resets: {transport}"

        assert report["health_victim"] == (1, "NOT_SERVING"), report
        assert report["health_survivor"] == (0, "SERVING"), report

        victim_log = replicas[report["victim"]].log.read_text()
        assert report["victim_rc"] == 0, f"victim did not exit cleanly ({report['victim_rc']}):\n{victim_log[-3000:]}"
        assert f"draining: {report['victim_in_flight']} in-flight sessions" in victim_log
        assert "still running after" not in victim_log, "drain ended sessions by force"

        n1, n2, n3 = report["n"]
        # every session started after SIGTERM completed on a survivor, plus the
        # survivors' own phase-1 sessions
        assert report["survivors_completed_delta"] == (n1 - report["victim_in_flight"]) + n2 + n3, report
        # with the drained replica gone nginx routes around its closed port itself
        assert all(not r for r in report["phase3_refusals"]), report["phase3_refusals"]
        assert time.monotonic() - t0 < TEST_BUDGET_S + 100
    finally:
        for p in procs:
            _stop(p)


# ------------------------------------------------------------------ shared voices

TOKENS = {"acme": "acme-token-0123456789", "globex": "globex-token-0123456789"}


def served_by(tmp: Path, method: str) -> list[str]:
    """The replica address (host:port) of each `method` call in nginx's access log, in
    order; after a retried connect, the one that answered."""
    log = tmp / "access.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [
        re.search(r"upstream=(.*?) grpc_status=", line).group(1).split(", ")[-1]
        for line in lines
        if f"/livespeech.v1.LiveSpeech/{method} " in line
    ]


async def _shared_voices_scenario(tmp: Path, target: str, replicas: list[Replica]) -> None:
    from livespeech.client.client import AsyncLiveSpeechClient

    hard = dict(guidance_lambda=math.inf, seed=1)  # an untrained model speaks all of the text, then ends
    pcm, rate = _enrollment()

    def names(voices) -> set[str]:
        return {v.voice_id for v in voices if not v.builtin}

    async def code(call) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        return e.value.code()

    async with AsyncLiveSpeechClient(target, token=TOKENS["acme"]) as balanced:
        await balanced.register_voice("alice", pcm16=pcm, sample_rate=rate)
        for _ in range(50):  # nginx writes the line when the call has ended
            if served_by(tmp, "RegisterVoice"):
                break
            await asyncio.sleep(0.1)
        (home_address,) = served_by(tmp, "RegisterVoice")
        home = next(r for r in replicas if r.address == home_address)
        other = next(r for r in replicas if r is not home)

        # every ListVoices through the balancer lists it, on whichever replica it lands
        for _ in range(4):
            assert names(await balanced.list_voices()) == {"alice"}
        assert set(served_by(tmp, "ListVoices")) == {r.address for r in replicas}, "round robin reached both"

    async with AsyncLiveSpeechClient(other.address, token=TOKENS["acme"]) as acme_other, \
            AsyncLiveSpeechClient(home.address, token=TOKENS["acme"]) as acme_home, \
            AsyncLiveSpeechClient(other.address, token=TOKENS["globex"]) as globex_other:
        # the replica that did not register it synthesises and lists it
        assert names(await acme_other.list_voices()) == {"alice"}
        r = await acme_other.synthesize_to_result("Hello from the other replica.", voice_id="alice", **hard)
        assert r.summary is not None and not r.summary.cancelled and r.audio
        assert r.started.config.voice_id == "alice"
        # another tenant does not see it there either
        assert names(await globex_other.list_voices()) == set()
        assert await code(globex_other.synthesize_to_result("Hi.", voice_id="alice", **hard)) == grpc.StatusCode.NOT_FOUND
        assert await code(globex_other.delete_voice("alice")) == grpc.StatusCode.NOT_FOUND
        # the same id is taken on every replica: registering it again without overwrite
        assert await code(acme_other.register_voice("alice", pcm16=pcm, sample_rate=rate)) == grpc.StatusCode.ALREADY_EXISTS

        # deleted through the other replica: gone on the one that registered it
        await acme_other.delete_voice("alice")
        assert names(await acme_home.list_voices()) == set()
        assert await code(acme_home.synthesize_to_result("Hi.", voice_id="alice", **hard)) == grpc.StatusCode.NOT_FOUND
        assert await code(acme_home.delete_voice("alice")) == grpc.StatusCode.NOT_FOUND


def test_voices_are_shared_behind_nginx(tmp_path: Path, nginx_bin: str) -> None:
    """2 replicas on one voices directory (a ReadWriteMany volume in Kubernetes), with
    bearer-token tenants, behind nginx: a voice registered through the balancer is listed
    and synthesised by the replica that did not handle the registration, deleted there,
    and then gone on the first; another tenant never sees it. The periodic rescan is off,
    so each replica picks the change up on the call itself."""
    t0 = time.monotonic()
    procs: list[subprocess.Popen] = []
    voices = tmp_path / "voices"
    tokens = {"LIVESPEECH_AUTH_TOKENS": ",".join(f"{t}:{k}" for t, k in TOKENS.items())}
    try:
        replicas = [
            start_replica(tmp_path, i, "--voices-dir", str(voices), "--voices-rescan-s", "0", env=tokens) for i in range(2)
        ]
        procs += [r.proc for r in replicas]
        nginx_port = _free_port()
        procs.append(start_nginx(nginx_bin, tmp_path, nginx_port, replicas))
        wait_ready(replicas, t0 + 90)
        asyncio.run(asyncio.wait_for(_shared_voices_scenario(tmp_path, f"127.0.0.1:{nginx_port}", replicas), 120))
        assert not (voices / "acme" / "alice.json").exists()
    finally:
        for p in procs:
            _stop(p)
