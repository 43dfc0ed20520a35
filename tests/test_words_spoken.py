"""No silent loss of text, over gRPC with the real engine: a session ends completed (OK, a
summary not cancelled, counted `completed`) only when every word it received was
spoken. Every other ending says why: a cancel is a cancelled summary listing the words
not spoken; the runaway guard's end is a summary with all_words_spoken false and the
words, counted `incomplete`; the text limit, the idle timeout and the wall-clock cap
end with a summary of what was spoken and then their own status (gRPC and WebSocket).
"""
from __future__ import annotations

import dataclasses

import grpc
import pytest

from conftest import CANCEL, END, config_msg, raw_synthesize, text_msg
from test_engine import model_that_wants_to_stop, text_graphemes
from test_web import WS_HARD, of, ws_session

C = grpc.StatusCode
TEXT = "Every word of this sentence is spoken before the end."
OUTCOMES = ("completed", "cancelled", "incomplete", "failed", "disconnected", "rejected")


@pytest.fixture(scope="module")
def srv(server_factory):
    return server_factory(max_sessions=2, max_text_piece_chars=200, max_session_text_chars=200, idle_timeout_s=2.0,
                          http_port=-1)


def outcomes(h) -> dict:
    return {o: h.metrics.sessions_total.labels(outcome=o)._value.get() for o in OUTCOMES}


def run(h, requests: list, **kw):
    """The stream's result and the session outcomes it was counted under."""
    assert h.wait_idle()
    before = outcomes(h)
    r = h.run(raw_synthesize(h.stub, requests, **kw))
    assert h.wait_idle()
    after = outcomes(h)
    return r, {o: after[o] - before[o] for o in OUTCOMES if after[o] != before[o]}


def test_a_completed_session_spoke_every_word(srv) -> None:
    r, counted = run(srv, [config_msg(), *(text_msg(TEXT[i:i + 5]) for i in range(0, len(TEXT), 5)), END])
    assert r.code == C.OK and r.kinds()[-1] == "summary"
    s = r.responses[-1].summary
    assert not s.cancelled and s.all_words_spoken and list(s.unspoken_words) == [] and s.spoken_text == TEXT
    assert counted == {"completed": 1}


def test_a_cancelled_session_lists_the_words_it_did_not_speak(srv) -> None:
    async def go():
        call = srv.stub.Synthesize(timeout=30)
        await call.write(config_msg())
        await call.write(text_msg(TEXT + " and more words follow, held by the lookahead "))
        responses = []
        async for m in call:
            responses.append(m)
            if m.WhichOneof("response") == "audio" and len(responses) == 2:
                await call.write(CANCEL)
                await call.done_writing()
        return responses, await call.code()

    assert srv.wait_idle()
    before = outcomes(srv)
    responses, code = srv.run(go())
    assert srv.wait_idle()
    s = responses[-1].summary
    sent = (TEXT + " and more words follow, held by the lookahead").split()
    assert code == C.OK and s.cancelled and not s.all_words_spoken
    # the words not spoken are the text's last ones (a word cut off mid-way is also in spoken_text)
    unspoken = list(s.unspoken_words)
    assert unspoken and unspoken == sent[len(sent) - len(unspoken):]
    assert len(s.spoken_text.split()) + len(unspoken) in (len(sent), len(sent) + 1)
    assert outcomes(srv)["cancelled"] == before["cancelled"] + 1
    assert outcomes(srv)["completed"] == before["completed"]


def test_the_runaway_guard_is_not_a_completed_session(srv, monkeypatch) -> None:
    """A model that speaks the first word and stalls: the guard ends it with status OK and
    a summary listing the words never spoken, counted `incomplete`, not `completed`."""
    engine = srv.engine
    words = TEXT.split()

    class OnlySession:  # the one session on the engine, for the model below
        def __getitem__(self, i):
            return next(iter(engine._sessions.values()))

    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, max_overrun_s=0.2))
    model_that_wants_to_stop(engine, OnlySession(), TEXT, monkeypatch, stall_at=len(text_graphemes(words[0])))
    r, counted = run(srv, [config_msg(guidance_lambda=1.0), text_msg(TEXT), END])
    assert r.code == C.OK and len(r.summaries()) == 1
    s = r.summaries()[0]
    assert not s.cancelled and s.HasField("all_words_spoken") and not s.all_words_spoken
    assert list(s.unspoken_words) == words[1:] and s.spoken_text == words[0]
    assert counted == {"incomplete": 1}


# Early endings. The text ends in a word still being written, and no buffer delay releases
# it: that word is never spoken, so every case has words unspoken.
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike".split()
EARLY = {  # case: (text accepted, the status, what its message says)
    "text_limit": (" ".join(WORDS) + " novemb", C.RESOURCE_EXHAUSTED, "max_session_text_chars"),
    "idle": ("Hello there wor", C.DEADLINE_EXCEEDED, "session idle for 2 s"),
    "wall_cap": ("Hello there wor", C.DEADLINE_EXCEEDED, "session open for 0.5 s (max_session_wall_s)"),
    # any client error after the start: here a timestamp that goes back
    "bad_timestamp": ("Hello there wor", C.INVALID_ARGUMENT, "must not decrease"),
}
OVER = "x" * 150  # a piece the text limit refuses after the text accepted
FIRST_TS = {"bad_timestamp": 5.0}  # the accepted text's timestamp
FOLLOW = {"text_limit": (OVER, None), "bad_timestamp": ("more ", 1.0)}  # the piece refused, its timestamp


def early_ending(srv, monkeypatch, case: str) -> tuple:
    """(the text accepted, the status, its message) of an early ending; the wall cap set."""
    if case == "wall_cap":
        monkeypatch.setattr(srv.app.service, "config", srv.app.service.config.replace(max_session_wall_s=0.5))
    return EARLY[case]


def check_summary(s: dict, text: str) -> None:
    """What an early ending's summary must say: not cancelled, words unspoken (the text's
    last ones, the word still being written among them), with the spoken ones the text."""
    words = text.split()
    assert not s["cancelled"] and s["all_words_spoken"] is False, s
    unspoken = list(s["unspoken_words"])
    assert unspoken and unspoken[-1] == words[-1] and unspoken == words[len(words) - len(unspoken):], s
    assert len(s["spoken_text"].split()) + len(unspoken) in (len(words), len(words) + 1), s  # a word cut mid-way is in both


@pytest.mark.parametrize("case", list(EARLY))
def test_early_endings_say_what_was_spoken_then_why(srv, monkeypatch, case) -> None:
    """gRPC: the summary (which words were spoken), then the status naming the limit."""
    text, code, says = early_ending(srv, monkeypatch, case)
    requests = [config_msg(max_buffer_delay_ms=0), text_msg(text, FIRST_TS.get(case))]
    if case in FOLLOW:
        requests += [text_msg(*FOLLOW[case]), END]
    r, counted = run(srv, requests, half_close=case in FOLLOW)
    assert (r.code, says in r.details) == (code, True), (r.code, r.details)
    assert len(r.summaries()) == 1 and r.kinds()[-1] == "summary", r.kinds()  # the status follows the summary
    s = r.summaries()[0]
    assert s.HasField("all_words_spoken")
    check_summary(dict(cancelled=s.cancelled, all_words_spoken=s.all_words_spoken,
                       unspoken_words=list(s.unspoken_words), spoken_text=s.spoken_text), text)
    assert counted == {"failed": 1}


@pytest.mark.parametrize("case", list(EARLY))
def test_early_endings_over_websocket_say_what_was_spoken_then_why(srv, monkeypatch, case) -> None:
    """WebSocket: the summary event, then the error event and the close code."""
    text, code, says = early_ending(srv, monkeypatch, case)
    ts = lambda t: {} if t is None else {"timestamp_s": t}  # noqa: E731
    messages = [{"type": "config", "config": {"max_buffer_delay_ms": 0, **WS_HARD}},
                {"type": "text", "text": text, **ts(FIRST_TS.get(case))}]
    if case in FOLLOW:
        piece, t = FOLLOW[case]
        messages += [{"type": "text", "text": piece, **ts(t)}, {"type": "end"}]
    assert srv.wait_idle()
    before = outcomes(srv)
    r = srv.run(ws_session(srv, messages))
    assert srv.wait_idle()
    events = r["events"]
    assert [e["type"] for e in events[-2:]] == ["summary", "error"] and len(of(events, "summary")) == 1, events
    error = events[-1]
    assert (error["code"], says in error["message"]) == (code.name, True), error
    assert r["code"] == {C.RESOURCE_EXHAUSTED: 4429, C.DEADLINE_EXCEEDED: 4504, C.INVALID_ARGUMENT: 4400}[code]
    check_summary(events[-2], text)
    assert outcomes(srv)["failed"] == before["failed"] + 1
