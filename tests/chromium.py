"""A headless Chromium driven over the Chrome DevTools Protocol (CDP), for the browser
tests: a temporary profile, the DevTools WebSocket (aiohttp's client), one page.

    async with Chromium.launch() as browser:
        page = await browser.open("http://127.0.0.1:8080/")
        title = await page.evaluate("document.title")
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Optional

import aiohttp

# audio plays without a click; no GPU or sandbox in a container
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
         "--autoplay-policy=no-user-gesture-required", "--mute-audio", "--remote-debugging-port=0")


def executable() -> Optional[str]:
    """Chromium's path ($LIVESPEECH_CHROMIUM, else chromium or chromium-browser on PATH)."""
    return os.environ.get("LIVESPEECH_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


class CDPError(Exception):
    pass


class Page:
    """One tab, attached to the browser's connection by its CDP session id."""

    def __init__(self, browser: "Chromium", session_id: str) -> None:
        self.browser = browser
        self.session_id = session_id

    async def send(self, method: str, params: Optional[dict] = None) -> dict:
        return await self.browser.send(method, params, self.session_id)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (awaited if a promise), as JSON gives it back."""
        r = await self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True})
        if "exceptionDetails" in r:
            raise CDPError(r["exceptionDetails"].get("exception", {}).get("description") or r["exceptionDetails"]["text"])
        return r["result"].get("value")

    async def wait_for(self, expression: str, timeout: float, poll: float = 0.05) -> Any:
        """Poll until the expression is truthy; its value, or TimeoutError."""
        async with asyncio.timeout(timeout):
            while not (value := await self.evaluate(expression)):
                await asyncio.sleep(poll)
        return value

    async def screenshot(self, path: Path) -> None:
        r = await self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(r["data"]))


class Chromium:
    def __init__(self, proc: subprocess.Popen, profile: str, ws: aiohttp.ClientWebSocketResponse,
                 http: aiohttp.ClientSession) -> None:
        self.proc = proc
        self.profile = profile
        self.ws = ws
        self.http = http
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.console: list[str] = []  # console messages and uncaught exceptions of the pages
        self.reader = asyncio.create_task(self._read())

    @classmethod
    def launch(cls, width: int = 1000, height: int = 800, timeout: float = 15.0) -> "_Launch":
        return _Launch(width, height, timeout)

    async def send(self, method: str, params: Optional[dict] = None, session_id: Optional[str] = None) -> dict:
        msg_id = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[msg_id] = fut
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session_id is not None:
            msg["sessionId"] = session_id
        await self.ws.send_json(msg)
        reply = await fut
        if "error" in reply:
            raise CDPError(f"{method}: {reply['error'].get('message')}")
        return reply.get("result", {})

    async def open(self, url: str) -> Page:
        """A new tab with `url`, loaded (its load event fired)."""
        target = await self.send("Target.createTarget", {"url": "about:blank"})
        attached = await self.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})
        page = Page(self, attached["sessionId"])
        await page.send("Runtime.enable")
        await page.send("Page.enable")
        await page.send("Page.navigate", {"url": url})
        await page.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'", timeout=10)
        return page

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(msg.data)
            if "id" in data:
                fut = self.pending.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
            elif data.get("method") == "Runtime.consoleAPICalled":
                args = data["params"]["args"]
                self.console.append(data["params"]["type"] + ": " + " ".join(str(a.get("value", a.get("description"))) for a in args))
            elif data.get("method") == "Runtime.exceptionThrown":
                details = data["params"]["exceptionDetails"]
                self.console.append("exception: " + (details.get("exception", {}).get("description") or details["text"]))
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(CDPError("the browser closed its DevTools connection"))

    async def close(self) -> None:
        self.reader.cancel()
        await self.ws.close()
        await self.http.close()
        self.proc.terminate()
        try:
            await asyncio.to_thread(self.proc.wait, 10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)
        shutil.rmtree(self.profile, ignore_errors=True)


class _Launch:
    """`async with Chromium.launch(...) as browser`: starts it, and always stops it."""

    def __init__(self, width: int, height: int, timeout: float) -> None:
        self.width, self.height, self.timeout = width, height, timeout
        self.browser: Optional[Chromium] = None

    async def __aenter__(self) -> Chromium:
        exe = executable()
        if exe is None:
            raise FileNotFoundError("no chromium on PATH")
        profile = tempfile.mkdtemp(prefix="livespeech-chromium-")
        log = open(Path(profile) / "stderr.log", "wb")
        proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", f"--window-size={self.width},{self.height}",
                                 "about:blank"], stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        try:
            # Chromium writes its DevTools port and path here once it listens
            port_file = Path(profile) / "DevToolsActivePort"
            async with asyncio.timeout(self.timeout):
                while not (port_file.exists() and len(port_file.read_text().split()) == 2):
                    if proc.poll() is not None:
                        raise RuntimeError(f"chromium exited ({proc.returncode}): "
                                           + (Path(profile) / "stderr.log").read_text(errors="replace")[-2000:])
                    await asyncio.sleep(0.05)
            port, path = port_file.read_text().split()
            http = aiohttp.ClientSession()
            try:
                ws = await http.ws_connect(f"ws://127.0.0.1:{port}{path}", max_msg_size=0)
            except BaseException:
                await http.close()
                raise
        except BaseException:
            proc.kill()
            proc.wait()
            shutil.rmtree(profile, ignore_errors=True)
            raise
        self.browser = Chromium(proc, profile, ws, http)
        return self.browser

    async def __aexit__(self, *exc: Any) -> None:
        if self.browser is not None:
            await self.browser.close()
