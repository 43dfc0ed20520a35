"""A tiny corpus-like example (no eSpeak): sine-tone "speech", fake words, graphemes and
chunks in the manifest format of training/corpus, for smoke runs and tests."""
from __future__ import annotations

import json
import math
import os
import random
from typing import Optional

import numpy as np

from livespeech.models import graphemes as G
from livespeech.models.config import FRAME_RATE, SAMPLE_RATE
from livespeech.models.loading import write_wav

from .dataset import codes_path

WORDS = ["hello", "world", "this", "is", "a", "small", "test", "of", "streaming", "speech", "with", "tones"]


def make_smoke_corpus(root: str, n_utts: int = 8, n_voices: int = 2, with_codes: bool = True,
                      n_q: int = 8, codebook_size: int = 1024, seed: int = 0) -> tuple[str, Optional[str]]:
    """Writes root/corpus (manifest + WAVs) and, with `with_codes`, root/codes (random
    int16 codes, as if encoded). Returns (corpus_dir, codes_dir or None)."""
    rng = random.Random(seed)
    corpus = os.path.join(root, "corpus")
    codes_dir = os.path.join(root, "codes") if with_codes else None
    os.makedirs(os.path.join(corpus, "wav"), exist_ok=True)
    recs = []
    for u in range(n_utts):
        voice = f"synth-{u % n_voices}"
        f0 = 110.0 * (1 + u % n_voices)
        n_words = rng.randint(3, 6)
        words = [rng.choice(WORDS) for _ in range(n_words)]
        t = 0.1
        spans = []
        for w in words:
            d = 0.08 + 0.04 * len(w)
            spans.append([w, round(t, 5), round(t + d, 5)])
            t += d + 0.03
        duration = t + 0.1
        n = int(duration * SAMPLE_RATE)
        x = np.zeros(n, np.float32)
        for i, (w, a, b) in enumerate(spans):
            s, e = int(a * SAMPLE_RATE), int(b * SAMPLE_RATE)
            tt = np.arange(e - s) / SAMPLE_RATE
            f = f0 * (1 + 0.1 * (hash(w) % 5))
            x[s:e] = 0.3 * np.sin(2 * math.pi * f * tt) * np.hanning(e - s)
        rel = f"wav/s{u:05d}.wav"
        write_wav(os.path.join(corpus, rel), x, SAMPLE_RATE)
        n_frames = math.ceil(duration * FRAME_RATE)
        frames = [(int(a * FRAME_RATE), int(math.ceil(b * FRAME_RATE))) for _, a, b in spans]
        graph = G.align_words_to_frames(words, frames, n_frames)
        chunks, i = [], 0
        while i < n_words:
            k = min(rng.randint(1, 3), n_words - i)
            chunks.append([i, k, 0 if not chunks else frames[i][0]])
            i += k
        split = "dev" if u == n_utts - 1 else "train"
        # one "phone" a word (its first letter), pauses between: the codec's phone labels
        phones, pos = [], 0.0
        for w, a, b in spans:
            phones += [["_", pos, a], [w[0], a, b]]
            pos = b
        phones.append(["_", pos, round(n / SAMPLE_RATE, 5)])
        recs.append({"id": f"s{u:05d}", "split": split, "voice": voice, "heldout_voice": False,
                     "text": " ".join(words), "words": spans, "audio": rel, "duration_s": round(n / SAMPLE_RATE, 5),
                     "graphemes": graph, "chunks": chunks, "phones": phones, "engine": "smoke"})
        if codes_dir:
            path = codes_path(codes_dir, f"s{u:05d}")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            codes = np.random.default_rng(u).integers(0, codebook_size, (n_q, n_frames)).astype(np.int16)
            codes[:, :: 2] = codes[:, :1]  # some structure to learn
            np.save(path, codes)
    with open(os.path.join(corpus, "manifest.jsonl"), "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return corpus, codes_dir
