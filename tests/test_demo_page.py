"""The demo page (server/static/demo.html, served at / by server/web.py) in a real headless
Chromium against a running server: the text streams in at an LLM's pace, the audio
arrives and is scheduled into Web Audio, and every word is highlighted, in order, no
earlier than its timestamp. Skips where Chromium is not installed (.ci/run installs it)."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from chromium import Chromium, executable
from test_web import TEXT, WS_HARD, url

pytestmark = pytest.mark.skipif(executable() is None, reason="chromium is not installed (apt-get install chromium)")

STATS = "window.demoStats"


@pytest.fixture(scope="module")
def srv(server_factory):
    h = server_factory(http_port=-1, max_sessions=2)
    noise = (np.random.default_rng(1).standard_normal(24000) * 0.1).astype(np.float32)
    h.run(h.app.voices.register("alice", noise))
    return h


async def speak(page, text: str, mode: str = "llm", rate: int = 40, voice: str = "default") -> None:
    # the voice list comes from GET /v1/voices
    await page.wait_for(f"[...document.querySelectorAll('#voice option')].some(o => o.value === {json.dumps(voice)})",
                        timeout=10)
    await page.evaluate(f"""(() => {{
        document.getElementById('text').value = {json.dumps(text)};
        document.getElementById('settings').value = {json.dumps(json.dumps(WS_HARD))};
        document.getElementById('mode').value = {json.dumps(mode)};
        document.getElementById('rate').value = {rate};
        document.getElementById('voice').value = {json.dumps(voice)};
        document.getElementById('speak').click();
    }})()""")


async def finished(page, timeout: float = 25.0) -> dict:
    await page.wait_for(f"['done', 'error'].includes({STATS}.state)", timeout=timeout)
    return await page.evaluate(STATS)


SLOW_RATE = 2  # text pieces a second: slower than speech, so the audio runs out between words


@pytest.mark.parametrize("mode, rate", [("llm", 40), ("all", 40), ("llm", SLOW_RATE)], ids=["llm", "all", "slow-llm"])
def test_the_page_plays_a_streamed_sentence_and_highlights_each_word(srv, mode, rate) -> None:
    async def go():
        async with Chromium.launch() as browser:
            page = await browser.open(url(srv, "/"))
            await speak(page, TEXT, mode, rate)
            stats = await finished(page)
            dom = await page.evaluate("""(() => ({
                words: [...document.querySelectorAll('#transcript .word')].map(s => s.textContent),
                spoken: document.querySelectorAll('#transcript .word.spoken').length,
                current: document.querySelectorAll('#transcript .word.current').length,
                sent: document.getElementById('sent').textContent,
                ttfa: document.getElementById('ttfa').textContent,
                serverTtfa: document.getElementById('server-ttfa').textContent,
                state: document.body.dataset.state,
            }))()""")
            return stats, dom, browser.console

    stats, dom, console = asyncio.run(go())
    assert stats["state"] == "done" and stats["error"] is None, (stats, console)
    assert stats["closeCode"] == 1000 and dom["state"] == "done"
    if rate == SLOW_RATE:
        assert stats["underruns"] > 0, stats
    summary = stats["summary"]
    assert summary["spoken_text"] == TEXT and summary["all_words_spoken"] and not summary["cancelled"]
    assert dom["sent"] == TEXT  # every piece was sent
    # the audio: every byte received went into Web Audio, as much as the server made
    assert stats["packets"] > 1 and stats["bytes"] == 2 * stats["samplesScheduled"]
    assert stats["samplesScheduled"] / 24000 == pytest.approx(summary["audio_s"], abs=1e-3)
    # the words: shown as timed, all highlighted, in order, none before its timestamp
    assert dom["words"] == TEXT.split() and dom["spoken"] == len(dom["words"]) and dom["current"] == 0
    assert [h["word"] for h in stats["highlights"]] == TEXT.split()
    assert all(h["at_s"] >= h["start_s"] for h in stats["highlights"])
    # the audio clock of the highlights moves forward only, underruns or not
    assert [h["at_s"] for h in stats["highlights"]] == sorted(h["at_s"] for h in stats["highlights"])
    assert stats["ttfaMs"] > 0 and dom["ttfa"].endswith(" ms") and dom["serverTtfa"].endswith(" ms")
    assert not [c for c in console if c.startswith(("error", "exception"))], console
    assert srv.wait_idle()


def test_stop_cancels_mid_sentence_in_the_picked_voice(srv) -> None:
    text = " ".join(f"word{i}" for i in range(200))

    async def go():
        async with Chromium.launch() as browser:
            page = await browser.open(url(srv, "/"))
            await speak(page, text, rate=100, voice="alice")
            # stop while words the server has timed are still to play: once a word has played,
            # the audio clock is held (as a busy audio device would) so the server's timed words
            # get ahead of it however slowly this machine makes them
            await page.wait_for(f"{STATS}.highlighted >= 1", timeout=20)
            await page.evaluate("ctx.suspend()")
            await page.wait_for(f"{STATS}.words >= {STATS}.highlighted + 3", timeout=20)
            scheduled = await page.evaluate(f"(() => {{ document.getElementById('stop').click(); return {STATS}.samplesScheduled; }})()")
            stats = await finished(page)
            words = await page.evaluate("""[...document.querySelectorAll('#transcript .word')].map(
                s => ({start_s: Number(s.dataset.start), spoken: s.classList.contains('spoken')}))""")
            return stats, words, scheduled, browser.console

    stats, words, scheduled, console = asyncio.run(go())
    assert stats["state"] == "done" and stats["error"] is None, (stats, console)
    assert stats["config"]["voice_id"] == "alice"
    summary = stats["summary"]
    assert summary["cancelled"] and "word199" not in summary["spoken_text"]
    assert stats["samplesScheduled"] == scheduled  # no audio after Stop
    # the words up to the point the audio stopped are highlighted, none after it
    assert len(words) == stats["words"] < 200 and stats["stoppedAt"] is not None
    assert [w["spoken"] for w in words] == [w["start_s"] <= stats["stoppedAt"] for w in words]
    assert words[0]["spoken"] and not words[-1]["spoken"]
    assert all(h["start_s"] <= h["at_s"] <= stats["stoppedAt"] for h in stats["highlights"])
    assert srv.wait_idle()
