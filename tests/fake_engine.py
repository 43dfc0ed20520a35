"""TEST DOUBLE: a tiny fake of `EngineAPI` (no model) for the service tests.

It behaves like the real engine at the boundary: one background thread steps all
sessions; each whole word becomes `frames_per_word` frames of a tone (24 kHz float32,
encoded with the real `AudioEncoder`), followed by its `WordTiming`; generation of a word
waits for `n_future_chunks` more words (or end of input); `cancel` ends with a summary of
what was spoken, `stop` with that summary and its status; `close` frees the slot at the
next step. The text "<fail>" makes the session fail with INTERNAL (to test isolation).
"""
from __future__ import annotations

import itertools
import threading
import time
from types import SimpleNamespace
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from livespeech.server.audio import AudioEncoder
from livespeech.api.session import (
    AudioPacket,
    CapacityError,
    ConfigError,
    Failed,
    Finished,
    SessionConfig,
    Sink,
    Summary,
    WordTiming,
)

FRAME = 320  # samples per frame at 24 kHz / 75 Hz


@dataclass
class FakeVoice:
    voice_id: str
    n_samples: int = 0


@dataclass
class _Session:
    session_id: str
    config: SessionConfig
    sink: Sink
    encoder: AudioEncoder
    text: str = ""
    ended: bool = False
    cancel: bool = False
    closed: bool = False
    stop: Optional[Failed] = None  # SessionHandle.stop: end with this status after the summary
    words_done: list = field(default_factory=list)
    frame_in_word: int = 0
    frames: int = 0
    seq: int = 0
    sent_s: float = 0.0
    first_text_t: Optional[float] = None
    start_t: Optional[float] = None
    ttfa: Optional[float] = None
    fpl: Optional[float] = None

    def words(self) -> list[str]:
        parts = self.text.split()
        if not self.ended and parts and not self.text[-1].isspace():
            parts = parts[:-1]  # the last word may still grow
        return parts


class FakeHandle:
    def __init__(self, engine: "FakeEngine", s: _Session) -> None:
        self._engine, self._s = engine, s
        self.session_id = s.session_id

    def push_text(self, text: str, client_time_s: Optional[float] = None, flush: bool = False) -> None:
        with self._engine.lock:
            if self._s.ended:
                raise ConfigError("text after end of input")
            if self._s.first_text_t is None and text.strip():
                self._s.first_text_t = time.monotonic()
            self._s.text += text
            if flush:
                self._s.text += " "

    def end_input(self) -> None:
        with self._engine.lock:
            self._s.ended = True

    def cancel(self) -> None:
        with self._engine.lock:
            self._s.cancel = True

    def stop(self, code: str, message: str) -> None:
        with self._engine.lock:
            self._s.stop = Failed(code, message)

    def close(self, outcome: str = "disconnected") -> None:
        with self._engine.lock:
            self._s.closed = True


class FakeEngine:
    def __init__(
        self,
        capacity: int = 4,
        frames_per_word: int = 6,
        frames_per_step: int = 3,
        step_s: float = 0.003,
        builtin: tuple[str, ...] = ("default",),
        metrics=None,
    ) -> None:
        self._capacity = capacity
        self.frames_per_word = frames_per_word
        self.frames_per_step = frames_per_step
        self.step_s = step_s
        self.metrics = metrics
        self.lock = threading.Lock()
        self.sessions: dict[str, _Session] = {}
        self.opened: list[SessionConfig] = []
        self.made_voices: list[str] = []
        # like livespeech.models.loading.ModelBundle: built-in voices as 24 kHz reference audio
        self.builtin_voices = {v: np.zeros(2400, np.float32) for v in builtin}
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.stopped = False

    # EngineAPI
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fake-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.stopped = True

    @property
    def active_sessions(self) -> int:
        with self.lock:
            return len(self.sessions)

    @property
    def capacity(self) -> int:
        return self._capacity

    def open_session(self, config: SessionConfig, voice: FakeVoice, sink: Sink) -> FakeHandle:
        config.validate()
        with self.lock:
            if len(self.sessions) >= self._capacity:
                self._count("rejected")
                raise CapacityError(f"{self._capacity} sessions active")
            sid = f"fake-{next(self._ids)}"
            s = _Session(sid, config, sink, AudioEncoder(config.sample_rate, config.encoding, config.packet_ms))
            self.sessions[sid] = s
            self.opened.append(config)
            self._gauge()
        return FakeHandle(self, s)

    def make_voice(self, voice_id: str, audio, sample_rate: int) -> FakeVoice:
        self.made_voices.append(voice_id)
        return FakeVoice(voice_id, len(audio))

    # the "decode loop"; metrics as the real engine records them
    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.sessions_total.labels(outcome=outcome).inc()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.active_sessions.set(len(self.sessions))

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            with self.lock:
                for sid, s in list(self.sessions.items()):
                    outcome = "disconnected" if s.closed else self._step(s)
                    if outcome:
                        del self.sessions[sid]
                        self._count(outcome)
                self._gauge()
                if self.metrics is not None and self.sessions:
                    self.metrics.batch_size.observe(len(self.sessions))
                    self.metrics.step_seconds.observe(time.monotonic() - t0)
            self._stop.wait(self.step_s)

    def _emit_packets(self, s: _Session, packets) -> None:
        for p in packets:
            if s.ttfa is None and s.first_text_t is not None:
                now = time.monotonic()
                s.ttfa = now - s.first_text_t
                s.fpl = now - (s.start_t or now)
            s.sink(AudioPacket(s.seq, p.data, p.start_s, p.duration_s))
            s.seq += 1
            s.sent_s = p.start_s + p.duration_s

    def _finish(self, s: _Session, cancelled: bool) -> str:
        if not (cancelled or s.stop):
            self._emit_packets(s, s.encoder.flush())
        audio_s = s.frames * FRAME / 24000
        lookahead = None if s.ttfa is None or s.fpl is None else max(s.ttfa - s.fpl, 0.0)
        if self.metrics is not None:
            self.metrics.audio_seconds_total.inc(audio_s)
            if s.ttfa is not None:
                self.metrics.ttfa_seconds.observe(s.ttfa)
                self.metrics.compute_fpl_seconds.observe(s.fpl)
                self.metrics.lookahead_wait_seconds.observe(lookahead)
        unspoken = tuple(s.text.split()[len(s.words_done):])
        s.sink(Finished(Summary(s.frames, audio_s, s.ttfa, lookahead, s.fpl, cancelled, " ".join(s.words_done),
                                not unspoken, unspoken), error=s.stop))
        return "failed" if s.stop else "cancelled" if cancelled else "completed"

    def _step(self, s: _Session) -> Optional[str]:
        """Advance one session; its outcome when it is over."""
        if "<fail>" in s.text:
            s.sink(Failed("INTERNAL", "injected engine failure"))
            if self.metrics is not None:
                self.metrics.errors_total.labels(code="INTERNAL").inc()
            return "failed"
        if s.cancel or s.stop:
            return self._finish(s, cancelled=s.cancel)
        words = s.words()
        nf = s.config.n_future_chunks
        for _ in range(self.frames_per_step):
            i = len(s.words_done)
            if i >= len(words):
                return self._finish(s, cancelled=False) if s.ended else None
            if not s.ended and len(words) <= i + nf:
                return None  # waiting for lookahead
            if s.start_t is None:
                s.start_t = time.monotonic()
            t = (np.arange(FRAME) + s.frames * FRAME) / 24000
            tone = 0.3 * np.sin(2 * np.pi * (200 + 40 * (i % 8)) * t).astype(np.float32)
            self._emit_packets(s, s.encoder.push(tone))
            s.frames += 1
            s.frame_in_word += 1
            if s.frame_in_word == self.frames_per_word:
                end = s.frames * FRAME / 24000
                s.sink(WordTiming(words[i], end - self.frames_per_word * FRAME / 24000, end))
                s.words_done.append(words[i])
                s.frame_in_word = 0
        return None
