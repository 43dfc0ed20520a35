"""Synthesising one planned utterance: audio file + manifest record."""
from __future__ import annotations

import math
import os
import random
import wave

import numpy as np
from scipy.signal import resample_poly

from livespeech.models.graphemes import align_words_to_frames

from .align import AlignError, espeak_phones, phone_timeline, tokenize, word_spans
from .plan import Job, audio_relpath, n_frames_for, simulate_chunks, spans_to_frames
from .voices import Voice

SAMPLE_RATE = 24000
LEAD_PAD_S = (0.02, 0.15)  # silence added before the speech (eSpeak starts at sample 0)
TRAIL_PAD_S = (0.08, 0.25)  # and after it


class Rejected(Exception):
    """The utterance cannot be made (bad events, too long); recorded, not retried."""


def write_wav(path: str, pcm: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    """Write 16-bit mono PCM atomically (temp file + rename): a killed build never leaves a
    truncated file under the final name."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with wave.open(tmp, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(np.ascontiguousarray(pcm, dtype="<i2").tobytes())
    os.replace(tmp, path)


def read_wav(path: str) -> tuple[np.ndarray, int]:
    with wave.open(path, "rb") as w:
        sr = w.getframerate()
        data = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    return data, sr


def resample_to_24k(x: np.ndarray, native_rate: int) -> np.ndarray:
    """int16 audio at ``native_rate`` (eSpeak 22,050, Flite 16,000) -> 24 kHz."""
    if native_rate == SAMPLE_RATE:
        return x.astype(np.int16)
    g = math.gcd(SAMPLE_RATE, native_rate)
    y = resample_poly(x.astype(np.float64), SAMPLE_RATE // g, native_rate // g)
    return np.clip(np.round(y), -32768, 32767).astype(np.int16)


Spans = list[tuple[int, int]]
Phones = list[tuple[str, int, int]]


def speak(voice: Voice, text: str, tokens, engine=None) -> tuple[np.ndarray, int, Spans, Phones]:
    """(int16 audio, its sample rate, one (start, end) sample span per token, the spoken
    phones (name, start, end) without pauses) from the voice's synthesiser. Timings come
    from the very call that produced the audio (eSpeak NG's samples depend on what its
    process synthesised before: docs/corpus.md). Raises AlignError."""
    if voice.engine == "flite":
        from . import flite

        return flite.speak(voice.variant, 100.0 / voice.rate, text, tokens)
    if voice.engine == "piper":
        from . import piper

        return piper.speak(voice.rate / 100.0, text, tokens)
    if engine is None:
        from . import espeak

        engine = espeak.get()
    engine.set_voice(voice.accent, voice.variant, voice.rate, voice.pitch, voice.range)
    syn = engine.synth(text)
    if len(syn.audio) == 0:
        raise AlignError("no audio")
    n = len(syn.audio)
    return (syn.audio, syn.sample_rate, word_spans(text, syn.events, n, engine.phonemes, tokens),
            espeak_phones(syn.events, n))


def synthesize(job: Job, voice: Voice, out_dir: str, engine=None, max_seconds: float = 20.0) -> dict:
    """Speak ``job`` with ``voice``, write its WAV under ``out_dir``, return its manifest
    record. Raises Rejected."""
    tokens = tokenize(job.text)
    try:
        audio, native, spans, phones = speak(voice, job.text, tokens, engine)
    except AlignError as e:
        raise Rejected(f"align: {e}") from None
    rng = random.Random(job.seed)
    lead = int(round(rng.uniform(*LEAD_PAD_S) * native))
    trail = int(round(rng.uniform(*TRAIL_PAD_S) * native))
    x = np.concatenate([np.zeros(lead, np.int16), audio, np.zeros(trail, np.int16)])
    pcm = resample_to_24k(x, native)
    duration = round(len(pcm) / SAMPLE_RATE, 5)  # as stored; n_frames derives from it
    if duration > max_seconds:
        raise Rejected(f"too long ({duration:.1f} s)")
    # sample positions at the native rate -> seconds; identical in the 24 kHz file
    spans_s = [((a + lead) / native, (b + lead) / native) for a, b in spans]
    words = [[t.text, round(a, 5), round(min(b, duration), 5)] for t, (a, b) in zip(tokens, spans_s)]
    timeline = phone_timeline([(nm, a + lead, b + lead) for nm, a, b in phones], len(x))
    phones_s = [[nm, round(a / native, 4), round(b / native, 4)] for nm, a, b in timeline]
    n_frames = n_frames_for(duration)
    frames = spans_to_frames([(w[1], w[2]) for w in words], n_frames)
    graphemes = align_words_to_frames([t.text for t in tokens], frames, n_frames)
    chunks = simulate_chunks([a for a, _ in frames], rng)
    rel = audio_relpath(job.id)
    write_wav(os.path.join(out_dir, rel), pcm)
    return {
        "id": job.id,
        "split": job.split,
        "voice": voice.id,
        "heldout_voice": bool(voice.heldout),
        "source": job.source,
        "text": job.text,
        "words": words,
        "audio": rel,
        "duration_s": duration,
        "graphemes": graphemes,
        "chunks": chunks,
        "phones": phones_s,
        "engine": voice.engine,
        "sentence": job.sentence,
    }
