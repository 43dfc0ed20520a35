"""The boundary between the gRPC layer (service.py) and the decode engine (engine.py).

The service validates client messages into a `SessionConfig`, opens a session on the
engine and forwards text to it; the engine thread calls the session's `sink` with
`SessionEvent`s. The sink is called from the engine thread: the service hands events to
its event loop with `loop.call_soon_threadsafe`. No tensors cross this boundary.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Union

SAMPLE_RATES = (8000, 16000, 24000, 48000)
# the sampling temperatures of `SessionConfig`: 0 (greedy) or in [MIN, MAX]. Below MIN,
# logits / T could overflow float32 (and it is greedy in all but name); above MAX a
# distribution is all but flat
TEMPERATURES = ("grapheme_temperature", "first_codebook_temperature", "acoustic_temperature")
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 100.0


class Encoding(enum.Enum):
    PCM16 = "pcm16"  # signed 16-bit little-endian
    MULAW = "mulaw"  # G.711 mu-law, 8 bit


class ConfigError(ValueError):
    """A session or server setting is invalid; the message is safe to show a client."""


class LimitError(ConfigError):
    """A per-session quota is used up (RESOURCE_EXHAUSTED), e.g. total text."""


class CapacityError(RuntimeError):
    """The engine has no free session slot (RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class ChunkingConfig:
    # one word a chunk: this chunker at 2-4 or 2-3 words reads no better with the shipped
    # model (173 test clips, two seeds: WER -1.1 to -1.6 points, within noise; docs/eval.md,
    # "Chunks of one word"), and the lookahead (nf chunks) is nf words, so speech starts sooner
    min_words: int = 1
    max_words: int = 1
    # a pending partial chunk is released this long after its last word arrived
    timer_ms: int = 300
    flush_on_punctuation: bool = True
    # the first chunk is released at this many words (None: min_words), so speech can start sooner
    first_max_words: Optional[int] = None
    # while the speech waits for text (before it starts, or when the text ran dry), pending
    # words go out as a chunk once min_words are there, not at max_words: the wait is what
    # the listener hears (a 2-4-word chunk is what training sees either way)
    release_when_waiting: bool = True

    @property
    def first_chunk_words(self) -> int:
        return self.min_words if self.first_max_words is None else self.first_max_words

    def validate(self) -> None:
        if not 1 <= self.min_words <= self.max_words <= 16:
            raise ConfigError("chunking: need 1 <= min_words <= max_words <= 16")
        if not 1 <= self.first_chunk_words <= self.max_words:
            raise ConfigError("chunking: need 1 <= first_max_words <= max_words")
        if not 0 <= self.timer_ms <= 10_000:
            raise ConfigError("chunking: timer_ms must be in [0, 10000]")


@dataclass(frozen=True)
class SessionConfig:
    voice_id: str = ""
    sample_rate: int = 24000
    encoding: Encoding = Encoding.PCM16
    packet_ms: int = 80
    # the first packet, the ramp after it and packets of a text that ran dry may be this
    # short (not shorter, but the last): the first audio needs only this much decoded
    min_packet_ms: int = 20
    n_past_chunks: int = 4  # np; -1 means unbounded (offline mode)
    n_future_chunks: int = 2  # nf
    # start policy: chunk k is spoken once min(nf, start_future_chunks + k) chunks after it
    # arrived (k: the chunk of the audio; EngineSession.lookahead_ready). 0 starts on the
    # first chunk. It once let a fast-speaking model catch up with the text and its
    # listener run dry at the start (tests/test_overload.py, when k counted at the
    # graphemes, 8 frames ahead of the audio); since k counts at the audio it did not, and
    # it cut TTFA by ~40 % at the same underruns (docs/loadtest.md, "Measured choices")
    start_future_chunks: int = 0
    # the longest the text waits for more text: once none came for this long while the
    # speech waits for text (its lookahead, or a word still being written), the text
    # held is spoken without more lookahead (EngineSession.buffer_deadline). An LLM's
    # pauses between tokens are far shorter; a reply that stopped without end of input
    # would otherwise be held until the idle timeout. 0: no limit (the paper's policy)
    max_buffer_delay_ms: int = 500
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    guidance_lambda: float = 1.0  # math.inf = hard guidance
    # acoustic codes: top-k of every codebook (~1,024 codes each)
    top_k: int = 20
    # graphemes (~40 symbols) get their own, small k: k = 20 left them nearly unrestricted
    # (with the true audio forced, the collapsed stream's CER was 71 % sampled at k = 20
    # against 54 % greedy). The paper samples graphemes with k in {2, 3, 5} (Table 10);
    # 3 with lambda 2 gave its best WER
    grapheme_top_k: int = 3
    # softmax temperatures (logits / T before guidance and top-k); 0 = greedy, the most
    # likely token after guidance. Codebook 1 (the coarsest, which carries most of the
    # content) has its own; codebooks 2-8 share `acoustic_temperature`. Codebook 1 at 0.5
    # against 1: WER 110.7 against 120.4 % on 105 test clips (docs/eval.md, "Sampling")
    grapheme_temperature: float = 1.0
    first_codebook_temperature: float = 0.5
    acoustic_temperature: float = 1.0
    seed: Optional[int] = None
    # client timestamps are positions on the speech timeline, not arrival times
    timestamps_are_speech_time: bool = False

    def validate(self) -> "SessionConfig":
        if self.sample_rate not in SAMPLE_RATES:
            raise ConfigError(f"sample_rate must be one of {SAMPLE_RATES}, got {self.sample_rate}")
        if not isinstance(self.encoding, Encoding):
            raise ConfigError(f"unknown encoding {self.encoding!r}")
        if not 20 <= self.packet_ms <= 1000:
            raise ConfigError("packet_ms must be in [20, 1000]")
        if not 10 <= self.min_packet_ms <= self.packet_ms:
            raise ConfigError(f"min_packet_ms must be in [10, packet_ms={self.packet_ms}]")
        if not (self.n_past_chunks == -1 or 0 <= self.n_past_chunks <= 64):
            raise ConfigError("n_past_chunks must be -1 (unbounded) or in [0, 64]")
        if not 0 <= self.n_future_chunks <= 8:
            raise ConfigError("n_future_chunks must be in [0, 8]")
        if not 0 <= self.start_future_chunks <= 8:  # above nf it is nf (the paper's policy)
            raise ConfigError("start_future_chunks must be in [0, 8]")
        if not 0 <= self.max_buffer_delay_ms <= 10_000:
            raise ConfigError(f"max_buffer_delay_ms must be in [0, 10000] (0 = no limit), got {self.max_buffer_delay_ms}")
        if not self.guidance_lambda >= 0.0:
            raise ConfigError("guidance_lambda must be >= 0 (inf for hard guidance)")
        if not 1 <= self.top_k <= 1024:
            raise ConfigError("top_k must be in [1, 1024]")
        if not 1 <= self.grapheme_top_k <= 1024:
            raise ConfigError("grapheme_top_k must be in [1, 1024]")
        for name in TEMPERATURES:
            t = getattr(self, name)
            if not (t == 0.0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):  # NaN fails too
                raise ConfigError(
                    f"{name} must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {t}")
        self.chunking.validate()
        return self

    def replace(self, **kw) -> "SessionConfig":
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class Started:
    session_id: str
    config: SessionConfig  # the effective config (voice_id resolved)


@dataclass(frozen=True)
class AudioPacket:
    seq: int
    data: bytes  # encoded in the session's encoding and sample rate
    start_s: float  # offset of the packet's first sample on the session's audio timeline
    duration_s: float


@dataclass(frozen=True)
class WordTiming:
    word: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Summary:
    frames: int
    audio_s: float
    ttfa_s: Optional[float]  # first text received -> first packet sent
    lookahead_wait_s: Optional[float]
    compute_fpl_s: Optional[float]
    cancelled: bool
    spoken_text: str  # words whose speech started in the audio sent
    # whether every word of the text received was spoken to its end (None: not reported,
    # e.g. by an older server); the words that were not, in order: the last words of the
    # text, a word cut off mid-way included, and where they were, words the model cannot
    # say (another script). A session that completed with words of its alphabet unspoken
    # was ended by the server's runaway guard
    all_words_spoken: Optional[bool] = None
    unspoken_words: tuple[str, ...] = ()


@dataclass(frozen=True)
class Finished:
    summary: Summary
    # set when the service ended the session (`SessionHandle.stop`): the status that
    # follows the summary
    error: Optional[Failed] = None


@dataclass(frozen=True)
class Failed:
    code: str  # a grpc.StatusCode name, e.g. "INTERNAL"
    message: str


SessionEvent = Union[AudioPacket, WordTiming, Finished, Failed]
Sink = Callable[[SessionEvent], None]


class SessionHandle(Protocol):
    """What the service holds for one open session; every method is thread-safe."""

    session_id: str

    def push_text(self, text: str, client_time_s: Optional[float] = None, flush: bool = False) -> None:
        """Append a piece of text (any granularity). Raises ConfigError on bad input
        (e.g. non-monotonic timestamps, text after end of input, oversize text)."""

    def end_input(self) -> None: ...

    def cancel(self) -> None:
        """Stop generating; the engine sends Finished(cancelled=True) with what was spoken."""

    def stop(self, code: str, message: str) -> None:
        """The service ends the session with this status (e.g. its text limit, a
        timeout): generate nothing more; the engine sends Finished(summary of what was
        spoken, error=Failed(code, message)) after the text pushed before it."""

    def close(self, outcome: str = "disconnected") -> None:
        """The stream is over (client gone, or ended by the service, outcome "failed"):
        free the slot at the next step, send nothing more. Idempotent."""


class Voice(Protocol):
    voice_id: str


class EngineAPI(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...

    @property
    def active_sessions(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    @property
    def builtin_voices(self) -> "dict[str, object]":
        """Voice id -> 24 kHz float32 reference audio shipped with the model (read-only)."""

    def open_session(self, config: SessionConfig, voice: "Voice", sink: Sink) -> SessionHandle:
        """Admit a session (raises CapacityError when full)."""

    def make_voice(self, voice_id: str, audio: "list[float] | bytes", sample_rate: int) -> "Voice":
        """Encode reference audio (float32 mono samples) into an enrollment; blocking,
        call it from an executor."""


class StateError(RuntimeError):
    """A message arrived in a state that does not accept it (FAILED_PRECONDITION),
    e.g. text after end of input."""


@dataclass(frozen=True)
class VoiceInfo:
    voice_id: str
    builtin: bool
    reference_s: float = 0.0  # seconds of reference audio (registered voices)
    created_unix_ms: int = 0
