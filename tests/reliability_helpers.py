"""Helpers for the reliability/security tests (test_fuzz, test_faults, test_overload,
test_soak, test_security): a client event loop of its own, leak checks, /proc figures,
and `record` for the figures quoted in docs/reliability.md.

The clients run on their own loop thread, not on the server's: what the server's loop
holds (tasks) is then the server's alone, and a client that stops reading cannot stall
the server's loop by accident.
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]


class ClientLoop:
    """An asyncio loop on a daemon thread; `run(coro)` waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-client", daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            self.run(cancel_rest(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)


# ---------------------------------------------------------------- server state


def server_tasks(h: Any) -> int:
    """Tasks on the server's loop (not counting the one asking)."""

    async def count() -> int:
        return len(asyncio.all_tasks()) - 1

    return h.run(count())


def engine_state(h: Any) -> dict[str, Any]:
    e = h.engine
    free = getattr(e, "_free_slots", None)
    thread = getattr(e, "_thread", None)
    return dict(
        active=e.active_sessions,
        in_flight=h.app.service.in_flight,
        free_slots=len(free) if free is not None else e.capacity - e.active_sessions,
        capacity=e.capacity,
        engine_alive=thread is not None and thread.is_alive(),
    )


def leaks(h: Any, baseline_tasks: int, timeout: float = 10.0) -> dict[str, Any]:
    """{} once the server is back to rest (no session, every slot free, no task beyond
    the baseline) within `timeout`; else what is still held."""
    deadline = time.monotonic() + timeout
    while True:
        st = engine_state(h)
        tasks = server_tasks(h)
        left = {}
        if st["active"] or st["in_flight"]:
            left.update(active=st["active"], in_flight=st["in_flight"])
        if st["free_slots"] != st["capacity"]:
            left["free_slots"] = st["free_slots"]
        if tasks > baseline_tasks:
            left["tasks"] = f"{tasks} > {baseline_tasks}"
        if not st["engine_alive"]:
            left["engine_alive"] = False
            return left
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


# ---------------------------------------------------------------- /proc


def proc_stats(pid: Any = "self") -> dict[str, int]:
    """Resident memory (kB), open file descriptors and threads of a process (Linux)."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return dict(
        rss_kb=int(fields["VmRSS"].split()[0]),
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        threads=int(fields["Threads"]),
    )


# ---------------------------------------------------------------- figures


def record(name: str, figures: dict[str, Any]) -> None:
    """Print the figures (`pytest -s` or `-rP` shows them); also write them to
    $LIVESPEECH_RELIABILITY_OUT/<name>.json when that is set."""
    print(f"\nRELIABILITY {name}: {json.dumps(figures, sort_keys=True)}")
    out: Optional[str] = os.environ.get("LIVESPEECH_RELIABILITY_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
