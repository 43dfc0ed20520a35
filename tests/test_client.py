"""The async client's own behaviour, against a stand-in for grpc's call object."""
from __future__ import annotations

import asyncio

from clients.client import SynthesisStream
from server.protocol import pb


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
