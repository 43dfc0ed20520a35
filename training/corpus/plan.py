"""Deterministic planning: sentence splits, the utterance plan, frames and text chunks.

Pure functions (no synthesiser): everything an utterance is made of except its audio is
decided here from the seed, so a resumed build makes exactly the utterances a single
uninterrupted build would have made.
"""
from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Iterator, Sequence

from livespeech.models.graphemes import normalize_text

from .sentences import DEFAULT_WEIGHTS, Sentence
from .voices import Voice

FRAME_RATE = 75  # codec frames per second
SPLITS = ("train", "dev", "test")


def unit_hash(*parts) -> float:
    """A uniform number in [0, 1) from the parts (stable across runs and machines)."""
    h = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def sentence_split(text: str, seed: int, dev_frac: float, test_frac: float) -> str:
    """train/dev/test for a sentence, decided by its normalised text alone, so every
    utterance of a sentence (any voice, any source) lands in the same split."""
    u = unit_hash(seed, "split", normalize_text(text))
    if u < test_frac:
        return "test"
    if u < test_frac + dev_frac:
        return "dev"
    return "train"


def sentence_uid(text: str) -> str:
    return hashlib.sha1(normalize_text(text).encode()).hexdigest()[:12]


def n_frames_for(duration_s: float) -> int:
    """ceil(duration * 75), computed on the duration as stored in the manifest (rounded to
    5 decimals) so that any reader recomputing it gets the same number."""
    return int(math.ceil(duration_s * FRAME_RATE))


def spans_to_frames(spans_s: Sequence[tuple[float, float]], n_frames: int) -> list[tuple[int, int]]:
    """Word spans in seconds -> frame spans: rounded to the nearest frame, each word at
    least one frame, monotone (a word never starts before the previous one ends)."""
    out: list[tuple[int, int]] = []
    prev_end = 0
    for a, b in spans_s:
        fa = max(prev_end, int(round(a * FRAME_RATE)))
        fb = max(fa + 1, int(round(b * FRAME_RATE)))
        fa = min(fa, max(0, n_frames - 1))
        fb = min(fb, n_frames)
        out.append((fa, fb))
        prev_end = fb
    return out


def simulate_chunks(word_start_frames: Sequence[int], rng: random.Random,
                    lmin: int = 2, lmax: int = 4) -> list[list[int]]:
    """The paper's simulated text stream: the words cut into random chunks of lmin..lmax
    words (the last chunk may be shorter). Each chunk is [first_word, n_words, tau] with
    tau = the frame at which its first word starts; tau of chunk 0 is 0."""
    n = len(word_start_frames)
    out: list[list[int]] = []
    i = 0
    while i < n:
        k = min(rng.randint(lmin, lmax), n - i)
        tau = 0 if not out else int(word_start_frames[i])
        out.append([i, k, tau])
        i += k
    return out


@dataclass(frozen=True)
class Job:
    index: int
    id: str
    sentence: int  # index into the pool
    text: str
    source: str
    split: str
    voice: str
    heldout_voice: bool
    seed: int  # per-utterance randomness (chunking, padding)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def utterance_id(index: int) -> str:
    return f"u{index:08d}"


def audio_relpath(utt_id: str) -> str:
    n = int(utt_id[1:])
    return f"wav/{n // 1000:05d}/{utt_id}.wav"


def source_weights(pool: Sequence[Sentence], weights: dict[str, float] | None) -> dict[str, float]:
    """Weights of the sources present in the pool, renormalised; unknown sources weigh 1."""
    weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
    present = sorted({s.source for s in pool})
    w = {s: float(weights.get(s, 1.0)) for s in present}
    w = {s: x for s, x in w.items() if x > 0}
    total = sum(w.values())
    if total <= 0:
        raise ValueError("no sentence source with a positive weight")
    return {s: x / total for s, x in w.items()}


def _cumulative(weights: dict[str, float]) -> tuple[list[str], list[float]]:
    names = sorted(weights)
    cum, acc = [], 0.0
    for s in names:
        acc += weights[s]
        cum.append(acc)
    return names, cum


def _draw(names: list[str], cum: list[float], u: float) -> str:
    """The name whose cumulative-weight interval holds u (in [0, total))."""
    return next((s for s, c in zip(names, cum) if u < c), names[-1])


def plan(pool: Sequence[Sentence], splits: Sequence[str], voices: Sequence[Voice], seed: int,
         weights: dict[str, float] | None = None, heldout_eval_share: float = 0.5,
         engine_weights: dict[str, float] | None = None) -> Iterator[Job]:
    """The endless, deterministic sequence of utterances to synthesise.

    Utterance i draws a source by weight, then the next sentence of that source's seeded
    shuffle (cycling once a source is used up, with new voices). Train sentences get a
    training voice; dev/test sentences get a held-out voice with probability
    ``heldout_eval_share`` (when there are any), otherwise a training voice. With voices
    of several synthesisers, each utterance first draws its synthesiser by
    ``engine_weights`` (from a stream of its own: an eSpeak-only plan is unchanged).
    """
    w = source_weights(pool, weights)
    names, cum = _cumulative(w)
    acc = cum[-1]
    order: dict[str, list[int]] = {s: [] for s in names}
    for i, sent in enumerate(pool):
        if sent.source in order:
            order[sent.source].append(i)
    for s in names:
        random.Random(f"{seed}:order:{s}").shuffle(order[s])
    counters = {s: 0 for s in names}
    engines = sorted({v.engine for v in voices})
    if len(engines) > 1:
        ew = {e: float((engine_weights or {}).get(e, 1.0)) for e in engines}
        engine_names, engine_cum = _cumulative({e: x for e, x in ew.items() if x > 0})
    else:
        engine_names, engine_cum = engines, [1.0]
    train_by = {e: [v for v in voices if v.engine == e and not v.heldout] for e in engine_names}
    heldout_by = {e: [v for v in voices if v.engine == e and v.heldout] for e in engine_names}
    if not train_by or not all(train_by.values()):
        raise ValueError("no training voices")
    rng = random.Random(f"{seed}:plan")
    engine_rng = random.Random(f"{seed}:engine")
    i = 0
    while True:
        src = _draw(names, cum, rng.random() * acc)
        engine = engine_names[0] if len(engine_names) == 1 else _draw(
            engine_names, engine_cum, engine_rng.random() * engine_cum[-1])
        train_voices, heldout_voices = train_by[engine], heldout_by[engine]
        lst = order[src]
        idx = lst[counters[src] % len(lst)]
        counters[src] += 1
        split = splits[idx]
        r_voice = rng.random()
        r_pick = rng.random()
        job_seed = rng.getrandbits(32)
        if split != "train" and heldout_voices and r_voice < heldout_eval_share:
            voice = heldout_voices[int(r_pick * len(heldout_voices))]
        else:
            voice = train_voices[int(r_pick * len(train_voices))]
        uid = utterance_id(i)
        yield Job(i, uid, idx, pool[idx].text, pool[idx].source, split, voice.id, voice.heldout, job_seed)
        i += 1
