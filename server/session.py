"""One synthesis session inside the engine: its lifecycle, its text-side state and the events
it sends (audio packets, word timings, its summary).

Lifecycle (like a request in an LLM server):
    WAITING  admitted, holds a slot, waiting for text / lookahead (also after the text
             ran dry mid-utterance)
    RUNNING  decoding frames
    ENDED    finished, cancelled, failed or disconnected; the slot is freed

The handle methods (`push_text`, `end_input`, `cancel`, `stop`, `close`) run on the service's
event loop: they validate synchronously (so the service can answer with a status) and
queue the work for the engine thread, which alone touches everything else here.
"""
from __future__ import annotations

import enum
import math
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from livespeech.api.session import (AudioPacket, ConfigError, LimitError, SessionConfig, Sink, StateError, Summary,
                                    WordTiming)
from livespeech.models import graphemes
from livespeech.models.front_end import LetterSchedule
from livespeech.models.config import FRAME_RATE
from livespeech.models.guidance import GuidanceState, SamplingSettings, Temperatures

from .audio import AudioEncoder
from .chunker import Chunker, TextChunk, ends_with_punctuation
from .metrics import Metrics
from . import session_table
from .session_table import SessionTable, running_out
from .timeline import SpeechTimeline


class Phase(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    ENDED = "ended"


# `SessionTable.phase`'s codes of the phases, and back
_PHASE_OF_CODE = {session_table.WAITING: Phase.WAITING, session_table.RUNNING: Phase.RUNNING,
                  session_table.ENDED: Phase.ENDED}
_CODE_OF_PHASE = {p: c for c, p in _PHASE_OF_CODE.items()}


class _InRow:
    """A field of `EngineSession` kept in its row of a `SessionTable` (server/session_table.py),
    read as a Python value (`load` of it, where given)."""
    __slots__ = ("name", "load", "store")

    def __init__(self, load: Optional[Callable] = None, store: Optional[Callable] = None) -> None:
        self.load, self.store = load, store

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, s, owner=None):
        if s is None:
            return self
        value = getattr(s._table, self.name).item(s._row)
        return value if self.load is None else self.load(value)

    def __set__(self, s, value) -> None:
        getattr(s._table, self.name)[s._row] = value if self.store is None else self.store(value)


@dataclass(frozen=True)
class SessionLimits:
    """The engine's limits on a session: its text, checked as the text comes in, and its
    speech (the runaway guard, `SessionTable.runaway`)."""
    max_text_piece_chars: int
    max_session_text_chars: int
    max_session_s: float  # also: a speech-time timestamp may not be past it
    # once the text is complete, speech may run this long past the expected end of its
    # text, or this long without transcript progress
    max_overrun_s: float


@dataclass
class Word:
    text: str
    char_start: int  # in the collapsed transcript
    char_end: int
    start_frame: Optional[int] = None
    end_frame: Optional[int] = None
    covered_frame: Optional[int] = None  # the stream reached its last grapheme: spoken in full
    sent: bool = False


@dataclass
class Chunk:
    """One word's tokens in the model's text memory (or the end-of-text token): the
    memory holds a chunk a word, placed at its own frame, while the np/nf window counts
    the text chunks the chunker released (docs/architecture.md, "Text chunks and the
    model's memory")."""
    index: int  # in `EngineSession.chunks`, the model's memory and the timeline
    text_chunk: int  # the released text chunk it belongs to
    token_ids: list[int]
    n_chars: int


def new_session_id() -> str:
    return uuid.uuid4().hex[:16]


class SessionInput:
    """The service's `SessionHandle` of one session: it checks each piece of input at once
    (so the service can answer with a status) and hands it on as a command tuple to
    `submit(handle, command)`: the engine's queue (`EngineSession`) or the pipe to the
    engine process that holds the session (server/engine_pool.py). The engine applies the
    commands in `Engine._apply_commands`."""

    def __init__(self, session_id: str, config: SessionConfig, submit: Callable[["SessionInput", tuple], None],
                 limits: SessionLimits):
        self.session_id = session_id
        self.config = config
        self._submit = submit
        self._limits = limits
        self._lock = threading.Lock()
        self._input_ended = False
        self._last_client_ts = -math.inf
        self._text_chars = 0

    def push_text(self, text: str, client_time_s: Optional[float] = None, flush: bool = False) -> None:
        limits = self._limits
        with self._lock:
            if self._input_ended:
                raise StateError("text after end_of_input")
            if len(text) > limits.max_text_piece_chars:
                raise ConfigError(
                    f"text: piece of {len(text)} chars is over max_text_piece_chars={limits.max_text_piece_chars}")
            if self._text_chars + len(text) > limits.max_session_text_chars:
                raise LimitError(f"text: session total is over max_session_text_chars={limits.max_session_text_chars}")
            if client_time_s is not None:
                if not (math.isfinite(client_time_s) and client_time_s >= 0):
                    raise ConfigError(f"text.timestamp_s must be finite and >= 0, got {client_time_s}")
                if self.config.timestamps_are_speech_time and client_time_s > limits.max_session_s:
                    raise ConfigError(
                        f"text.timestamp_s {client_time_s:g} is past the longest session ({limits.max_session_s:g} s)")
                if client_time_s < self._last_client_ts:
                    raise ConfigError(
                        f"text.timestamp_s must not decrease: {client_time_s:g} after {self._last_client_ts:g}")
                self._last_client_ts = client_time_s
            self._text_chars += len(text)
        self._submit(self, ("text", text, client_time_s, flush, time.monotonic()))

    def end_input(self) -> None:
        with self._lock:
            if self._input_ended:
                raise StateError("end_of_input received twice")
            self._input_ended = True
        self._submit(self, ("end", time.monotonic()))

    def cancel(self) -> None:
        self._submit(self, ("cancel",))

    def stop(self, code: str, message: str) -> None:
        self._submit(self, ("stop", code, message))

    def close(self, outcome: str = "disconnected") -> None:
        self._submit(self, ("close", outcome))


class EngineSession(SessionInput):
    """Engine-side state of one session; also the service's `SessionHandle` when the
    engine runs in the server's process."""

    def __init__(self, session_id: str, config: SessionConfig, voice, sink: Sink,
                 submit: Callable[["EngineSession", tuple], None], limits: SessionLimits, audio_lag_frames: int):
        super().__init__(session_id, config, submit, limits)
        self.voice = voice
        self.sink = sink
        # the per-step state (`SessionTable`'s fields): a row of its own until the engine binds it
        self._table, self._row = SessionTable.of_one(config, limits, audio_lag_frames), 0
        self._bound = False
        self.slot: Optional[int] = None
        # engine-side state (the engine thread)
        self.chunker = Chunker(config.chunking)
        self.timeline = SpeechTimeline(client_speech_time=config.timestamps_are_speech_time,
                                       n_past=config.n_past_chunks, n_future=config.n_future_chunks)
        self.guidance = GuidanceState()
        # the text's letters on predicted frames (models/front_end.py), when the model has
        # a front end and the letter schedule is on: the engine sets it at open
        self.letters: Optional[LetterSchedule] = None
        self.sampling = SamplingSettings(config.guidance_lambda, config.top_k, config.grapheme_top_k,
                                         Temperatures(config.grapheme_temperature, config.first_codebook_temperature,
                                                      config.acoustic_temperature))
        self.chunks: list[Chunk] = []
        self.words: list[Word] = []
        # written words with letters or digits none of which the model can say (another
        # script: "Привет"), each after the first this many `words`: reported unspoken
        self.unsayable: list[tuple[int, str]] = []
        # words end, and are sent, in order: the ones before these indices are done with
        self._first_open_word = 0
        self._first_unsent_word = 0
        self.input_ended = False  # engine's view (after the queued command ran)
        self.last_text_at: Optional[float] = None  # when the last text piece arrived
        self.encoder = AudioEncoder(config.sample_rate, config.encoding, config.packet_ms, config.min_packet_ms)
        self.packet_seq = 0
        self.frames_sent = 0  # frames whose audio has been sent
        # latency bookkeeping (monotonic seconds)
        self.first_text_at: Optional[float] = None
        self.started_at: Optional[float] = None

    # the per-step state, in its row of a `SessionTable` (what each field is: server/session_table.py)
    phase = _InRow(_PHASE_OF_CODE.__getitem__, _CODE_OF_PHASE.__getitem__)
    step_count = _InRow()
    frames_done = _InRow()
    n_pending = _InRow()
    clocked = _InRow()
    done_decoding = _InRow()
    first_packet_at = _InRow(lambda v: None if v != v else v, lambda v: np.nan if v is None else v)  # NaN: none
    audio_sent_s = _InRow()
    compute_s = _InRow()
    last_progress = _InRow()
    progress_step = _InRow()
    covered_chars = _InRow()
    covered_step = _InRow()
    n_chars = _InRow()
    eos_added = _InRow()
    run_out_chars = _InRow()
    lookahead_waived_through = _InRow()
    audio_lag_frames = _InRow()

    def bind_row(self, table: SessionTable, slot: int) -> None:
        """The engine's table holds this session's state from now on, in row `slot`."""
        table.bind(slot, self._table)
        self._table, self._row, self._bound = table, slot, True

    def unbind_row(self) -> None:
        """The session's state goes back to a row of its own (it ended: its slot's row is free)."""
        if self._bound:
            self._table, self._row, self._bound = self._table.unbind(self._row), 0, False

    # --- engine thread ---------------------------------------------------------------------
    def on_text(self, text: str, client_time_s: Optional[float], flush: bool, now: float) -> list[TextChunk]:
        if text:
            self.last_text_at = now
            if self.first_text_at is None:
                self.first_text_at = now
        return self.chunker.push(text, now, client_time_s, flush)

    def on_end(self, now: float) -> list[TextChunk]:
        self.input_ended = True
        if self.first_text_at is None:
            self.first_text_at = now
        return self.chunker.flush(now)

    def begin_text_chunk(self) -> None:
        """The chunks registered next belong to a new text chunk."""
        self.timeline.begin_text_chunk()

    @property
    def n_in_memory(self) -> int:
        """Chunks move into the model's text memory oldest first (`TextMemory.fill`): the
        first n_in_memory of them are there (or were, and left the np window)."""
        return self.timeline.in_memory

    def register_chunk(self, word: Optional[str], token_ids: list[int], written: Optional[str] = None,
                       continues: bool = False) -> Chunk:
        """Account a word (None: the end of the text) of the current text chunk in the
        transcript (graphemes, words) and as a chunk of the model's memory. `word` is a
        word said (models/spoken_form.py); `written`, the client's word it says, if
        another: the words timed and summed up are the written ones, and `continues`
        says that this one goes on saying the written word of the chunk before it."""
        ids: list[int] = []
        letters = graphemes.word_graphemes(word) if word is not None else []
        g = graphemes.collapse_repeats(letters)
        if g:  # a word of punctuation alone has no graphemes
            if self.n_chars > 0:
                ids.append(graphemes.SPACE)
            ids.extend(g)
            if continues and self.words:
                self.words[-1].char_end = self.n_chars + len(ids)
            else:
                self.words.append(Word(written or word, self.n_chars + len(ids) - len(g), self.n_chars + len(ids)))
            self._table.words_mark[self._row] = 0  # `track_words` runs again at the next progress
            if self.letters is not None:
                self.letters.add_word(letters)
        chunk = Chunk(len(self.chunks), self.timeline.text_chunks - 1, token_ids, len(ids))
        self.guidance.extend_transcript(ids)
        self.n_chars += len(ids)
        self.chunks.append(chunk)
        return chunk

    def note_unsayable(self, written: str) -> None:
        """A written word of the text that none of its words said gave a grapheme, though
        it has letters or digits (`graphemes.has_content`): not spoken, and reported so."""
        self.unsayable.append((len(self.words), written))

    @property
    def text_complete(self) -> bool:
        return self.input_ended and self.chunker.pending_words == 0

    def window(self) -> tuple[int, int]:
        """First and last chunk of the np/nf window at this step, among the chunks in the
        model's text memory: the words of the np text chunks before the current word's
        and of the nf after it (`SpeechTimelines.windows`, which the engine asks for its
        whole batch)."""
        lo, hi, _ = self.timeline.window(self.step_count)
        return lo, hi

    def window_needs(self, chunk: Chunk) -> bool:
        """Whether the np/nf window shows `chunk` at this step or may at the next (a text
        chunk further on)."""
        return chunk.text_chunk <= self.timeline.window(self.step_count)[2] + 1

    def lookahead_ready(self) -> bool:
        """The start policy: current chunk c is spoken once min(nf, start_future_chunks + c)
        chunks after it are in memory, or the text has ended, or its lookahead was waived
        (`waive_lookahead`: a flush, or the buffer delay). Never past the text: once
        the speech has covered every grapheme so far, it waits for more (or the end).

        c is the chunk of the audio: of the last frame complete in every codebook, which
        the grapheme stream leads by the codebook delays (8 frames). So the graphemes may
        run that far into a chunk whose lookahead is not in yet, and the audio of the
        chunk before it is all out while the speech waits. Counted at the graphemes, a
        wait held those 8 frames (107 ms) back from a listener that had just started:
        its stalls at 16 sessions (docs/loadtest.md, "Measured choices").

        Past the text only to finish its audio once the buffer delay expired
        (`running_out`).

        With a letter schedule, the speech also waits at the last letter laid, except
        at its start (`lay_letters_for_this_step`).

        The rule is `SessionTable.start_verdicts`, which the engine runs for its batch and
        which leaves to this the sessions whose letter schedule must lay letters first."""
        verdict = self._start_verdict(letters=True)
        if verdict != session_table.ASK:
            return verdict == session_table.READY
        self.lay_letters_reached()  # (it changes no input of the verdict but the letters')
        verdict = self._start_verdict(letters=False)
        return verdict == session_table.READY or (verdict == session_table.READY_IF_LETTERS_LAID
                                                  and self.lay_letters_for_this_step())

    def _start_verdict(self, letters: bool) -> int:
        rows, tl_rows = np.array([self._row]), np.array([self.timeline.slot])
        return int(self._table.start_verdicts(rows, self.timeline.table, tl_rows, letters)[0])

    def lay_letters_reached(self) -> None:
        """Once the speech reaches the last letter laid, lay every letter the text so far
        completes, in one call of the front end's networks: laid as each word arrived,
        ~1.3 ms a word on the engine thread fell on the sessions' starts, where the text
        comes (docs/loadtest.md, "What holds now"). The frames are the same either way:
        a letter is laid once its window is complete, whenever that is."""
        if self.letters is not None and self.step_count >= self.letters.n_frames:
            self.letters.lay(self.step_count, final=self.text_complete)
            self._letters_laid()

    def lay_letters_for_this_step(self) -> bool:
        """Whether the speech has a letter laid for this step: the first word is laid whole
        once the speech reaches its last letter laid (`LetterSchedule.lay_first_word`: the
        first audio need not wait for the second word); a later letter waits for the
        letters its window reads (laying every word early measured worse:
        docs/architecture.md, "The letter schedule")."""
        if self.letters is None or self.step_count < self.letters.n_frames:
            return True
        self.letters.lay_first_word(self.step_count)
        self._letters_laid()
        return self.step_count < self.letters.n_frames

    def _letters_laid(self) -> None:
        """The start policy's rows read how far the letters are laid (`SessionTable.letters_frames`)."""
        self._table.letters_frames[self._row] = self.letters.n_frames

    def waive_lookahead(self) -> None:
        """The chunks released so far are spoken without waiting for more text."""
        self.lookahead_waived_through = len(self.chunks) - 1

    def run_out(self) -> None:
        """The text so far is spoken to its end without more text: once the grapheme
        stream has covered it, the speech steps on until the audio, which lags by the
        codebook delays, has completed its frames (`running_out`)."""
        self.run_out_chars = self.n_chars
        if self.letters is not None:
            self.letters.lay(self.step_count, final=True)
            self._letters_laid()

    def running_out(self) -> bool:
        """Whether the speech, its stream at the end of the text, steps on to finish the
        text's audio: the frames up to the one where the stream covered the text, plus
        the shortest packet's frames and one, so neither the encoder's shortest packet
        nor the resampler's look-ahead holds any of that audio back. These steps sample
        what the model makes after the text: EOS stays barred (the input has not ended)
        and guidance favours only the last grapheme (`GuidanceState.guiding_set`)."""
        t, r = self._table, self._row
        return bool(running_out(t.run_out_chars[r], t.n_chars[r], t.covered_chars[r], t.eos_added[r],
                                t.step_count[r], t.covered_step[r], t.audio_lag_frames[r], t.run_out_tail[r]))

    def ran_out(self) -> bool:
        """Whether the speech finished the audio of all the text so far (`run_out`)."""
        return (self.run_out_chars == self.n_chars == self.covered_chars and not self.eos_added
                and not self.running_out())

    def buffer_deadline(self) -> Optional[float]:
        """When the text held goes out without its lookahead, and the speech finishes the
        audio of the text so far (`run_out`), if no more text comes
        (`SessionConfig.max_buffer_delay_ms` after the last piece; a word still being
        written and not ending in punctuation waits twice that, see
        `_partial_word_deadline`); None: never (no limit, no text yet, the text
        has ended, or all that is done already)."""
        delay_ms = self.config.max_buffer_delay_ms
        if not delay_ms or self.last_text_at is None or self.input_ended:
            return None
        first = self.last_text_at + delay_ms / 1000.0
        if (self.chunker.pending_words or self.lookahead_waived_through < len(self.chunks) - 1
                or self.run_out_chars != self.n_chars):
            return first
        return self._partial_word_deadline() if self.chunker.partial_word else None

    def _partial_word_deadline(self) -> float:
        """When the buffer delay releases the word still being written as a whole word:
        after the delay if it ends in punctuation, else after twice the delay. An LLM that
        pauses mid-word ("every" ... "body") is not split at the first delay; a last
        word that stays unpunctuated is still spoken, later."""
        assert self.last_text_at is not None
        delays = 1 if ends_with_punctuation(self.chunker.partial_word) else 2
        return self.last_text_at + delays * self.config.max_buffer_delay_ms / 1000.0

    def buffer_releases_partial_word(self, now: float) -> bool:
        """Whether a release by the buffer delay now includes the word still being written
        (`_partial_word_deadline`)."""
        return self.last_text_at is not None and now >= self._partial_word_deadline()

    def begin_step(self, now: float) -> Optional[float]:
        """The session steps (again, after waiting for text); on its first step, how long
        it waited for its lookahead."""
        if self.phase is not Phase.WAITING:
            return None
        self.phase = Phase.RUNNING
        if self.started_at is not None:
            return None
        self.started_at = now
        return now - (self.first_text_at or now)

    def forced_grapheme(self) -> int:
        """This step's grapheme from the letter schedule: its letter, EOS once the text is
        complete and all its letters are spoken, or -1 (sampled: no schedule, or the
        speech steps past the letters laid)."""
        if self.letters is None:
            return -1
        if self.eos_added and self.step_count >= self.letters.n_frames:
            return graphemes.EOS
        return self.letters.grapheme(self.step_count)

    def waiting_for_text(self) -> bool:
        """Whether the speech is held up for want of text (not started, or the text ran dry)."""
        return self.phase is Phase.WAITING and not self.done_decoding and not self.lookahead_ready()

    def track_words(self, frame: int) -> None:
        """Update word frames from the guidance progress: a word starts once the progress
        passes its first grapheme, is spoken in full once it reaches its last, and ends
        once it reaches the next word (its start, after the space).

        Each mark is set once, at a threshold of the progress, and the words' thresholds
        grow along the text; so nothing changes before the progress reaches the first
        open word's next threshold, which this keeps in `SessionTable.words_mark` for the
        engine to call it only then."""
        progress = self.guidance.progress
        words = self.words
        if progress < self._table.words_mark[self._row]:
            return
        for i in range(self._first_open_word, len(words)):
            w = words[i]
            if w.end_frame is not None:
                continue
            if w.start_frame is None and progress > w.char_start:
                w.start_frame = frame
            if w.covered_frame is None and progress >= w.char_end:
                w.covered_frame = frame
            if w.start_frame is not None and progress >= w.char_end + 1:
                w.end_frame = frame
            if w.start_frame is None:
                break
        while self._first_open_word < len(words) and words[self._first_open_word].end_frame is not None:
            self._first_open_word += 1  # words end in order
        mark = session_table.NEVER
        if self._first_open_word < len(words):
            w = words[self._first_open_word]
            mark = w.char_start + 1 if w.start_frame is None else w.char_end + (w.covered_frame is not None)
        self._table.words_mark[self._row] = mark

    def spoken_text(self) -> str:
        """The words whose speech started in the audio sent (a word cut off mid-way too)."""
        spoken = [w.text for w in self.words if w.start_frame is not None and w.start_frame < self.frames_sent]
        return " ".join(spoken)

    def unspoken_words(self) -> list[str]:
        """The words of the text received that were not spoken to their end in the audio
        sent, in order: by the same grapheme progress that times the words, the stream
        never reached their last grapheme, or the audio of that frame was not sent; then
        the words the chunker still holds (a cancel before they were released). Words
        are covered in order, so these are the text's last words, but for the words the
        model cannot say (`note_unsayable`), wherever they are."""
        out: list[str] = []
        k = 0  # the unsayable words go in before the word that followed them
        for i, w in enumerate(self.words):
            while k < len(self.unsayable) and self.unsayable[k][0] <= i:
                out.append(self.unsayable[k][1])
                k += 1
            if w.covered_frame is None or w.covered_frame >= self.frames_sent:
                out.append(w.text)
        out += [text for _, text in self.unsayable[k:]]
        out += [w for w in self.chunker.held_words() if graphemes.has_content(w)]
        return out

    def send_audio(self, packets, frames: int, metrics: Metrics) -> None:
        """Send encoded packets (`frames` more frames of audio), then the words whose
        audio is all out; books the first packet's latencies and packets late for a
        listener who started playing at the first."""
        now = time.monotonic()
        for p in packets:
            if self.first_packet_at is None:
                self.first_packet_at = now
                if self.first_text_at is not None:
                    metrics.ttfa_seconds.observe(now - self.first_text_at)
                if self.started_at is not None:
                    metrics.compute_fpl_seconds.observe(now - self.started_at)
            elif now - (self.first_packet_at + p.start_s) > 0:
                metrics.underruns_total.inc()
            self.sink(AudioPacket(self.packet_seq, p.data, p.start_s, p.duration_s))
            self.packet_seq += 1
            self.audio_sent_s = p.start_s + p.duration_s
        self.frames_sent += frames
        self.send_words(final=False)

    def send_words(self, final: bool) -> None:
        """Send the timings of the words whose audio is all sent, in order; `final`: the
        audio has ended, and so has a word still open."""
        words = self.words
        while self._first_unsent_word < len(words) and words[self._first_unsent_word].sent:
            self._first_unsent_word += 1
        for i in range(self._first_unsent_word, len(words)):
            w = words[i]
            if w.sent or w.start_frame is None:
                continue
            end = w.end_frame if w.end_frame is not None else (self.frames_done if final else None)
            if end is None or end > self.frames_sent:
                break
            w.sent = True
            self.sink(WordTiming(w.text, frames_to_s(w.start_frame), frames_to_s(end)))

    def summary(self, cancelled: bool) -> Summary:
        """What the session spoke, for its last event."""
        unspoken = self.unspoken_words()
        first_text, started, first_packet = self.first_text_at, self.started_at, self.first_packet_at
        return Summary(
            frames=self.frames_done,
            audio_s=self.audio_sent_s,
            ttfa_s=None if first_packet is None or first_text is None else first_packet - first_text,
            lookahead_wait_s=None if started is None or first_text is None else started - first_text,
            compute_fpl_s=None if first_packet is None or started is None else first_packet - started,
            cancelled=cancelled,
            spoken_text=self.spoken_text(),
            all_words_spoken=not unspoken,
            unspoken_words=tuple(unspoken),
        )

    def audio_ahead_s(self, now: float) -> float:
        """Seconds of audio the client has buffered (sent minus played:
        `SessionTable.audio_ahead_s`)."""
        return self._table.audio_ahead_s(self._row, now)


def frames_to_s(frames: int) -> float:
    return frames / FRAME_RATE
