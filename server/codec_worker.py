"""The codec calls of a step's packets: on the engine thread at once, or queued on a codec
thread beside the next model steps, and each call's result handed back to the engine
(`deliver`) in submission order.

The engine thread holds `CodecWorker.lock` for all its work on sessions but the model
step (`may_deliver`); during that step the codec thread delivers the calls it finishes
(`_on_done`).
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, NamedTuple, Optional

import numpy as np

from .packets import PacketPlan
from .session_table import SessionTable


class InFlightDecode(NamedTuple):
    """One codec call: its result ((wavs, seconds) or an exception), and for whom."""
    future: Future
    planned: list  # (session, short) per row
    frames: int

    def holds(self, slots: set) -> bool:
        return any(s.slot in slots for s, _ in self.planned)


def _timed(decode, slots, frames):
    t0 = time.perf_counter()
    wavs = decode(slots, frames)
    return wavs, time.perf_counter() - t0


class CodecWorker:
    def __init__(self, runner, table: SessionTable, deliver: Callable[[InFlightDecode], None],
                 low_water_s: Callable[[], float], threaded: bool):
        self._runner = runner  # its `decode` is looked up at each call
        self._table = table  # the sessions' pending frames and listeners' audio, a row a slot
        self._deliver = deliver  # called under `lock`, on either thread
        self._low_water_s = low_water_s
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="livespeech-codec") if threaded else None
        # calls on the codec thread, in submission order (the thread runs them in that order)
        self.in_flight: collections.deque[InFlightDecode] = collections.deque()
        self.lock = threading.Lock()

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def decode(self, due: list[tuple[object, PacketPlan]]) -> None:
        """Decode each session's planned packet: one batched codec call per distinct
        frame count (usually one: see `PacketPolicy.on_clock`). Calls go to the codec
        thread, overlapping the next model steps (delivered as they finish, `_on_done`),
        except those `_decode_here` keeps (a session's first or last packet; a ramp
        packet that cannot wait for a busy codec thread): those are decoded and
        delivered now, beside whatever the codec thread runs. Ramp packets otherwise go
        to the thread: on the engine thread each cost the engine a codec call, and its
        2-frame packets came about as fast as they played (docs/loadtest.md, "Measured
        choices"). The thread's calls queue in order, the most urgent (least audio in its
        listeners' hands) first; the engine waits only for calls holding a slot whose
        codec state it is about to use. Waiting for every call
        before the next cost a ramp packet queued behind a clocked call that whole call,
        at 16 sessions up to 9 ms of its listener's 27 (docs/loadtest.md, "Measured
        choices"); and waiting with nothing new to decode cost the step after each
        threaded call the rest of that call (~3.5 ms of a 5.5 ms step at one session)."""
        self.deliver_done()
        # one call per frame count, with packets off the clock (the ramp, a text that ran
        # dry) apart from the tick's: joined to it, a ramp packet waited for all of it
        # (16 sessions: 15-19 ms of the ~20 its listener held; docs/loadtest.md)
        # and first packets apart from all others: joined to another session's packet, a
        # first packet waited for any codec-thread call holding that session's slot
        groups: dict[tuple[int, bool, bool], list[tuple[object, bool]]] = collections.defaultdict(list)
        for s, plan in due:  # (a clocked packet is never a session's first)
            groups[plan.frames, plan.clocked, not plan.clocked and s.frames_done == 0].append((s, plan.short))
        # (threaded, urgency, n, planned, slots): the engine thread's calls first, then the least audio in hand
        calls = []
        now = time.monotonic()
        for (n, clocked, _), planned in groups.items():
            slots = np.fromiter((s.slot for s, _ in planned), np.int64, len(planned))
            in_hand = float(self._table.audio_ahead_s(slots, now).min())
            calls.append((not self._decode_here(slots, clocked, in_hand), in_hand, n, planned, slots))
        for threaded, _, n, planned, slots in sorted(calls, key=lambda c: c[:2]):
            if not threaded:  # an earlier call's audio for these sessions goes out first
                self.settle(set(slots.tolist()))
            # taken now: the next step's packet plans must not see them
            frames = self._table.take_frames(slots, n)
            call = (self._runner.decode, slots.tolist(), frames)
            if threaded:
                future = self.pool.submit(_timed, *call)
                self.in_flight.append(InFlightDecode(future, planned, n))
                future.add_done_callback(self._on_done)
                continue
            future: Future = Future()
            try:
                future.set_result(_timed(*call))
            except Exception as exc:
                future.set_exception(exc)
            self._deliver(InFlightDecode(future, planned, n))

    def _decode_here(self, slots: np.ndarray, clocked: bool, in_hand: float) -> bool:
        """Whether a codec call runs on the engine thread, at once: with no codec thread;
        with a session's first packet (its TTFA) or its last (its end follows); and off
        the clock, when its listeners hold less than the low water while the codec thread
        is still busy with calls of other sessions. Queued behind those (up to a clocked
        call of 16 sessions), a 2-frame second packet was the last of the stalls at 16-20
        sessions; at once it costs the engine ~2 ms, a few times per session start."""
        t = self._table
        if self.pool is None or (t.frames_done[slots] == 0).any() or t.done_decoding[slots].any():
            return True
        if clocked or in_hand >= self._low_water_s():
            return False
        held = set(slots.tolist())
        # a call holding one of these sessions would have to be waited for first
        return (any(not c.future.done() for c in self.in_flight)
                and not any(c.holds(held) for c in self.in_flight))

    def deliver_done(self, on_codec_thread: bool = False) -> None:
        """Deliver the codec thread's finished calls, in order, without waiting. On the
        codec thread, not a call that may end a session: the engine's ending waits for
        calls (`settle`)."""
        while self.in_flight and self.in_flight[0].future.done():
            if on_codec_thread and any(s.done_decoding for s, _ in self.in_flight[0].planned):
                return
            self._deliver(self.in_flight.popleft())

    def _on_done(self, _future: Future) -> None:
        """As the codec thread finishes a call: if the engine thread is in its model step,
        deliver the call's audio now, not after that step (up to a step later: at 16
        sessions a step is ~a third of a 2-frame ramp packet's 27 ms). Otherwise the
        engine thread delivers it before its next step."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            self.deliver_done(on_codec_thread=True)
        finally:
            self.lock.release()

    @contextlib.contextmanager
    def may_deliver(self):
        """Tensor work that touches no session state: the codec thread may deliver meanwhile."""
        self.lock.release()
        try:
            yield
        finally:
            self.lock.acquire()

    def settle(self, slots: Optional[set] = None) -> None:
        """Deliver the codec thread's calls in order, waiting for them: all of them, or
        up to the last one holding one of `slots`."""
        held = [c for c in self.in_flight if slots is None or c.holds(slots)]
        while held and any(c is held[-1] for c in self.in_flight):  # a delivery may settle others
            self._deliver(self.in_flight.popleft())
