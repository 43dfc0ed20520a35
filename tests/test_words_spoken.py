"""No silent loss of text, over gRPC with the real engine: a session ends completed (OK, a
summary not cancelled, counted `completed`) only when every word it received was
spoken. Every other ending says why: a cancel is a cancelled summary listing the words
not spoken; the runaway guard's end is a summary with all_words_spoken false and the
words, counted `incomplete`; the text limit, the idle timeout and the wall-clock cap
are their own statuses, with no summary that could pass for a completed session.
"""
from __future__ import annotations

import dataclasses

import grpc
import pytest

from conftest import CANCEL, END, config_msg, raw_synthesize, text_msg
from test_engine import model_that_wants_to_stop, text_graphemes

C = grpc.StatusCode
TEXT = "Every word of this sentence is spoken before the end."
OUTCOMES = ("completed", "cancelled", "incomplete", "failed", "disconnected", "rejected")


@pytest.fixture(scope="module")
def srv(server_factory):
    return server_factory(max_sessions=2, max_text_piece_chars=200, max_session_text_chars=200, idle_timeout_s=2.0)


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


def summaries(r) -> list:
    return [m.summary for m in r.responses if m.WhichOneof("response") == "summary"]


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
    assert r.code == C.OK and len(summaries(r)) == 1
    s = summaries(r)[0]
    assert not s.cancelled and s.HasField("all_words_spoken") and not s.all_words_spoken
    assert list(s.unspoken_words) == words[1:] and s.spoken_text == words[0]
    assert counted == {"incomplete": 1}


@pytest.mark.parametrize("case", ["text_limit", "idle", "wall_cap"])
def test_other_endings_are_statuses_that_say_why(srv, monkeypatch, case) -> None:
    """No summary: nothing that reads as a completed session; the status names the limit."""
    if case == "text_limit":
        requests, expect = [config_msg(), text_msg("word " * 30), text_msg("word " * 20), END], (
            C.RESOURCE_EXHAUSTED, "max_session_text_chars")
    elif case == "idle":  # text with no end, then nothing
        requests, expect = [config_msg(), text_msg("Hello there ")], (C.DEADLINE_EXCEEDED, "idle")
    else:
        monkeypatch.setattr(srv.app.service, "config", srv.app.service.config.replace(max_session_wall_s=0.5))
        requests, expect = [config_msg(), text_msg("Hello there ")], (C.DEADLINE_EXCEEDED, "max_session_wall_s")
    r, counted = run(srv, requests, half_close=case == "text_limit")
    assert (r.code, expect[1] in r.details) == (expect[0], True), (r.code, r.details)
    assert not summaries(r)
    assert counted == {"failed": 1}
