"""The voice catalog: eSpeak NG accent x variant x (rate, pitch, range) combinations,
and optionally the Flite voices at a few speeds.

A *voice* is one fixed set of synthesiser parameters. For each usable accent x variant
combination the catalog draws ``per_combo`` (rate, pitch, range) settings from a seeded
RNG, so the catalog is deterministic for a seed and an eSpeak installation. A Flite
voice's ``variant`` is its name and its ``rate`` a percentage of its own speed (eSpeak:
words per minute).

Held-out voices: a fixed share of the *variants* (timbres) is held out entirely: every
voice built on such a variant, in every accent and setting, is never used for training
and appears only in dev/test (zero-shot speaker tests). Holding out whole variants rather
than single parameter draws makes sure no near-identical voice leaks into training.
"""
from __future__ import annotations

import hashlib
import os
import random
import re
from dataclasses import asdict, dataclass

import numpy as np

# whispered variants have no pitch: not useful as TTS training voices
EXCLUDED_VARIANTS = frozenset({"whisper", "whisperf"})
# variants whose file adds an echo louder than this (percent; some set 500-10000) are
# sound effects (robots, "Demonic"): the echo smears speech across word boundaries
MAX_ECHO_AMPLITUDE = 100

RATE_RANGE = (140, 220)  # words per minute (eSpeak default 175)
PITCH_RANGE = (20, 80)  # 0-100 (default 50)
INTONATION_RANGE = (25, 90)  # espeakRANGE, 0-100 (default 50); 0 is monotone

PROBE_TEXT = "The quick brown fox jumps over the lazy dog, and then it has been sleeping all day."


@dataclass(frozen=True)
class Voice:
    id: str
    engine: str
    accent: str
    variant: str
    rate: int
    pitch: int
    range: int
    heldout: bool

    @property
    def timbre(self) -> str:
        return timbre(self.engine, self.variant)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Voice":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def timbre(engine: str, variant: str) -> str:
    """What held-out voices are chosen by: an eSpeak variant's name, 'flite-<voice>'."""
    return variant if engine == "espeak" else f"{engine}-{variant}"


def _voice_rng(seed: int, combo: str, k: int) -> random.Random:
    """The k-th parameter draw of a combination: the same for a seed whatever else the
    catalog holds."""
    h = hashlib.sha256(f"{seed}:{combo}:{k}".encode()).digest()
    return random.Random(int.from_bytes(h[:8], "big"))


def voice_id(accent: str, variant: str, k: int) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", f"{accent}-{variant}".lower()).strip("-")
    return f"espeak-{slug}-{k}"


def variant_echo(data_dir: str | None, variant: str) -> int:
    """The echo amplitude a variant file sets (0 when none)."""
    if not data_dir:
        return 0
    try:
        with open(os.path.join(data_dir, "voices", "!v", variant), encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[0] == "echo":
                    return int(parts[2])
    except (OSError, ValueError):
        pass
    return 0


def usable_variants(engine) -> list[str]:
    """All variants but the whispered ones and the echo effects."""
    d = engine.data_dir()
    return [v for v in engine.variants()
            if v not in EXCLUDED_VARIANTS and variant_echo(d, v) <= MAX_ECHO_AMPLITUDE]


def choose_heldout_variants(variants: list[str], frac: float, seed: int) -> set[str]:
    """A deterministic ``frac`` share of the variants (at least one when there are two or more)."""
    variants = sorted(variants)
    if frac <= 0 or len(variants) < 2:
        return set()
    n = max(1, int(round(frac * len(variants))))
    n = min(n, len(variants) - 1)
    rng = random.Random(f"{seed}:heldout")
    return set(rng.sample(variants, n))


def probe_combo(engine, accent: str, variant: str) -> str | None:
    """None when the combination speaks the probe sentence with good events, else why not."""
    from .align import AlignError, word_spans

    try:
        engine.set_voice(accent, variant)
        syn = engine.synth(PROBE_TEXT)
    except (ValueError, RuntimeError) as e:
        return str(e)
    a = syn.audio.astype(np.float32) / 32768.0
    if len(a) < 0.5 * syn.sample_rate:
        return "too short"
    rms = float(np.sqrt(np.mean(a * a)))
    if rms < 0.01:
        return f"too quiet (rms {rms:.4f})"
    if float(np.mean(np.abs(syn.audio.astype(np.int32)) >= 32767)) > 0.001:
        return "clips"
    try:
        word_spans(PROBE_TEXT, syn.events, len(syn.audio), engine.phonemes)
    except AlignError as e:
        return f"events: {e}"
    return None


def build_catalog(
    seed: int = 0,
    per_combo: int = 2,
    heldout_frac: float = 0.1,
    accents: list[str] | None = None,
    variants: list[str] | None = None,
    engine=None,
    probe: bool = True,
) -> tuple[list[Voice], dict[str, str]]:
    """(voices, rejected combos with the reason). Needs eSpeak NG."""
    from . import espeak

    engine = engine or espeak.get()
    all_accents = engine.english_accents()
    all_variants = usable_variants(engine)
    if accents:
        unknown = sorted(set(accents) - set(all_accents))
        if unknown:
            raise ValueError(f"unknown accents {unknown}; available: {all_accents}")
        use_accents = sorted(accents)
    else:
        use_accents = all_accents
    if variants:
        unknown = sorted(set(variants) - set(engine.variants()))
        if unknown:
            raise ValueError(f"unknown variants {unknown}")
        use_variants = sorted(variants)
    else:
        use_variants = all_variants
    heldout = choose_heldout_variants(use_variants, heldout_frac, seed)
    voices: list[Voice] = []
    rejected: dict[str, str] = {}
    for accent in use_accents:
        for variant in use_variants:
            if probe:
                why = probe_combo(engine, accent, variant)
                if why is not None:
                    rejected[f"{accent}+{variant}"] = why
                    continue
            for k in range(per_combo):
                rng = _voice_rng(seed, f"{accent}+{variant}", k)
                voices.append(Voice(
                    id=voice_id(accent, variant, k),
                    engine="espeak",
                    accent=accent,
                    variant=variant,
                    rate=rng.randint(*RATE_RANGE),
                    pitch=rng.randint(*PITCH_RANGE),
                    range=rng.randint(*INTONATION_RANGE),
                    heldout=variant in heldout,
                ))
    return voices, rejected


SPEED_RANGE = (85, 118)  # percent of the voice's own speed (Voice.rate for Flite and Piper)


def _speed_catalog(engine: str, names: list[str], speak, seed: int, per_voice: int,
                   heldout_frac: float, probe: bool) -> tuple[list[Voice], dict[str, str]]:
    """Each of a synthesiser's voices at ``per_voice`` seeded speeds; ``speak(name,
    speed, text, tokens)`` probes a voice. Held out as for eSpeak: whole voices
    (timbres), at least one of them when there are two or more."""
    from .align import AlignError, tokenize

    heldout = choose_heldout_variants(names, heldout_frac, seed)
    voices: list[Voice] = []
    rejected: dict[str, str] = {}
    for name in names:
        if probe:
            try:
                speak(name, 1.0, PROBE_TEXT, tokenize(PROBE_TEXT))
            except AlignError as e:
                rejected[f"{engine}+{name}"] = str(e)
                continue
        for k in range(per_voice):
            rng = _voice_rng(seed, f"{engine}+{name}", k)
            voices.append(Voice(id=f"{engine}-{name}-{k}", engine=engine, accent="en", variant=name,
                                rate=rng.randint(*SPEED_RANGE), pitch=0, range=0,
                                heldout=name in heldout))
    return voices, rejected


def build_flite_catalog(seed: int = 0, per_voice: int = 2, heldout_frac: float = 0.1,
                        probe: bool = True) -> tuple[list[Voice], dict[str, str]]:
    """(voices, rejected voices with the reason): the Flite voices at seeded speeds."""
    from . import flite

    return _speed_catalog("flite", flite.voices(), lambda name, speed, text, tokens: flite.speak(
        name, 1.0 / speed, text, tokens), seed, per_voice, heldout_frac, probe)


def build_piper_catalog(seed: int = 0, per_voice: int = 2, heldout_frac: float = 0.1,
                        probe: bool = True) -> tuple[list[Voice], dict[str, str]]:
    """The Piper voice at seeded speeds. One speaker: never held out (there would be
    none left to train on), so held-out tests stay with eSpeak and Flite."""
    from . import piper

    return _speed_catalog("piper", [piper.VOICE], lambda name, speed, text, tokens: piper.speak(
        speed, text, tokens), seed, per_voice, heldout_frac, probe)


# synthesiser -> catalog builder(seed, per_voice, heldout_frac)
CATALOGS = {"espeak": build_catalog, "flite": build_flite_catalog, "piper": build_piper_catalog}
