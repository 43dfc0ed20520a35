"""Flite voices for the corpus (Debian `flite`: awb, rms, slt, kal16; 16 kHz).

Flite reports phoneme end times for the whole sentence (`-psdur`) but no word
boundaries, so the written words are also said alone (`-ps`, one call for the sentence)
and the sentence's phonemes are aligned to those sequences (`align.spans_from_phonemes`).
Flite runs as a subprocess per call (~25 ms).
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile

import numpy as np

from .align import AlignError, Token, speakable, spans_from_phonemes
from .synth import read_wav

# kal (8 kHz) is kal16 at a lower rate; awb_time is a talking clock (limited domain)
VOICES = ("awb", "kal16", "rms", "slt")
PAUSE = "pau"


def binary() -> str | None:
    return os.environ.get("LIVESPEECH_FLITE") or shutil.which("flite")


def available() -> bool:
    return binary() is not None


def voices() -> list[str]:
    """The catalog's voices this flite build has."""
    have = set(_run(["-lv"]).split(":", 1)[-1].split())
    return [v for v in VOICES if v in have]


def _run(args: list[str]) -> str:
    """Flite's stdout. A missing flite is a RuntimeError (a corpus with Flite voices
    cannot be made without it: the build stops); one call that fails or hangs is an
    AlignError (that utterance is rejected, the build goes on)."""
    exe = binary()
    if exe is None:
        raise RuntimeError("flite not found: apt-get install flite, or set LIVESPEECH_FLITE")
    try:
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise AlignError("flite took over 60 s") from None
    if r.returncode != 0:
        raise AlignError(f"flite failed ({r.returncode}): {r.stderr.strip()[:200]}")
    return r.stdout


@functools.lru_cache(maxsize=50_000)
def phonemes_alone(voice: str, word: str) -> tuple[str, ...]:
    """A word's phonemes said alone, pauses dropped."""
    return tuple(p for p in _run(["-voice", voice, "-t", word, "-ps", "-o", "none"]).split() if p != PAUSE)


def words_alone(voice: str, words: list[str]) -> list[tuple[str, ...]]:
    """Each word's phonemes said alone. One call for the sentence: the words as a comma
    list, which Flite says word by word with a pause between (the same phonemes as one
    call per word); per-word calls when the pauses do not split it into as many words."""
    groups, cur = [], []
    for p in _run(["-voice", voice, "-t", ", ".join(words), "-ps", "-o", "none"]).split():
        if p != PAUSE:
            cur.append(p)
        elif cur:
            groups.append(tuple(cur))
            cur = []
    if cur:
        groups.append(tuple(cur))
    return groups if len(groups) == len(words) else [phonemes_alone(voice, w) for w in words]


def parse_psdur(out: str) -> list[tuple[str, float]]:
    """`-psdur` output ("pau:0.215 ah:0.270 ...") -> [(phoneme, end time in s)]."""
    res = []
    for item in out.split():
        name, sep, end = item.rpartition(":")
        if sep:
            res.append((name, float(end)))
    return res


def speak(voice: str, stretch: float, text: str, tokens: list[Token]) -> tuple[np.ndarray, int, list[tuple[int, int]], list[tuple[str, int, int]]]:
    """(int16 audio, its sample rate, one (start, end) sample span per token, the spoken
    phones (name, start, end)).
    ``stretch`` > 1 speaks slower. Raises AlignError when the phonemes do not map."""
    with tempfile.TemporaryDirectory() as d:
        wav_path = os.path.join(d, "out.wav")
        out = _run(["-voice", voice, "--setf", f"duration_stretch={stretch:.3f}", "-t", text,
                    "-o", wav_path, "-psdur"])
        audio, rate = read_wav(wav_path)
    phones, start = [], 0.0
    for name, end in parse_psdur(out):
        phones.append((name, int(round(start * rate)), int(round(end * rate))))
        start = end
    speech = [(n, a, min(b, len(audio))) for n, a, b in phones if n != PAUSE]
    words = words_alone(voice, [speakable(t.text) for t in tokens])
    if not all(words):
        raise AlignError("a word has no phonemes said alone")
    return audio, rate, spans_from_phonemes(speech, words), speech
