"""The async client's own behaviour, against a stand-in for grpc's call object."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from livespeech.client.client import SynthesisSession, SynthesisStream
from livespeech.api.protocol import pb
from livespeech.api.session import Summary


class GrpcLikeCall:
    """Stands in for a grpc.aio stream-stream call, with the one trait that matters here:
    a task cancelled inside `write` cancels the whole call (grpc/aio/_call.py `_write`).
    Text writes wait for `gate`, so a test can hold one in flight."""

    def __init__(self) -> None:
        self.writes: list[str] = []
        self.call_cancelled = False
        self.half_closed = False
        self.gate = asyncio.Event()
        self.writing = asyncio.Event()

    async def write(self, msg: pb.SynthesizeRequest) -> None:
        kind = msg.WhichOneof("request")
        self.writes.append(kind)
        if kind == "text":
            self.writing.set()
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cancel()
                raise

    async def done_writing(self) -> None:
        self.half_closed = True

    def done(self) -> bool:
        return self.call_cancelled

    def cancel(self) -> None:
        self.call_cancelled = True

    async def read(self) -> None:
        await asyncio.Event().wait()  # no reply in this test


class OneCallStub:
    def __init__(self, call: GrpcLikeCall) -> None:
        self.call = call

    def Synthesize(self, timeout=None, metadata=None) -> GrpcLikeCall:
        return self.call


def test_barge_in_during_a_text_write_does_not_cancel_the_call() -> None:
    async def go() -> GrpcLikeCall:
        call = GrpcLikeCall()
        stream = SynthesisStream(OneCallStub(call), pb.SynthesizeConfig(), ["hello ", "world "], None)
        reader = asyncio.create_task(stream.__anext__())  # starts the text pump
        await call.writing.wait()  # the pump is inside write("hello ")
        barge_in = asyncio.create_task(stream.cancel())
        await asyncio.sleep(0.01)
        call.gate.set()
        await barge_in
        reader.cancel()
        return call

    call = asyncio.run(go())
    assert not call.call_cancelled  # the server gets its Cancel and answers with a summary
    assert call.writes == ["config", "text", "cancel"] and call.half_closed


class ScriptedCall(GrpcLikeCall):
    """Answers with `replies`, then ends with `error`."""

    def __init__(self, replies: list, error: grpc.aio.AioRpcError) -> None:
        super().__init__()
        self.gate.set()
        self.replies, self.error = list(replies), error

    async def read(self):
        if self.replies:
            return self.replies.pop(0)
        raise self.error


def test_an_early_ending_carries_its_summary() -> None:
    """A server that ends a session over its text limit (or a deadline) sends the summary,
    then the status: the iteration yields the Summary, the error raised after it carries
    it (`error.summary`), and collect() attaches what it received (`error.result`)."""
    summary = pb.SessionSummary(frames=30, audio_s=0.4, spoken_text="one two", all_words_spoken=False,
                                unspoken_words=["three", "four"])
    error = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                 "text: session total is over max_session_text_chars=200")
    replies = [pb.SynthesizeResponse(started=pb.Started(session_id="s1", config=pb.SynthesizeConfig())),
               pb.SynthesizeResponse(audio=pb.AudioPacket(seq=0, data=b"\0\0" * 80, duration_s=0.00333)),
               pb.SynthesizeResponse(summary=summary)]

    async def go():
        session = SynthesisSession(OneCallStub(ScriptedCall(replies, error)), pb.SynthesizeConfig())
        events = []
        with pytest.raises(grpc.aio.AioRpcError) as iterated:
            async for ev in session:
                events.append(ev)
        stream = SynthesisStream(OneCallStub(ScriptedCall(replies, error)), pb.SynthesizeConfig(), ["one two three four"],
                                 None)
        with pytest.raises(grpc.aio.AioRpcError) as collected:
            await stream.collect()
        return events, iterated.value, collected.value

    events, iterated, collected = asyncio.run(go())
    assert isinstance(events[-1], Summary) and events[-1].unspoken_words == ("three", "four")
    assert iterated.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_session_text_chars" in iterated.details()
    assert iterated.summary == events[-1] and not iterated.summary.all_words_spoken
    assert collected.summary.spoken_text == "one two" and collected.summary.unspoken_words == ("three", "four")
    assert collected.result.summary == collected.summary and collected.result.audio == b"\0\0" * 80
    assert collected.result.started is not None and collected.result.started.session_id == "s1"
