"""Loopback-only targets, and a server subprocess the load test starts and stops itself."""
from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

READY_LINE = "livespeech: serving on"


class NotLoopback(ValueError):
    pass


def split_target(target: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port)."""
    if target.startswith("["):
        host, _, rest = target[1:].partition("]")
        port = rest.lstrip(":")
    else:
        host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"target must be HOST:PORT, got {target!r}")
    return host, int(port)


def is_loopback_host(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host.lower() != "localhost":
        return False  # no name resolution for anything else: a DNS name may point anywhere
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def check_loopback(target: str) -> tuple[str, int]:
    host, port = split_target(target)
    if not is_loopback_host(host):
        raise NotLoopback(f"refusing to load-test {target!r}: only loopback targets (127.0.0.0/8, ::1, localhost) are allowed")
    return host, port


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free now: their sockets are held open together while they are
    picked (picked one at a time, the second can be the first again, and a spawned
    server's two listeners would then collide)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def proc_cpu_seconds(pid: Optional[int]) -> Optional[float]:
    """user + system CPU seconds of a process and its live child processes (a server's
    engine processes; Linux /proc), None where unavailable."""
    if pid is None:
        return None
    own = _cpu_ticks(pid)
    if own is None:
        return None
    return (own + sum(_cpu_ticks(p) or 0 for p in _descendants(pid))) / os.sysconf("SC_CLK_TCK")


def _cpu_ticks(pid: int) -> Optional[int]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None  # gone


def _descendants(pid: int) -> list[int]:
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            pids = [int(p) for p in children.read_text().split()]
        except OSError:
            continue  # the thread ended
        for child in pids:
            found += [child] + _descendants(child)
    return found


class SpawnedServer:
    """`livespeech serve` on 127.0.0.1 with free ports, logging to `log_path`."""

    def __init__(self, model_path: Optional[str], *, max_sessions: int, log_path: Path, device: str = "cpu",
                 torch_threads: int = 0, extra_args: tuple[str, ...] = ()) -> None:
        self.model_path = model_path
        self.max_sessions = max_sessions
        self.device = device
        self.torch_threads = torch_threads
        self.log_path = Path(log_path)
        self.extra_args = tuple(extra_args)
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0
        self.metrics_port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "livespeech.client.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--metrics-port", str(self.metrics_port), "--max-sessions", str(self.max_sessions),
               "--device", self.device, "--voices-dir", "", "--drain-grace-s", "2"]
        if self.model_path:
            cmd += ["--model-path", str(self.model_path)]
        if self.torch_threads:
            cmd += ["--torch-threads", str(self.torch_threads)]
        return cmd + list(self.extra_args)

    def start(self, timeout_s: float = 300.0) -> None:
        self.port, self.metrics_port = free_ports(2)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        repo = Path(__file__).resolve().parent.parent
        env = dict(os.environ)
        env["PYTHONPATH"] = str(repo) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=str(repo), env=env,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} during startup; see {self.log_path}:\n"
                                   + self._tail())
            if READY_LINE in self.log_path.read_text(errors="replace"):
                return
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"the server did not start within {timeout_s:.0f} s; see {self.log_path}")

    def _tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def cpu_seconds(self) -> Optional[float]:
        return proc_cpu_seconds(self.pid)

    def stop(self, timeout_s: float = 15.0) -> Optional[int]:
        """SIGTERM (drain), a second SIGTERM (stop now), then SIGKILL; this process only."""
        p = self.proc
        if p is None:
            return None
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if p.poll() is not None:
                break
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                break
            try:
                p.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        self.proc = None
        return p.returncode
