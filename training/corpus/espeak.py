"""eSpeak NG through its C API (ctypes): audio and exact word/phoneme events from one call.

Only the raw synthesiser lives here; turning the events into word spans is done by the
pure functions in :mod:`livespeech.training.corpus.align`.

The library keeps global state, so there is one :class:`ESpeak` per process (workers
each create their own). Synthesis uses ``AUDIO_OUTPUT_SYNCHRONOUS``: ``espeak_Synth``
returns after the callback has received every sample and event, and the events' ``sample``
field is the index of the output sample at which the event happens (22,050 Hz).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from dataclasses import dataclass, field

import numpy as np

LIBRARY_NAMES = ("libespeak-ng.so.1", "libespeak-ng.so", "libespeak-ng.dylib")

# espeak_AUDIO_OUTPUT
AUDIO_OUTPUT_SYNCHRONOUS = 2
# espeak_Initialize options
INITIALIZE_PHONEME_EVENTS = 0x0001
INITIALIZE_DONT_EXIT = 0x8000
# espeak_EVENT_TYPE
EVENT_LIST_TERMINATED = 0
EVENT_WORD = 1
EVENT_SENTENCE = 2
EVENT_MARK = 3
EVENT_PLAY = 4
EVENT_END = 5
EVENT_MSG_TERMINATED = 6
EVENT_PHONEME = 7
EVENT_SAMPLERATE = 8
# espeak_POSITION_TYPE
POS_CHARACTER = 1
# flags
CHARS_UTF8 = 1
# espeak_PARAMETER
RATE, VOLUME, PITCH, RANGE, PUNCTUATION, CAPITALS, WORDGAP = 1, 2, 3, 4, 5, 6, 7

NATIVE_RATE = 22050


class _Voice(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("languages", ctypes.c_char_p),
        ("identifier", ctypes.c_char_p),
        ("gender", ctypes.c_ubyte),
        ("age", ctypes.c_ubyte),
        ("variant", ctypes.c_ubyte),
        ("xx1", ctypes.c_ubyte),
        ("score", ctypes.c_int),
        ("spare", ctypes.c_void_p),
    ]


class _EventId(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p), ("string", ctypes.c_char * 8)]


class _Event(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),
        ("length", ctypes.c_int),
        ("audio_position", ctypes.c_int),
        ("sample", ctypes.c_int),
        ("user_data", ctypes.c_void_p),
        ("id", _EventId),
    ]


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))


@dataclass
class Event:
    """One synthesiser event. ``pos`` is the 0-based character offset into the text."""

    kind: str  # "word" | "phoneme" | "end" | "sentence"
    pos: int
    length: int
    sample: int
    name: str = ""  # phoneme mnemonic for phoneme events

    def to_list(self) -> list:
        return [self.kind, self.pos, self.length, self.sample, self.name]

    @classmethod
    def from_list(cls, x) -> "Event":
        return cls(x[0], int(x[1]), int(x[2]), int(x[3]), x[4] if len(x) > 4 else "")


@dataclass
class Synthesis:
    audio: np.ndarray  # int16, NATIVE_RATE
    events: list[Event] = field(default_factory=list)
    sample_rate: int = NATIVE_RATE


def find_library() -> str | None:
    """Path or soname of libespeak-ng, or None when it cannot be loaded."""
    names = list(LIBRARY_NAMES)
    found = ctypes.util.find_library("espeak-ng")
    if found:
        names.insert(0, found)
    for name in names:
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    return None


def available() -> bool:
    return find_library() is not None


_lock = threading.Lock()
_instance: "ESpeak | None" = None


def get() -> "ESpeak":
    """The process-wide eSpeak instance (the C library is a singleton)."""
    global _instance
    with _lock:
        if _instance is None or _instance.pid != os.getpid():
            _instance = ESpeak()
        return _instance


class ESpeak:
    def __init__(self, library: str | None = None, data_path: str | None = None):
        name = library or find_library()
        if name is None:
            raise OSError("libespeak-ng not found (Debian: apt-get install libespeak-ng1 espeak-ng)")
        self.pid = os.getpid()
        self.lib = lib = ctypes.CDLL(name)
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetSynthCallback.argtypes = [_CALLBACK]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_SetParameter.restype = ctypes.c_int
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
            ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
        ]
        lib.espeak_Synth.restype = ctypes.c_int
        lib.espeak_ListVoices.argtypes = [ctypes.c_void_p]
        lib.espeak_ListVoices.restype = ctypes.POINTER(ctypes.POINTER(_Voice))
        lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]
        lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        path = data_path.encode() if data_path else None
        self.sample_rate = lib.espeak_Initialize(
            AUDIO_OUTPUT_SYNCHRONOUS, 0, path, INITIALIZE_PHONEME_EVENTS | INITIALIZE_DONT_EXIT
        )
        if self.sample_rate <= 0:
            raise OSError(f"espeak_Initialize failed ({self.sample_rate})")
        self._chunks: list[bytes] = []
        self._events: list[Event] = []
        self._offsets: list[int] = []  # byte offset of each character (to map positions)
        self._cb = _CALLBACK(self._callback)  # keep a reference: the C side holds it
        lib.espeak_SetSynthCallback(self._cb)
        self._voice: tuple | None = None
        self._phoneme_cache: dict[tuple[str, str], list[str]] = {}
        self._lang: str | None = None

    # -- voices -------------------------------------------------------------------
    def list_voices(self) -> list[dict]:
        out = []
        arr = self.lib.espeak_ListVoices(None)
        i = 0
        while arr[i]:
            v = arr[i].contents
            langs = v.languages or b""
            out.append({
                "name": (v.name or b"").decode(errors="replace"),
                "language": langs[1:].split(b"\0")[0].decode(errors="replace"),
                "identifier": (v.identifier or b"").decode(errors="replace"),
                "gender": int(v.gender),
            })
            i += 1
        return out

    def english_accents(self) -> list[str]:
        """Voice names of the English accents, as SetVoiceByName takes them ("en-US", "en-GB-scotland")."""
        names = {v["identifier"].rsplit("/", 1)[-1] for v in self.list_voices()
                 if v["language"].split("-")[0] == "en"}
        return sorted(names)

    def variants(self) -> list[str]:
        """Names of the voice variant files (``voices/!v``), usable as ``lang+name``."""
        path = self.data_dir()
        if path is None:
            return []
        vdir = os.path.join(path, "voices", "!v")
        try:
            return sorted(os.listdir(vdir))
        except OSError:
            return []

    def data_dir(self) -> str | None:
        for cand in (
            os.environ.get("ESPEAK_DATA_PATH"),
            "/usr/lib/x86_64-linux-gnu/espeak-ng-data",
            "/usr/lib/aarch64-linux-gnu/espeak-ng-data",
            "/usr/share/espeak-ng-data",
            "/usr/local/share/espeak-ng-data",
        ):
            if cand and os.path.isdir(os.path.join(cand, "voices")):
                return cand
        return None

    def set_voice(self, accent: str, variant: str | None = None, rate: int = 175,
                  pitch: int = 50, pitch_range: int = 50, word_gap: int = 0) -> None:
        key = (accent, variant, rate, pitch, pitch_range, word_gap)
        if key == self._voice:
            return
        name = accent + (f"+{variant}" if variant else "")
        if self.lib.espeak_SetVoiceByName(name.encode()) != 0:
            raise ValueError(f"eSpeak voice {name!r} not found")
        # parameters are reset by SetVoiceByName: set them after it
        self.lib.espeak_SetParameter(RATE, int(rate), 0)
        self.lib.espeak_SetParameter(PITCH, int(pitch), 0)
        self.lib.espeak_SetParameter(RANGE, int(pitch_range), 0)
        self.lib.espeak_SetParameter(WORDGAP, int(word_gap), 0)
        self.lib.espeak_SetParameter(PUNCTUATION, 0, 0)
        self._voice = key
        self._lang = accent

    # -- synthesis ----------------------------------------------------------------
    def _callback(self, wav, n, events):  # called from inside espeak_Synth
        if n > 0:
            self._chunks.append(ctypes.string_at(wav, n * 2))
        j = 0
        while True:
            e = events[j]
            t = e.type
            if t == EVENT_LIST_TERMINATED:
                break
            if t in (EVENT_WORD, EVENT_PHONEME, EVENT_END, EVENT_SENTENCE):
                kind = {EVENT_WORD: "word", EVENT_PHONEME: "phoneme", EVENT_END: "end",
                        EVENT_SENTENCE: "sentence"}[t]
                name = e.id.string.decode("utf-8", "replace") if t == EVENT_PHONEME else ""
                self._events.append(Event(kind, self._char_index(e.text_position - 1), int(e.length),
                                          int(e.sample), name))
            j += 1
        return 0

    def _char_index(self, pos: int) -> int:
        """eSpeak positions count characters of the UTF-8 text (1-based)."""
        return max(0, pos)

    def synth(self, text: str) -> Synthesis:
        """Speak ``text`` with the current voice: int16 audio and the events of that same call."""
        self._chunks = []
        self._events = []
        data = text.encode("utf-8") + b"\0"
        buf = ctypes.create_string_buffer(data)
        err = self.lib.espeak_Synth(buf, len(data), 0, POS_CHARACTER, 0, CHARS_UTF8, None, None)
        if err != 0:
            raise RuntimeError(f"espeak_Synth failed ({err})")
        audio = np.frombuffer(b"".join(self._chunks), dtype=np.int16).copy()
        events = self._events
        self._chunks, self._events = [], []
        return Synthesis(audio, events, self.sample_rate)

    def phonemes(self, word: str) -> list[str]:
        """The phoneme mnemonics of ``word`` said alone, in the current accent (cached)."""
        key = (self._lang or "", word.lower())
        hit = self._phoneme_cache.get(key)
        if hit is not None:
            return hit
        buf = ctypes.create_string_buffer(word.encode("utf-8") + b"\0")
        ptr = ctypes.c_void_p(ctypes.addressof(buf))
        parts: list[str] = []
        guard = 0
        while ptr.value and guard < 64:
            res = self.lib.espeak_TextToPhonemes(ctypes.byref(ptr), CHARS_UTF8, ord(" ") << 8)
            if res:
                parts.extend(res.decode("utf-8", "replace").split())
            guard += 1
        out = [p.replace("'", "").replace(",", "") for p in parts]
        out = [p for p in out if p and not p.startswith("_")]
        if len(self._phoneme_cache) > 200_000:
            self._phoneme_cache.clear()
        self._phoneme_cache[key] = out
        return out
