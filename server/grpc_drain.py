"""grpc.aio workarounds for ending a bidirectional stream early (used by the servicer,
server/service.py, and the auth interceptor, server/auth.py): read on until the status
is safe to send, and tell a half-close from a cancel."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

# Ending a stream early (refused, failed, or done before the client half-closed): its
# status must not overtake a client write in flight, or grpc's asyncio client reports
# INTERNAL "Internal error from Core" instead (it overwrites the status it received when
# a later write fails: grpc/grpc#36066, fixed upstream by grpc/grpc#43486, unreleased).
# So the server first reads on (`drain`): until the client half-closes; or, after
# REFUSE_READ_S, right after a message that came at least MIN_GAP_S after the one before
# (a paced client, e.g. an LLM token stream, is then a pacing gap away from its next
# write); or once none came for QUIET_S (an idle client has no write in flight); and
# never longer than REFUSE_MAX_S (a client writing flat out until it reads the status
# can still meet the bug).
REFUSE_READ_S = 0.25
QUIET_S = 0.15
MIN_GAP_S = 0.02
REFUSE_MAX_S = 2.0
# grpc's asyncio server ends the request iterator the same way for a half-close and for a
# client's cancel (or a closed connection), and a cancel drops the messages not read yet:
# taken at its word, a cancel right after "config, text" reads as "config, end of input"
# and the session completes with nothing said. So a stream end is acted on only after
# this pause, and a cancel ends the stream first (`confirm_half_close`). The cancel
# usually follows within a millisecond, but it is delivered by grpc's poller thread, so a
# CPU-bound process (the engine thread, other sessions) delays it by GIL switch intervals:
# 4 of 88 later than 5 ms, and up to 21 ms, with two cores shared by four CPU burners
# (docs/reliability.md).
HALF_CLOSE_S = 0.05


async def confirm_half_close() -> None:
    """Called when the request iterator ends without `end_of_input`: returns if that was
    a half-close; raises CancelledError (the handler's cancel reaches this task through
    `_Stream.close()`) if it was the client going away."""
    await asyncio.sleep(HALF_CLOSE_S)


async def drain(next_message: Callable[[], Awaitable[Any]], limit_s: float = REFUSE_READ_S) -> None:
    """Take client messages until it is safe to send the status (see REFUSE_READ_S).
    `next_message()` waits for the next one; it raises StopAsyncIteration at half-close."""
    loop = asyncio.get_running_loop()
    start = last = loop.time()
    deadline = start + limit_s
    try:
        while True:
            now = loop.time()
            wait = min(max(deadline - now, 0.0) + QUIET_S, start + REFUSE_MAX_S - now)
            if wait <= 0:
                return
            async with asyncio.timeout(wait):
                await next_message()
            now = loop.time()
            gap, last = now - last, now
            if now >= deadline and gap >= MIN_GAP_S:
                return
    except Exception:  # StopAsyncIteration (half-close), TimeoutError, or the client went away
        return


async def drain_requests(it: AsyncIterator) -> None:
    """`drain`, reading and dropping the messages of `it` (left unusable on a timeout)."""
    await drain(it.__anext__)
