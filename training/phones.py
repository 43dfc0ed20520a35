"""Phone labels at the codec's frame rate, and how phonetic a codec's first codebook is.

The corpus keeps each utterance's phone timeline (manifest ``phones``: [name, start_s,
end_s] covering the whole file, pauses named "_"; training/corpus/align.py). Codec
training uses them as exact labels for an auxiliary phone classifier on the first
quantiser level (semantic distillation, as SpeechTokenizer distils HuBERT into RVQ-1), so
that codebook 1 says which sound is being made and a decoder can predict it from text.

    python -m livespeech.training.phones --corpus data/corpus --codec models/weights/default/codec.pt

prints the probe of one codec (``probe_codec``) as JSON:
- ``cb1_repeat``: share of frames whose codebook-1 code equals the previous frame's;
- ``cb1_entropy`` / ``cb1_perplexity``: of the codebook-1 code distribution (nats);
- ``cb1_given_letter`` / ``cb1_given_phone``: H(code | the frame's letter / phone), nats;
- ``phone_probe_acc``: a code -> phone table fitted on the probe's train utterances
  (majority vote), scored on its dev utterances (codes unseen in the fit: the commonest
  phone);
- ``letter_probe_acc``: the same for the frame's letter (manifest ``graphemes``).
Names differ between synthesisers (eSpeak's mnemonics, Flite's CMU set, Piper's IPA), so
a label is ``engine:name``, except the pause, which all share.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from livespeech.models.front_end import phone_context

from .corpus.align import PAUSE
from .dataset import codes_path, read_manifest, read_wav_segment

IGNORE = -100  # frames without a label (torch's cross_entropy ignore_index)


def phone_key(engine: str, name: str) -> str:
    return PAUSE if name == PAUSE else f"{engine}:{name}"


@dataclass(frozen=True)
class PhoneVocab:
    """Phone label -> class index; index 0 is the pause."""

    names: tuple[str, ...]

    @classmethod
    def from_records(cls, records: Sequence[dict], min_count: int = 20) -> "PhoneVocab":
        """The phones occurring in at least ``min_count`` of the records' phone segments
        (rarer ones are left unlabelled rather than learnt from a handful of frames)."""
        counts: Counter[str] = Counter()
        for r in records:
            for name, _, _ in r.get("phones", ()):
                counts[phone_key(r.get("engine", "espeak"), name)] += 1
        names = sorted(n for n, c in counts.items() if c >= min_count and n != PAUSE)
        return cls((PAUSE, *names))

    @property
    def index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    def __len__(self) -> int:
        return len(self.names)

    def frame_labels(self, rec: dict, start: int, n_frames: int, hop: int, sample_rate: int) -> np.ndarray:
        """int64 [n_frames]: the phone at the centre of each frame of the crop starting at
        sample ``start``; IGNORE where the record has no timeline or the phone is rare."""
        out = np.full(n_frames, IGNORE, np.int64)
        phones = rec.get("phones")
        if not phones:
            return out
        index = self.index
        engine = rec.get("engine", "espeak")
        centres = (start + (np.arange(n_frames) + 0.5) * hop) / sample_rate
        ends = np.array([p[2] for p in phones])
        which = np.searchsorted(ends, centres, side="right")
        for f, k in enumerate(which):
            if k < len(phones) and phones[k][1] <= centres[f]:
                out[f] = index.get(phone_key(engine, phones[k][0]), IGNORE)
        return out


def _entropy(counts: Counter) -> float:
    n = sum(counts.values())
    return -sum(c / n * math.log(c / n) for c in counts.values() if c) if n else 0.0


def _conditional_entropy(pairs: Counter) -> float:
    """H(code | label) from counts of (label, code) pairs, nats (plug-in estimate)."""
    by_label: dict = {}
    for (label, code), c in pairs.items():
        by_label.setdefault(label, Counter())[code] += c
    n = sum(pairs.values())
    return sum(sum(cc.values()) / n * _entropy(cc) for cc in by_label.values()) if n else 0.0


def _majority_table(fit: Counter) -> tuple[dict, object]:
    """(code -> its commonest label, the commonest label overall) from counts of (label,
    code) pairs; (empty, None) without any."""
    by_code: dict = {}
    labels: Counter = Counter()
    for (label, code), c in fit.items():
        by_code.setdefault(code, Counter())[label] += c
        labels[label] += c
    if not labels:
        return {}, None
    return {code: cc.most_common(1)[0][0] for code, cc in by_code.items()}, labels.most_common(1)[0][0]


def _table_accuracy(fit: Counter, score: Counter) -> float:
    """Accuracy on ``score`` of the majority code -> label table of ``fit`` (both count
    (label, code) pairs); a code unseen in the fit gets the commonest label."""
    table, default = _majority_table(fit)
    if default is None:
        return float("nan")
    n = sum(score.values())
    hit = sum(c for (label, code), c in score.items() if table.get(code, default) == label)
    return hit / n if n else float("nan")


@dataclass
class PhoneTable:
    """Which phone a codebook-1 code stands for (the majority over train utterances):
    reads codes a decoder emits as phones, to count the frames whose code names the
    phone the ground truth has there (livespeech.training.eval.diagnose); and how often
    each code sounds each phone (`phone_given_code`, the letter schedule's)."""

    vocab: PhoneVocab
    table: dict
    default: int
    hop: int
    sample_rate: int
    pairs: Counter = field(default_factory=Counter)  # (phone, code) -> frames of the fit
    context_pairs: Counter = field(default_factory=Counter)  # ((phone, half, neighbour), code) -> frames

    @classmethod
    def fit(cls, codec, corpus: str, records: Sequence[dict], n: int = 300, device="cpu", seed: int = 0,
            min_count: int = 20, codes_dir: Optional[str] = None,
            vocab: Optional[PhoneVocab] = None) -> "PhoneTable":
        """Over `n` train utterances (seeded choice; 0: all) with a phone timeline, encoded
        with `codec`, or read from `codes_dir` (livespeech.training.encode_corpus's output
        with that codec; utterances it lacks are left out). The phones are `vocab`'s, else
        those of the records (`PhoneVocab.from_records`)."""
        labelled = [r for r in records if r.get("phones")]
        vocab = vocab if vocab is not None else PhoneVocab.from_records(labelled, min_count)
        fit = [r for r in labelled if r["split"] == "train"]
        random.Random(seed).shuffle(fit)
        if codes_dir is not None:
            fit = [r for r in fit if os.path.exists(codes_path(codes_dir, r["id"]))]
        fit = fit[:n] if n else fit
        codes_of = ([np.load(codes_path(codes_dir, r["id"]))[0] for r in fit] if codes_dir is not None
                    else first_codebook(codec, corpus, fit, device))
        pairs: Counter = Counter()
        context_pairs: Counter = Counter()
        for r, codes in zip(fit, codes_of):
            ph = vocab.frame_labels(r, 0, len(codes), codec.hop_length, codec.sample_rate)
            pairs.update((int(p), int(c)) for p, c in zip(ph, codes) if p != IGNORE)
            ph = np.where(ph == IGNORE, -1, ph).tolist()
            context_pairs.update((ctx, int(c)) for f, c in enumerate(codes)
                                 if (ctx := phone_context(ph, f, complete=True)) is not None)
        table, default = _majority_table(pairs)
        return cls(vocab, table, -1 if default is None else int(default), codec.hop_length, codec.sample_rate,
                   pairs, context_pairs)

    def phone_given_code(self, codebook_size: int, smoothing: float = 0.1) -> torch.Tensor:
        """[phones, codebook_size] log p(phone | code) over the fit's frames (each pair's
        count plus `smoothing`); -inf for a code unseen in the fit."""
        counts = torch.zeros(codebook_size, len(self.vocab), dtype=torch.float64)
        for (phone, code), c in self.pairs.items():
            counts[code, phone] += c
        total = counts.sum(1, keepdim=True)
        logp = ((counts + smoothing) / (total + smoothing * len(self.vocab))).log()
        return logp.masked_fill(total == 0, float("-inf")).T.float().contiguous()

    def contexts(self, codebook_size: int, strength: float = 80.0, smoothing: float = 0.1) -> dict:
        """`FrontEnd.contexts`: for each context of the fit (`phone_context`), log p(code |
        context) - log p(code | phone) on the codes seen in it, the rest of its row a
        constant (dropped: 0). p(code | context) is its counts with `strength` frames'
        worth of p(code | phone) (whose counts get `smoothing` each) added, so a rare
        context stays near its phone."""
        by_phone = torch.full((len(self.vocab), codebook_size), smoothing, dtype=torch.float64)
        for (phone, code), c in self.pairs.items():
            by_phone[phone, code] += c
        by_phone /= by_phone.sum(1, keepdim=True)
        keys = sorted({ctx for ctx, _ in self.context_pairs})
        row = {k: i for i, k in enumerate(keys)}
        items = sorted(self.context_pairs.items(), key=lambda kv: (row[kv[0][0]], kv[0][1]))
        pairs = torch.tensor([[row[ctx], code] for (ctx, code), _ in items], dtype=torch.int32).view(-1, 2)
        counts = torch.tensor([c for _, c in items], dtype=torch.float64)
        prior = strength * by_phone[torch.tensor([ctx[0] for (ctx, _), _ in items], dtype=torch.long), pairs[:, 1].long()]
        return {"keys": torch.tensor(keys, dtype=torch.long).view(-1, 3), "pairs": pairs,
                "values": torch.log1p(counts / prior).float()}

    def hits(self, rec: dict, codes: np.ndarray) -> tuple[int, int]:
        """(frames whose code names the record's phone there, frames with a phone label)."""
        labels = self.vocab.frame_labels(rec, 0, len(codes), self.hop, self.sample_rate)
        keep = labels != IGNORE
        named = np.array([self.table.get(int(c), self.default) for c in codes[keep]], np.int64)
        return int((named == labels[keep]).sum()), int(keep.sum())

    def code_phones(self, codebook_size: int) -> torch.Tensor:
        """[codebook_size] long: the phone each code names (-1: a code unseen in the fit)."""
        named = torch.full((codebook_size,), -1, dtype=torch.long)
        for code, phone in self.table.items():
            named[int(code)] = int(phone)
        return named

    def allowed_codes(self, rec: dict, n_frames: int, codebook_size: int) -> torch.Tensor:
        """[n_frames, codebook_size] bool: per frame, the codes that name the record's phone
        there (none on unlabelled frames)."""
        labels = self.vocab.frame_labels(rec, 0, n_frames, self.hop, self.sample_rate)
        lab = torch.from_numpy(np.asarray(labels, np.int64))
        return (self.code_phones(codebook_size).view(1, -1) == lab.view(-1, 1)) & (lab != IGNORE).view(-1, 1)


@torch.no_grad()
def first_codebook(codec, corpus: str, recs: Sequence[dict], device="cpu", max_seconds: float = 8.0) -> list[np.ndarray]:
    """Codebook-1 codes of each record's whole audio (at most ``max_seconds``)."""
    out = []
    for r in recs:
        n = int(min(r["duration_s"], max_seconds) * codec.sample_rate)
        wav = torch.from_numpy(read_wav_segment(os.path.join(corpus, r["audio"]), 0, n))
        codes = codec.encode(wav.view(1, 1, -1).to(device), n_q=1)
        out.append(codes[0, 0].cpu().numpy())
    return out


def probe_codec(codec, corpus: str, records: Sequence[dict], vocab: PhoneVocab | None = None, n: int = 200,
                device="cpu", seed: int = 0) -> dict[str, float]:
    """How phonetic codebook 1 is (the module docstring), on ``n`` train and ``n`` dev
    utterances (seeded choice) that have a phone timeline."""
    labelled = [r for r in records if r.get("phones")]
    rng = random.Random(seed)
    fit = [r for r in labelled if r["split"] == "train"]
    score = [r for r in labelled if r["split"] != "train"]
    rng.shuffle(fit)
    rng.shuffle(score)
    fit, score = fit[:n], score[:n]
    vocab = vocab if vocab is not None else PhoneVocab.from_records(labelled)
    hop, sr = codec.hop_length, codec.sample_rate
    sets = {}
    for name, recs in (("fit", fit), ("score", score)):
        phone_pairs, letter_pairs, codes_all, repeats, frames = Counter(), Counter(), Counter(), 0, 0
        for r, codes in zip(recs, first_codebook(codec, corpus, recs, device)):
            f = len(codes)
            ph = vocab.frame_labels(r, 0, f, hop, sr)
            gr = np.asarray(r["graphemes"][:f])
            codes_all.update(codes.tolist())
            repeats += int((codes[1:] == codes[:-1]).sum())
            frames += max(0, f - 1)
            phone_pairs.update((int(p), int(c)) for p, c in zip(ph, codes) if p != IGNORE)
            letter_pairs.update((int(g), int(c)) for g, c in zip(gr, codes))
        sets[name] = (phone_pairs, letter_pairs, codes_all, repeats / max(1, frames))
    ph_fit, le_fit, _, _ = sets["fit"]
    ph_sc, le_sc, codes_sc, repeat = sets["score"]
    h = _entropy(codes_sc)
    return {
        "n_fit": len(fit), "n_score": len(score), "n_phones": len(vocab),
        "cb1_repeat": round(repeat, 4),
        "cb1_entropy": round(h, 4),
        "cb1_perplexity": round(math.exp(h), 1),
        "cb1_codes_used": len(codes_sc),
        "cb1_given_letter": round(_conditional_entropy(le_sc), 4),
        "cb1_given_phone": round(_conditional_entropy(ph_sc), 4),
        "phone_probe_acc": round(_table_accuracy(ph_fit, ph_sc), 4),
        "letter_probe_acc": round(_table_accuracy(le_fit, le_sc), 4),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m livespeech.training.phones", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True)
    p.add_argument("--codec", required=True)
    p.add_argument("--n", type=int, default=200, help="utterances to fit the probe on, and to score it on")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    from livespeech.models.codec import CodecModel

    torch.set_num_threads(a.threads)
    codec = CodecModel.from_checkpoint(a.codec).to(a.device)
    records = read_manifest(a.corpus)
    if not any(r.get("phones") for r in records):
        print(f"{a.corpus}: no utterance has a phone timeline (rebuild the corpus)", file=sys.stderr)
        return 2
    print(json.dumps({"codec": a.codec, **probe_codec(codec, a.corpus, records, n=a.n, device=a.device)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
