"""The decode engine: one thread, one step loop, all ready sessions in one batch.

Each iteration: apply queued session commands (text, end, cancel, close), release
timed-out text chunks, ask the scheduler which sessions run, run one batched decode
step through the model runner, then batch the codec decode of sessions with a packet's
worth of frames and hand encoded packets to each session's sink. Sessions join and
leave between steps (continuous batching). The asyncio loop never runs tensor work.
Which packets are due is the packet policy's (server/packets.py); on the CPU a codec
thread decodes most packets beside the next steps and, while the engine thread is inside
a model step, sends their audio itself (server/codec_worker.py).
"""
from __future__ import annotations

import collections
import gc
import logging
import threading
import time
from typing import Callable, Optional

import numpy as np

from livespeech.api.audio import pcm16_to_float
from livespeech.api.session import CapacityError, Failed, Finished, SessionConfig, Sink, Summary
from livespeech.models.front_end import LetterSchedule
from livespeech.models.loading import ModelBundle
from livespeech.models.spoken_form import MAX_EXPANSION

from .audio import MODEL_SAMPLE_RATE
from .codec_worker import CodecWorker, InFlightDecode
from .config import EngineConfig
from .metrics import Metrics
from .packets import PacketPlan, PacketPolicy, StepClock
from .runner import ModelRunner, Voice
from .scheduler import Scheduler
from .session import EngineSession, Phase, SessionLimits, new_session_id
from .session_table import ASK, ENDED, READY, WAITING, SessionTable
from .text_memory import TextMemory
from .timeline import SpeechTimelines

log = logging.getLogger("livespeech.engine")

# spoken before a server serves (`Engine._warm_up`), each session starting as the ones
# before it speak (as many as the engine holds)
WARM_UP_TEXTS = ("Good morning, this is a short check of the voice.", "A second one starts while the first speaks.",
                 "The third voice joins a moment later.", "Then a fourth one comes along as well.",
                 "A fifth session begins after that.", "And the sixth completes the set.")
WARM_UP_STAGGER_S = 0.15
WARM_UP_TIMEOUT_S = 60.0  # a warm-up session still speaking then is cancelled


class Engine:
    def __init__(self, bundle: ModelBundle, config: EngineConfig = EngineConfig(), metrics: Optional[Metrics] = None):
        self.config = config.validate()
        self.bundle = bundle
        self.metrics = metrics or Metrics()
        self.runner = ModelRunner(bundle, config.max_sessions, cuda_graphs=config.cuda_graphs,
                                  compile_step=config.compile_step,
                                  frozen_step=config.frozen_step, native_step=config.native_step,
                                  matmul_weights=config.matmul_weights,
                                  codec_runtime=config.codec_runtime, warm_text_tokens=config.warm_text_tokens,
                                  device_guidance=config.device_guidance,
                                  # the transcript a session's text may become, said in words
                                  max_text_chars=config.max_session_text_chars * (MAX_EXPANSION if config.spoken_form
                                                                                  else 1),
                                  text_cfg_scale=config.text_cfg_scale,
                                  low_precision_from_batch=config.low_precision_from_batch)
        self.clock = StepClock()
        self.packets = PacketPolicy(self.clock, config.low_water_steps, self.runner.min_first_frames,
                                    config.first_packet_min_ms)
        # a row a slot: its session's per-step state (`EngineSession.bind_row`)
        self.table = SessionTable(config.max_sessions, bundle.model.cfg.n_acoustic_codebooks)
        self.codec = CodecWorker(self.runner, self.table, self._deliver, lambda: self.packets.low_water_s,
                                 threaded=config.codec_thread)
        self.memory = TextMemory(self.runner, bundle.tokenizer, bundle.model.cfg.max_text_tokens, self.metrics,
                                 config.spoken_form)
        self.timelines = SpeechTimelines(config.max_sessions)  # a row a slot: its session's timeline
        self.table.compile_rules(self.timelines)
        self.scheduler = Scheduler(config.max_lead_s, config.yield_lead_s)
        self._session_limits = SessionLimits(config.max_text_piece_chars, config.max_session_text_chars,
                                             config.max_session_s, config.max_overrun_s)
        self._free_slots = list(range(config.max_sessions))
        self._sessions: dict[int, EngineSession] = {}  # slot -> session
        self._slots = np.zeros(0, np.int64)  # the sessions' slots, in order
        self._commands: collections.deque = collections.deque()  # text and end of input, in order
        self._urgent: collections.deque = collections.deque()  # open, cancel, close
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._admit_lock = threading.Lock()
        self._n_active = 0
        # called with a session's id as it ends, before its last event is sunk, on the
        # engine thread or on the codec thread delivering its last audio
        # (server/engine_pool.py counts a child's free slots with it)
        self.on_session_end: Optional[Callable[[str], None]] = None

    # --- EngineAPI ---------------------------------------------------------------------------
    @property
    def active_sessions(self) -> int:
        return self._n_active

    @property
    def capacity(self) -> int:
        return self.config.max_sessions

    @property
    def session_limits(self) -> SessionLimits:
        """What a session's handle checks its input against."""
        return self._session_limits

    @property
    def builtin_voices(self) -> dict[str, np.ndarray]:
        return self.bundle.builtin_voices

    def start(self) -> None:
        """Start the engine thread; with `EngineConfig.warm_up`, return once warmed up."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="livespeech-engine", daemon=True)
            self._thread.start()
            if self.config.warm_up:
                self._warm_up()

    def _warm_up(self) -> None:
        """Speak WARM_UP_TEXTS in overlapping sessions of a built-in voice through the
        whole engine (steps at batch 1 to 6, the codec on both threads, the packet ramps
        beside each other), the audio dropped and the metrics untouched, until all ended.
        A fresh server's first sessions otherwise met these paths' first calls: on the
        2-core CPU the load test's first level (6 sessions) starved a listener over 40 ms
        in 9 of 15 fresh servers, in none of 11 warmed with two sessions, and failed in
        4 of 7 warmed with two against none of 7 with six (docs/loadtest.md, "A fresh
        server's first level")."""
        if not self.builtin_voices:
            log.info("warm-up skipped: the model has no built-in voice")
            return
        voice = self.make_voice("warm-up", next(iter(self.builtin_voices.values())), MODEL_SAMPLE_RATE)
        live, self.metrics = self.metrics, Metrics()  # not the service's traffic
        self.memory.metrics = self.metrics
        try:
            sessions, ended = [], []
            for i, text in enumerate(WARM_UP_TEXTS[: self.config.max_sessions]):
                if i:
                    time.sleep(WARM_UP_STAGGER_S)
                ended.append(threading.Event())
                sessions.append(self.open_session(SessionConfig(seed=i), voice, _on_end(ended[-1])))
                sessions[-1].push_text(text)
                sessions[-1].end_input()
            deadline = time.monotonic() + WARM_UP_TIMEOUT_S
            if not all(e.wait(max(0.0, deadline - time.monotonic())) for e in ended):
                # cancelled, so that none holds a slot or is counted as the service's traffic
                log.warning("warm-up: cancelling the sessions still speaking after %.0f s", WARM_UP_TIMEOUT_S)
                for s, e in zip(sessions, ended):
                    if not e.is_set():
                        s.cancel()
                if not all(e.wait(10.0) for e in ended):  # a cancel ends a session at its next step
                    log.error("warm-up: a cancelled session did not end")
        finally:
            self.metrics = self.memory.metrics = live
        log.info("warmed up: %d sessions spoken", len(ended))

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.codec.shutdown()

    def make_voice(self, voice_id: str, audio, sample_rate: int) -> Voice:
        samples = pcm16_to_float(audio) if isinstance(audio, (bytes, bytearray)) else np.asarray(audio, dtype=np.float32)
        return self.runner.make_voice(voice_id, samples, sample_rate)

    def open_session(self, config: SessionConfig, voice: Voice, sink: Sink,
                     session_id: Optional[str] = None) -> EngineSession:
        """`session_id`: the id a pooled engine's parent gave it (None: a fresh one)."""
        config.validate()
        with self._admit_lock:
            if self._n_active >= self.config.max_sessions:
                self.metrics.sessions_total.labels(outcome="rejected").inc()
                raise CapacityError(f"all {self.config.max_sessions} session slots are busy")
            self._n_active += 1
        session = EngineSession(session_id or new_session_id(), config, voice, sink, self.submit, self._session_limits,
                                self.bundle.model.cfg.max_delay)
        self.metrics.active_sessions.inc()
        self.submit(session, ("open",))
        return session

    def submit(self, session: EngineSession, command: tuple) -> None:
        # opening, cancelling and closing go ahead of queued text: a client flooding text
        # must not delay another session's admission (text, its end and a stop keep their
        # order: a stop's summary must account for the text sent before it)
        urgent = command[0] in ("open", "cancel", "close")
        (self._urgent if urgent else self._commands).append((session, command))
        self._wake.set()

    # --- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        with self.codec.lock:
            self._loop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._apply_commands()
                now = time.monotonic()
                for s in list(self._sessions.values()):
                    # a running session holding no words has nothing to release: its memory
                    # was filled after its step (`TextMemory.evict_past`)
                    if s.phase is Phase.WAITING or s.chunker.pending_words:
                        with self._isolated(s, "releasing text"):
                            self._release_held_text(s, now)
                self.runner.flush_transcripts()
                batch = self._select(now)
                if len(batch):
                    self._step(batch)
                else:
                    self.codec.settle()  # nothing to overlap with: its audio goes out now
                    self._wake.wait(self._idle_timeout(now))
                    self._wake.clear()
            except Exception:  # never let one bad iteration kill the engine
                log.exception("engine iteration failed")
                for s in list(self._sessions.values()):
                    self._fail(s, "INTERNAL", "engine error")
        self.codec.settle()
        for s in list(self._sessions.values()):
            self._fail(s, "UNAVAILABLE", "server is shutting down")
        # sessions whose open command never ran
        while self._urgent:
            s, cmd = self._urgent.popleft()
            if cmd[0] == "open":
                self._end(s, "failed")

    def _release_held_text(self, s: EngineSession, now: float) -> None:
        """The chunker's timed releases; and while the speech waits for text that has not
        come for the session's buffer delay, the text held (a word still being written
        only as `EngineSession.buffer_releases_partial_word` says), spoken without
        lookahead and to the end of its audio (`EngineSession.run_out`)."""
        waiting = s.waiting_for_text()
        deadline = s.buffer_deadline() if waiting else None
        if deadline is not None and now >= deadline:
            self.memory.release(s, s.chunker.flush(now, partial=s.buffer_releases_partial_word(now)))
            s.waive_lookahead()
            s.run_out()
        else:
            self.memory.release(s, s.chunker.poll(now, waiting=waiting))

    def _idle_timeout(self, now: float) -> float:
        deadlines = [d for s in self._sessions.values() if (d := s.chunker.next_deadline()) is not None]
        deadlines += [d for s in self._sessions.values() if s.waiting_for_text() and (d := s.buffer_deadline()) is not None]
        wait = self.config.idle_poll_s * 10
        if deadlines:
            wait = min(wait, max(0.0, min(deadlines) - now))
        if any(s.phase is not Phase.ENDED and s.first_packet_at is not None for s in self._sessions.values()):
            wait = min(wait, self.config.idle_poll_s)  # sessions paused by their lead resume soon
        return wait

    def _apply_commands(self) -> None:
        # the urgent ones, then only the text queued so far: a flood of text arriving
        # faster than it is handled must not keep the loop from stepping everyone else
        queued = [self._urgent.popleft() for _ in range(len(self._urgent))]
        queued += [self._commands.popleft() for _ in range(len(self._commands))]
        for s, cmd in queued:
            kind = cmd[0]
            try:
                if kind == "open":
                    self._admit(s)
                elif s.phase is Phase.ENDED or s.slot is None:
                    continue
                elif kind == "text":
                    self._apply_text(s, cmd)
                elif kind == "end":
                    self.memory.release(s, s.on_end(cmd[1]))
                    self.memory.add_eos(s)
                    if not s.chunks:  # nothing to say
                        self._finish(s, cancelled=False)
                elif kind == "cancel":
                    # the cancel went ahead of text sent before it: that text is counted
                    # (unspoken) in the cancelled summary, not dropped
                    for t, later in queued:
                        if t is s and later[0] == "text":
                            self._apply_text(s, later)
                    self._finish(s, cancelled=True)
                elif kind == "stop":
                    self._stop_with_status(s, cmd[1], cmd[2])
                elif kind == "close":
                    self._end(s, cmd[1])
            except Exception as exc:
                log.exception("session %s: command %s failed", s.session_id, kind)
                self._fail(s, "INTERNAL", f"{type(exc).__name__} while handling {kind}")

    def _apply_text(self, s: EngineSession, cmd: tuple) -> None:
        """A ("text", text, client time, flush, arrival) command: the chunks it releases
        go into the session's memory; a flush waives their lookahead."""
        _, text, ts, flush, at = cmd
        self.memory.release(s, s.on_text(text, ts, flush, at))
        if flush:
            s.waive_lookahead()

    def _select(self, now: float) -> np.ndarray:
        """The slots of the sessions that run the next step (server/scheduler.py), in order."""
        slots, t = self._slots, self.table
        if not len(slots):
            return slots
        live = (t.phase[slots] != ENDED) & ~t.done_decoding[slots]
        ready = self._ready(slots, live)
        return slots[self.scheduler.select(live & ready, t.audio_ahead_s(slots, now), t.clocked[slots])]

    def _ready(self, slots: np.ndarray, live: np.ndarray) -> np.ndarray:
        """The start policy of each slot's session (`EngineSession.lookahead_ready`): one
        compiled pass, and a session's own method for the `live` ones whose letter
        schedule must lay letters first."""
        verdict = self.table.start_verdicts(slots, self.timelines)
        ready = verdict == READY
        for i in np.flatnonzero((verdict == ASK) & live).tolist():
            ready[i] = self._sessions[int(slots[i])].lookahead_ready()
        return ready

    def _isolated(self, s: EngineSession, what: str) -> "_Isolated":
        """An error in one session's bookkeeping ends that session only."""
        return _Isolated(self, s, what)

    def _admit(self, s: EngineSession) -> None:
        slot = self._free_slots.pop(0)
        self.codec.settle({slot})  # the slot's codec state is reset below: no call may hold it
        s.slot = slot
        s.timeline = self.timelines.bind(slot, client_speech_time=s.config.timestamps_are_speech_time,
                                         n_past=s.config.n_past_chunks, n_future=s.config.n_future_chunks,
                                         horizon=TextMemory.replace_horizon(s.config))
        s.bind_row(self.table, slot)
        self._sessions[slot] = s
        self._slots = np.array(sorted(self._sessions), np.int64)
        s.guidance = self.runner.admit(slot, s.voice, s.config.seed, s.guidance, s.sampling)
        if self.bundle.front_end is not None and self.config.letter_schedule:
            s.letters = LetterSchedule(self.bundle.front_end, s.voice.engine)
            self.table.has_letters[slot] = True

    # --- decoding --------------------------------------------------------------------------------
    def _step(self, slots: np.ndarray) -> None:
        """One decode step of the sessions in `slots` (in order), and its booking. What every
        session needs is read and written in its row of `self.table` and of the timelines,
        for the whole batch at once; a session's own methods run only where something
        happens to it (it starts, it fails, its words move on, its memory has work, its
        packet is off the packet clock, it ends)."""
        t0 = time.perf_counter()
        self.clock.step(t0)
        now = time.monotonic()
        t = self.table
        batch = [self._sessions[k] for k in slots.tolist()]
        for i in np.flatnonzero(t.phase[slots] == WAITING).tolist():  # starting, or again after waiting for text
            if (waited := batch[i].begin_step(now)) is not None:
                self.metrics.lookahead_wait_seconds.observe(waited)
        win = self.timelines.windows(slots, self.timelines.current_chunks(slots, t.step_count[slots]))
        windows = np.stack((win.lo, win.hi), axis=1)  # [B, 2]: each row's (lo, hi)
        force = t.runaway(slots, self.timelines).tolist()
        forced = bias_rows = None
        if t.has_letters[slots].any():
            letters = [s.letters for s in batch]
            forced = [s.forced_grapheme() for s in batch]
            d1 = self.bundle.model.cfg.delays[1]  # codebook 1 at this step carries frame step - d1
            bias_rows = [-1 if x is None else x.bias_row(s.step_count - d1) for s, x in zip(batch, letters)]
        self.codec.deliver_done()
        with self.codec.may_deliver():
            results = self.runner.step(slots.tolist(), windows, [s.guidance for s in batch], force, forced,
                                       bias_rows)
        step_s = time.perf_counter() - t0
        self.metrics.step_seconds.observe(step_s)
        self.metrics.batch_size.observe(len(batch))
        now = time.monotonic()
        live = t.phase[slots] != ENDED  # else its audio failed on the codec thread during the step
        t.compute_s[slots[live]] += step_s / len(batch)
        if live.all() and not results.failed.any():  # (most steps)
            self._book_step(slots, batch, results.progress, results.has_frame, results.frames, results.done, now)
            return
        for i in np.flatnonzero(live & results.failed).tolist():
            self._fail(batch[i], "INTERNAL", "numerical error in the decoder (non-finite logits)")
        rows = np.flatnonzero(live & ~results.failed)
        self._book_step(slots[rows], [batch[i] for i in rows.tolist()], results.progress[rows],
                        results.has_frame[rows], results.frames[rows], results.done[rows], now)

    def _book_step(self, slots: np.ndarray, stepped: list[EngineSession], progress: np.ndarray,
                   has_frame: np.ndarray, frames: np.ndarray, done: np.ndarray, now: float) -> None:
        """Book a step's results for the sessions in `slots` (`stepped`): their progress
        (the runner's guidance has observed the graphemes), the words it timed, their step
        counts, their completed frames' codes, whether their last frame was emitted; their
        timelines re-placed and the text memory's work; whether their text ran dry; then
        the packets to decode now, and the sessions that ended."""
        t = self.table
        track = t.book_step(slots, progress, has_frame, frames, done)
        # words are sent once their audio is (`EngineSession.send_words`)
        for i in np.flatnonzero(track).tolist():
            s = stepped[i]
            with self._isolated(s, "timing words"):
                s.track_words(s.step_count - 1)  # the frame of the step booked
        # the timelines move on with the progress, and the memory's work from the windows at the next step
        steps = t.step_count[slots]
        self.memory.replace(self.timelines, slots, steps, progress)
        win = self.timelines.windows(slots, self.timelines.current_chunks(slots, steps))
        for i in np.flatnonzero(self.memory.due(self.timelines, slots, win)).tolist():
            s = stepped[i]
            if s.phase is not Phase.ENDED:  # ended as another session's ending delivered its audio
                with self._isolated(s, "moving text memory"):
                    self.memory.evict_past(s, int(win.lo[i]))
        # text ran dry: wait for more
        live = t.phase[slots] != ENDED
        going = live & ~t.done_decoding[slots]
        for i in np.flatnonzero(going & ~self._ready(slots, going)).tolist():
            self._wait_for_text(stepped[i])
        # packets: those on the packet clock as arrays, each other session's by its own rule
        steady, full = self.packets.clocked_rows(t, slots)
        to_decode = []
        for i in np.flatnonzero(live & ~steady).tolist():
            s = stepped[i]
            if s.phase is Phase.ENDED:
                continue
            with self._isolated(s, "decoding"):
                s.clocked, plan = self.packets.due(s, now)
                if plan:
                    to_decode.append((s, plan))
                elif s.done_decoding:
                    self._finish(s, cancelled=False)
        # (an ending above may have delivered audio that ended one of these)
        to_decode += [(stepped[i], PacketPlan(int(t.packet_frames[slots[i]]), False, clocked=True))
                      for i in np.flatnonzero(full & (t.phase[slots] != ENDED)).tolist()]
        self.codec.decode(to_decode)

    def _wait_for_text(self, s: EngineSession) -> None:
        """A running session's text ran dry (not yet all of it in memory, or none to say
        yet): it waits for more (`EngineSession.lookahead_ready`)."""
        s.phase = Phase.WAITING

    def _deliver(self, call: InFlightDecode) -> None:
        """A finished codec call's audio to its sessions (`CodecWorker` hands each over in
        order, under its lock, on either thread); the last packet ends its session."""
        planned, n = call.planned, call.frames
        try:
            wavs, dt = call.future.result()
        except Exception as exc:  # ends the sessions of this call only; the others' state is untouched
            log.error("codec decode of %d session(s) failed", len(planned), exc_info=exc)
            for s, _ in planned:
                self._fail(s, "INTERNAL", f"{type(exc).__name__} while decoding audio")
            return
        self.metrics.codec_decode_seconds.observe(dt)
        for (s, short), wav in zip(planned, wavs):
            if s.phase is Phase.ENDED:  # cancelled or failed while its audio was decoded
                continue
            with self._isolated(s, "sending audio"):
                s.compute_s += dt / len(planned)
                s.send_audio(s.encoder.push(wav, short=short), n, self.metrics)
                if s.done_decoding and not s.n_pending:
                    s.send_audio(s.encoder.flush(), 0, self.metrics)
                    self._finish(s, cancelled=False)

    # --- endings -------------------------------------------------------------------------------
    def _finish(self, s: EngineSession, cancelled: bool) -> None:
        self._settle_for(s)  # audio decoded for it goes out before its end (and may end it)
        if s.phase is Phase.ENDED:
            return
        if not cancelled:
            s.send_words(final=True)
        summary = self._summary(s, cancelled)
        guarded = len(summary.unspoken_words) - len(s.unsayable)
        if guarded and not cancelled:  # the runaway guard ended it: EOS is barred until the text is spoken
            log.warning("session %s ended by the runaway guard with %d of %d words unspoken",
                        s.session_id, guarded, len(s.words))
        if s.unsayable:
            log.info("session %s: %d word(s) the model cannot say (no letter of its alphabet), reported unspoken",
                     s.session_id, len(s.unsayable))
        # the slot is free before the client hears of the end: a client that opens its next
        # session on the summary must find the slot. "completed" only with every word spoken
        self._end(s, "cancelled" if cancelled else "incomplete" if summary.unspoken_words else "completed")
        s.sink(Finished(summary))

    def _stop_with_status(self, s: EngineSession, code: str, message: str) -> None:
        """The service ends the session with an error status (its text limit, a timeout):
        like a cancel, nothing more is generated, and the client first hears what was
        spoken (`Finished.error`). Counted failed, as the close it replaces; the service
        counts the status."""
        self._settle_for(s)  # audio decoded for it goes out first (and may end it)
        if s.phase is Phase.ENDED:
            return
        summary = self._summary(s, cancelled=False)
        self._end(s, "failed")
        s.sink(Finished(summary, error=Failed(code, message)))

    def _summary(self, s: EngineSession, cancelled: bool) -> Summary:
        """What the session spoke, for its last event; books its audio."""
        if s.audio_sent_s > 0:
            self.metrics.rtf.observe(s.compute_s / s.audio_sent_s)
            self.metrics.audio_seconds_total.inc(s.audio_sent_s)
        return s.summary(cancelled)

    def _settle_for(self, s: EngineSession) -> None:
        if s.slot is not None:
            self.codec.settle({s.slot})

    def _fail(self, s: EngineSession, code: str, message: str) -> None:
        if s.phase is Phase.ENDED:
            return
        self.metrics.errors_total.labels(code=code).inc()
        self._end(s, "failed")
        s.sink(Failed(code, message))

    def _end(self, s: EngineSession, outcome: str) -> None:
        if s.phase is Phase.ENDED:
            return
        s.phase = Phase.ENDED
        if s.slot is not None and self._sessions.get(s.slot) is s:
            del self._sessions[s.slot]
            self._slots = np.array(sorted(self._sessions), np.int64)
            s.unbind_row()
            self.runner.release(s.slot)
            self._free_slots.append(s.slot)
            self._free_slots.sort()
        self.metrics.sessions_total.labels(outcome=outcome).inc()
        self.metrics.active_sessions.dec()
        with self._admit_lock:
            self._n_active -= 1
        if self.on_session_end is not None:
            self.on_session_end(s.session_id)


def _on_end(ended: threading.Event) -> Sink:
    """A sink that drops audio and sets `ended` at the session's last event."""
    def sink(event) -> None:
        if isinstance(event, (Finished, Failed)):
            ended.set()
    return sink


class _Isolated:
    """`Engine._isolated`'s context: a class, not a generator-based context manager,
    because it wraps every session's work at every step (~2 us less each time)."""
    __slots__ = ("engine", "session", "what")

    def __init__(self, engine: Engine, session: EngineSession, what: str):
        self.engine, self.session, self.what = engine, session, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        log.error("session %s: error while %s", self.session.session_id, self.what, exc_info=exc)
        self.engine._fail(self.session, "INTERNAL", f"{kind.__name__} while {self.what}")
        return True


def freeze_startup_objects() -> None:
    """Move what start-up made (the model, the tokenizer's and guidance's tables, the
    warm-up's leftovers) out of the garbage collector's generations, once a serving
    process (the server, or an engine process of a pool) has started: a full collection
    then scans only what serving made. A full collection holds the GIL, so it stalls the
    engine thread: after 300 steps of 16 sessions on the default model, over ~288,000
    objects it took ~105 ms, with them frozen 0.2 ms (the 2-core VM)."""
    gc.collect()
    gc.freeze()
