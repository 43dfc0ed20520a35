"""Training data: the corpus manifest, audio crops for the codec, and LiveSpeech 2
decoder examples built exactly the way the server lays out a session at inference
(server/text_memory.py `TextMemory.release` / `add_eos`).

Decoder example (one utterance, T = len(graphemes) frames):
- codebook rows: grapheme row = manifest `graphemes` + one EOS frame at frame T;
  acoustic rows = codec codes [Q, T] (cropped / edge-padded to T);
  last_frame = [T] + [T - 1] * Q (models/delay.py).
- text: the words of each manifest chunk tokenized with Whisper BPE (chunk 0 with
  first_in_text=True), tokens of chunk i at RoPE positions tau_i, tau_i + 1, ...;
  then one chunk holding only TEXT_EOS at position T (with `eos_jitter` s > 0: at
  tau_last + (T - tau_last) * exp(N(0, s^2)), after the last text token). At most
  cfg.max_text_tokens.
- enrollment: codes of a different utterance of the same voice (random 1.5-4 s crop).
"""
from __future__ import annotations

import itertools
import json
import math
import os
import random
import wave
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from livespeech.models import graphemes as G
from livespeech.models.config import FRAME_RATE, SAMPLE_RATE, ModelConfig
from livespeech.models.front_end import contexts as contexts_of

# --------------------------------------------------------------------------------------
# manifest and audio


def read_manifest(corpus: str) -> list[dict]:
    """All complete records of `corpus/manifest.jsonl` (a torn last line is ignored:
    the corpus may still be growing)."""
    path = os.path.join(corpus, "manifest.jsonl")
    rows = []
    with open(path, "rb") as f:
        data = f.read()
    for line in data.split(b"\n")[:-1] if not data.endswith(b"\n") else data.split(b"\n"):
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def wav_info(path: str) -> tuple[int, int]:
    with wave.open(path, "rb") as w:
        return w.getnframes(), w.getframerate()


def read_wav_segment(path: str, start: int = 0, length: Optional[int] = None) -> np.ndarray:
    """float32 mono samples [start, start + length) of a 16-bit PCM WAV (zero-padded)."""
    with wave.open(path, "rb") as w:
        n = w.getnframes()
        ch = w.getnchannels()
        if w.getsampwidth() != 2:
            raise ValueError(f"{path}: 16-bit PCM expected")
        start = max(0, min(start, n))
        length = n - start if length is None else length
        w.setpos(start)
        raw = w.readframes(max(0, min(length, n - start)))
    x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    if ch > 1:
        x = x.reshape(-1, ch).mean(axis=1)
    if len(x) < length:
        x = np.pad(x, (0, length - len(x)))
    return x


class AudioCrops:
    """Random fixed-length crops of the corpus audio (codec training)."""

    def __init__(self, corpus: str, records: Sequence[dict], crop: int, seed: int = 0, min_rms: float = 3e-3,
                 engine_weights: Optional[dict[str, float]] = None):
        """``engine_weights``: how often an utterance of each synthesis engine (the manifest's
        ``engine``) is drawn relative to one of weight 1, the default for every engine."""
        self.corpus = corpus
        self.min_rms = min_rms
        self.recs = [r for r in records if r.get("duration_s", 1.0) * SAMPLE_RATE >= crop // 2]
        if not self.recs:
            raise ValueError("no utterances long enough for the crop")
        self.cum_weights = None
        if engine_weights:
            unknown = set(engine_weights) - {r.get("engine") for r in self.recs}
            if unknown:
                raise ValueError(f"engine weights name engine(s) with no utterance to crop: "
                                 f"{', '.join(sorted(unknown))}")
            self.cum_weights = list(itertools.accumulate(engine_weights.get(r.get("engine"), 1.0) for r in self.recs))
        self.crop = crop
        self.rng = random.Random(seed)

    def _draw(self) -> dict:
        if self.cum_weights is None:
            return self.rng.choice(self.recs)
        return self.rng.choices(self.recs, cum_weights=self.cum_weights)[0]

    def batch(self, n: int) -> torch.Tensor:
        return self.sample(n)[0]

    def sample(self, n: int) -> tuple[torch.Tensor, list[tuple[dict, int]]]:
        """(crops [n, 1, crop], each crop's (record, start sample))."""
        out = np.zeros((n, 1, self.crop), np.float32)
        sources = []
        for i in range(n):
            for _attempt in range(50):
                r = self._draw()
                path = os.path.join(self.corpus, r["audio"])
                total = int(round(r["duration_s"] * SAMPLE_RATE))
                start = self.rng.randint(0, max(0, total - self.crop))
                try:
                    x = read_wav_segment(path, start, self.crop)
                except (OSError, EOFError, wave.Error):
                    continue  # file vanished or is being rewritten: take another
                if float(np.sqrt(np.mean(x ** 2))) < self.min_rms and _attempt < 49:
                    continue  # (almost) silent crop: the spectral-convergence loss explodes on silence
                out[i, 0] = x
                sources.append((r, start))
                break
            else:
                raise RuntimeError(f"could not read audio crops from {self.corpus} (corpus deleted?)")
        return torch.from_numpy(out), sources


# --------------------------------------------------------------------------------------
# decoder examples


def phone_letters(rec: dict) -> list[int]:
    """The record's grapheme row with its letters on its phones and its pauses as SPACE
    (livespeech.models.graphemes.align_words_to_frames with phones), on the manifest's frames."""
    letters, positions = phone_letter_positions(rec)
    return [letters[p] if p >= 0 else G.BLANK for p in positions]


def phone_letter_positions(rec: dict) -> tuple[list[int], list[int]]:
    """(`spoken_letters` of the record's words, each frame's position in them) with the
    letters on the record's phones (livespeech.models.graphemes.letter_positions)."""
    from livespeech.training.corpus.plan import spans_to_frames

    T = len(rec["graphemes"])
    words = [w for w, _, _ in rec["words"]]
    spans = spans_to_frames([(a, b) for _, a, b in rec["words"]], T)
    phones = [(name, int(round(a * FRAME_RATE)), int(round(b * FRAME_RATE))) for name, a, b in rec["phones"]]
    return G.spoken_letters(words), G.letter_positions(words, spans, T, phones=phones)


def codes_path(codes_dir: str, utt_id: str) -> str:
    return os.path.join(codes_dir, utt_id[:2] if len(utt_id) > 2 else "xx", f"{utt_id}.npy")


def jittered_end(last_tau: int, first_free: int, T: int, sigma: float, rng: random.Random) -> int:
    """A position for the end-of-text key around T, off by a log-normal factor on the
    last chunk's span, as the server's estimate of where the text ends is (it places the
    key at the speaking rate it measured: server/timeline.py). A model trained with the
    key always at T learns to end where the key is and, when the estimate runs late,
    goes on speaking (docs/eval.md)."""
    span = max(1, T - last_tau)
    return max(first_free, int(round(last_tau + span * math.exp(rng.gauss(0.0, sigma)))))


def text_tokens(rec: dict, tokenizer, max_tokens: int, eos_id: int) -> Optional[tuple[list[int], list[int]]]:
    """(token ids, positions) for an utterance, chunk by chunk as the server does;
    None if it does not fit in max_tokens."""
    words = [w[0] for w in rec["words"]]
    n_frames = len(rec["graphemes"])
    ids: list[int] = []
    pos: list[int] = []
    for i, (first, n, tau) in enumerate(rec["chunks"]):
        toks = tokenizer.encode_words(words[first:first + n], first_in_text=(i == 0))
        ids.extend(toks)
        pos.extend(range(int(tau), int(tau) + len(toks)))
    ids.append(eos_id)
    pos.append(n_frames)
    if len(ids) > max_tokens:
        return None
    return ids, pos


def word_token_ranges(rec: dict, tokenizer) -> Optional[list[tuple[int, int]]]:
    """Each word's [first, end) among the utterance's text tokens as `text_tokens` lays
    them out (chunk by chunk), or None where a word's own tokens do not add up to its
    chunk's (a merge across words)."""
    words = [w[0] for w in rec["words"]]
    out: list[tuple[int, int]] = []
    n = 0
    for i, (first, k, _tau) in enumerate(rec["chunks"]):
        own = [tokenizer.encode_words([w], first_in_text=(i == 0 and j == 0))
               for j, w in enumerate(words[first:first + k])]
        if [t for ids in own for t in ids] != tokenizer.encode_words(words[first:first + k], first_in_text=(i == 0)):
            return None
        for ids in own:
            out.append((n, n + len(ids)))
            n += len(ids)
    return out


def reading_targets(rec: dict, token_ranges: list[tuple[int, int]], T: int, eos_index: int) -> np.ndarray:
    """[2, T + 1] the text tokens [first, end) a frame reads: the word spoken at it, in a
    pause the word that comes next, after the last word (and at the EOS column) the
    end-of-text token. The reading loss (`train --read-weight`) pulls attention there."""
    from livespeech.training.corpus.plan import spans_to_frames

    spans = spans_to_frames([(a, b) for _, a, b in rec["words"]], T)
    out = np.empty((2, T + 1), np.int64)
    out[0], out[1] = eos_index, eos_index + 1
    start = 0
    for (a, b), (lo, hi) in zip(spans, token_ranges):
        out[0, start:b], out[1, start:b] = lo, hi
        start = b
    return out


@dataclass
class Example:
    codes: np.ndarray  # [K, T + 1] int64: grapheme row (with EOS at T) + acoustic rows (padded)
    last_frame: np.ndarray  # [K]
    text_ids: list[int]
    text_pos: list[int]
    enroll: np.ndarray  # [Q, E]
    n_frames: int  # T + 1 (columns of codes)
    phones: Optional[np.ndarray] = None  # [T + 1] phone class of each frame (livespeech.training.phones), IGNORE where none
    reading: Optional[np.ndarray] = None  # [2, T + 1] text tokens each frame reads (reading_targets)
    phone_input: Optional[np.ndarray] = None  # [T + 1] the front end's phone of each frame (-1: none)


class DecoderData:
    """Builds decoder examples from the manifest + precomputed codes."""

    def __init__(self, corpus: str, codes_dir: str, cfg: ModelConfig, split: str = "train",
                 max_seconds: float = 8.0, seed: int = 0, records: Optional[list[dict]] = None,
                 tokenizer=None, eos_jitter: float = 0.0, letters: str = "even", id_prefix: str = "",
                 phone_vocab=None, front_end=None):
        """``letters``: the grapheme row as the manifest has it ("even": a word's letters
        share its frames evenly, pauses carry the next letter) or "phones": spread over
        the word's phones with pauses as SPACE (`phone_letters`) where the record has a
        phone timeline. ``id_prefix`` keeps the ids of a corpus `merge`d into another
        apart from its own. ``phone_vocab`` (a livespeech.training.phones.PhoneVocab): examples
        carry each frame's phone class (an auxiliary target, `train --phone-weight`).
        ``front_end`` (a livespeech.models.front_end.FrontEnd, with letters "phones"):
        examples carry the phone it gives each frame from the letters on their frames, as
        the letter schedule gives it a session (the phone input, `train --phone-input`)."""
        from livespeech.models.tokenizer import get_tokenizer

        if letters not in ("even", "phones"):
            raise ValueError(f"letters must be 'even' or 'phones', not {letters!r}")
        self.cfg = cfg
        self.eos_jitter = eos_jitter
        self.phone_vocab = phone_vocab
        if front_end is not None and letters != "phones":
            raise ValueError("a phone input needs letters 'phones' (the layout the front end reads)")
        self.front_end = front_end
        self.tok = tokenizer or get_tokenizer()
        self.eos_id = self.tok.eos_id if hasattr(self.tok, "eos_id") else cfg.text_vocab_size - 1
        self.rng = random.Random(seed)
        recs = records if records is not None else read_manifest(corpus)
        max_frames = int(max_seconds * FRAME_RATE)
        self.items: list[dict] = []
        self.skipped = 0
        self.missing = 0  # records of the split whose codes are not there (yet)
        for r in recs:
            if r["split"] != split:
                continue
            if len(r["graphemes"]) > max_frames:
                self.skipped += 1
                continue
            if not os.path.exists(codes_path(codes_dir, r["id"])):
                self.missing += 1
                continue
            tt = text_tokens(r, self.tok, cfg.max_text_tokens, self.eos_id)
            if tt is None:
                self.skipped += 1
                continue
            g = phone_letters(r) if letters == "phones" and r.get("phones") else r["graphemes"]
            self.items.append({"rec": {**r, "id": id_prefix + r["id"]} if id_prefix else r, "text": tt,
                               "T": len(r["graphemes"]), "graphemes": g, "codes": (codes_dir, r["id"]),
                               "words_tokens": word_token_ranges(r, self.tok)})
        self.by_voice: dict[str, list[int]] = {}
        for i, it in enumerate(self.items):
            self.by_voice.setdefault(it["rec"]["voice"], []).append(i)
        self._cache: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.items)

    def merge(self, other: "DecoderData") -> None:
        """Add another corpus's examples, read from its own codes folder (a voice made on
        another machine and brought as codes)."""
        base = len(self.items)
        self.items.extend(other.items)
        for voice, idx in other.by_voice.items():
            self.by_voice.setdefault(voice, []).extend(base + i for i in idx)
        self.skipped += other.skipped
        self.missing += other.missing

    def load_codes(self, idx: int) -> np.ndarray:
        """Item ``idx``'s codes [Q, F] (cached)."""
        key = self.items[idx]["codes"]
        c = self._cache.get(key)
        if c is None:
            c = np.load(codes_path(*key)).astype(np.int64)
            if len(self._cache) < 200_000:
                self._cache[key] = c
        return c

    def example(self, idx: int, rng: Optional[random.Random] = None) -> Example:
        rng = rng or self.rng
        it = self.items[idx]
        rec = it["rec"]
        T = it["T"]
        q = self.cfg.n_acoustic_codebooks
        ac = self.load_codes(idx)[:q]
        if ac.shape[1] >= T:
            ac = ac[:, :T]
        else:
            ac = np.concatenate([ac, np.repeat(ac[:, -1:], T - ac.shape[1], axis=1)], axis=1)
        codes = np.zeros((1 + q, T + 1), np.int64)
        codes[0, :T] = it["graphemes"]
        codes[0, T] = G.EOS
        codes[1:, :T] = ac
        codes[1:, T] = ac[:, -1]  # beyond last_frame: never a target nor an input
        last = np.array([T] + [T - 1] * q, np.int64)
        enroll = self.enrollment(idx, rng)
        ids, pos = list(it["text"][0]), list(it["text"][1])
        if self.eos_jitter > 0:  # drawn after the enrollment: with 0, the same draws as before
            last_tau = int(rec["chunks"][-1][2])
            pos[-1] = jittered_end(last_tau, pos[-2] + 1 if len(pos) > 1 else 0, T, self.eos_jitter, rng)
        phones = None
        if self.phone_vocab is not None:
            from .phones import IGNORE

            phones = np.full(T + 1, IGNORE, np.int64)  # the EOS column has no phone
            phones[:T] = self.phone_vocab.frame_labels(rec, 0, T, SAMPLE_RATE // FRAME_RATE, SAMPLE_RATE)
        ranges = it["words_tokens"]
        reading = None if ranges is None else reading_targets(rec, ranges, T, len(ids) - 1)
        phone_input = None
        if self.front_end is not None:
            phone_input = np.full(T + 1, -1, np.int64)
            phone_input[:T] = self.front_end_phones(idx)[:T]
        return Example(codes, last, ids, pos, enroll, T + 1, phones, reading, phone_input)

    def front_end_phones(self, idx: int) -> np.ndarray:
        """The front end's phone of each frame of item ``idx`` (-1: no letter, or an engine
        it does not know), cached."""
        it = self.items[idx]
        if "front_end_phones" not in it:
            rec, fe = it["rec"], self.front_end
            letters, positions = phone_letter_positions(rec) if rec.get("phones") else ([], [-1] * it["T"])
            engine = rec.get("engine", "espeak")
            out = np.full(len(positions), -1, np.int64)
            if letters and engine in fe.engines:
                _, frames_into_letter = contexts_of(letters, positions)
                pred = fe.phones_of(letters, positions, frames_into_letter.tolist(), fe.engines.index(engine))
                out = np.where(np.asarray(positions) >= 0, pred, -1)
            it["front_end_phones"] = np.pad(out, (0, max(0, it["T"] - len(out))), constant_values=-1)
        return it["front_end_phones"]

    def enrollment(self, idx: int, rng: random.Random) -> np.ndarray:
        rec = self.items[idx]["rec"]
        cands = [j for j in self.by_voice.get(rec["voice"], []) if j != idx]
        j = rng.choice(cands) if cands else idx
        c = self.load_codes(j)[: self.cfg.n_acoustic_codebooks]
        n = int(rng.uniform(1.5, 4.0) * FRAME_RATE)
        n = min(n, c.shape[1], self.cfg.enc_max_frames)
        s = rng.randint(0, c.shape[1] - n)
        return c[:, s:s + n]

    def buckets(self, batch_frames: int, max_batch: int, rng: random.Random) -> list[list[int]]:
        """Length-bucketed batches: sort by length (with jitter), cut by a frame budget,
        shuffle the batches."""
        order = sorted(range(len(self.items)), key=lambda i: self.items[i]["T"] + rng.random() * 20)
        batches, cur, cur_max = [], [], 0
        for i in order:
            t = self.items[i]["T"]
            m = max(cur_max, t)
            if cur and (m * (len(cur) + 1) > batch_frames or len(cur) >= max_batch):
                batches.append(cur)
                cur, m = [], t
            cur.append(i)
            cur_max = m
        if cur:
            batches.append(cur)
        rng.shuffle(batches)
        return batches


@dataclass
class Batch:
    inputs: torch.Tensor  # [B, K, S]
    targets: torch.Tensor
    valid: torch.Tensor
    enroll_codes: torch.Tensor  # [B, Q, E]
    enroll_len: torch.Tensor  # [B]
    text_ids: torch.Tensor  # [B, L]
    text_pos: torch.Tensor  # [B, L]
    text_valid: torch.Tensor  # [B, L]
    # [B, S] the phone class of the frame codebook 1 predicts at each step (livespeech.training.phones.IGNORE where none)
    phones: torch.Tensor
    # [B, 2, S] the text tokens [first, end) read at the step that predicts each frame's letter (-1: none)
    reading: torch.Tensor
    # [B, S] the phone input of each step (the front end's phone of the frame codebook 1 predicts; -1: none)
    phone_input: torch.Tensor

    def to(self, device, non_blocking: bool = False) -> "Batch":
        return Batch(*(getattr(self, f).to(device, non_blocking=non_blocking) for f in self.__dataclass_fields__))

    def pin_memory(self) -> "Batch":
        """In page-locked memory, which a CUDA device copies from without the host waiting."""
        return Batch(*(getattr(self, f).pin_memory() for f in self.__dataclass_fields__))


def collate(examples: Sequence[Example], model) -> Batch:
    from livespeech.models.delay import build_delayed

    cfg = model.cfg
    b = len(examples)
    k = cfg.n_codebooks
    f = max(e.n_frames for e in examples)
    codes = torch.zeros(b, k, f, dtype=torch.long)
    last = torch.zeros(b, k, dtype=torch.long)
    for i, e in enumerate(examples):
        codes[i, :, : e.n_frames] = torch.from_numpy(e.codes)
        last[i] = torch.from_numpy(e.last_frame)
    inputs, targets, valid = build_delayed(codes, last, cfg.delays, model.none_ids())
    q = cfg.n_acoustic_codebooks
    el = max(e.enroll.shape[1] for e in examples)
    enroll = torch.zeros(b, q, el, dtype=torch.long)
    elen = torch.zeros(b, dtype=torch.long)
    for i, e in enumerate(examples):
        enroll[i, :, : e.enroll.shape[1]] = torch.from_numpy(e.enroll)
        elen[i] = e.enroll.shape[1]
    ll = max(len(e.text_ids) for e in examples)
    tid = torch.zeros(b, ll, dtype=torch.long)
    tpos = torch.zeros(b, ll, dtype=torch.long)
    tval = torch.zeros(b, ll, dtype=torch.bool)
    for i, e in enumerate(examples):
        n = len(e.text_ids)
        tid[i, :n] = torch.tensor(e.text_ids)
        tpos[i, :n] = torch.tensor(e.text_pos)
        tval[i, :n] = True
    from .phones import IGNORE

    # aligned with codebook 1's targets: step s predicts frame s - delay
    d1 = cfg.delays[1]
    phones = torch.full(inputs.shape[::2], IGNORE, dtype=torch.long)
    for i, e in enumerate(examples):
        if e.phones is not None:
            phones[i, d1:d1 + e.n_frames] = torch.from_numpy(e.phones)
    d0 = cfg.delays[0]
    reading = torch.full((b, 2, inputs.shape[2]), -1, dtype=torch.long)
    for i, e in enumerate(examples):
        if e.reading is not None:
            reading[i, :, d0:d0 + e.n_frames] = torch.from_numpy(e.reading)
    phone_input = torch.full(inputs.shape[::2], -1, dtype=torch.long)
    for i, e in enumerate(examples):
        if e.phone_input is not None:
            phone_input[i, d1:d1 + e.n_frames] = torch.from_numpy(e.phone_input)
    return Batch(inputs, targets, valid, enroll, elen, tid, tpos, tval, phones, reading, phone_input)


def n_frames_for(duration_s: float) -> int:
    return math.ceil(duration_s * FRAME_RATE)
