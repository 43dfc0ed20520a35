"""Encode corpus audio to codec codes, one int16 .npy [Q, F] per utterance.

    python -m livespeech.training.encode_corpus --corpus data/corpus --codec runs/codec/best.pt --out data/codes

Resumable (existing files are skipped; files are written atomically). Order: dev, test,
then train in a seeded shuffle, so a partial run is a random subset of the training
set that the decoder trainer can already use (it re-scans the codes directory).
`--codec` may also be an official `encodec_24khz*.th` (then `--n-q` codebooks).
`--batch N` encodes N utterances of similar length per call, zero-padded on the right
(one call per utterance is bound by kernel launches on a GPU). Only a codec whose
convolutions are all causal with zero padding allows it (the padding then cannot reach
an utterance's own frames); others are refused.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import numpy as np
import torch

from livespeech.models.config import SAMPLE_RATE
from livespeech.models.loading import load_codec

from .dataset import codes_path, read_manifest, read_wav_segment
from .schedule import setup_device


def batchable(codec) -> bool:
    """Whether right zero-padding leaves every utterance's own frames unchanged."""
    cfg = codec.config
    return bool(getattr(cfg, "causal", False)) and getattr(cfg, "pad_mode", None) == "constant"


def batches(recs: list, size: int, window: int = 16) -> list[list]:
    """`size`-utterance batches of similar length: each run of window * size utterances of
    the order is sorted by duration and cut, so the order's prefix stays a random subset."""
    out = []
    for s in range(0, len(recs), size * window):
        part = sorted(recs[s:s + size * window], key=lambda r: r["duration_s"])
        out.extend(part[i:i + size] for i in range(0, len(part), size))
    return out


def padded_batch(wavs: list[np.ndarray], hop: int) -> np.ndarray:
    """[B, 1, T] float32: each waveform zero-padded to whole frames, then to the longest.

    Whole frames first: a causal codec then never pads inside (its layers pad a partial
    last frame with zeros of their own, which is not what a longer neighbour in the batch
    puts there), so an utterance gets the same codes alone and in any batch."""
    x = np.zeros((len(wavs), 1, -(-max(len(w) for w in wavs) // hop) * hop), np.float32)
    for i, w in enumerate(wavs):
        x[i, 0, :len(w)] = w
    return x


def encode_batch(codec, wavs: list[np.ndarray], n_q: int, device) -> list[np.ndarray]:
    """int16 codes [n_q, ceil(len / hop)] of each waveform, in one codec call."""
    hop = codec.hop_length
    x = torch.from_numpy(padded_batch(wavs, hop)).to(device)
    with torch.no_grad():
        codes = codec.encode(x, n_q).cpu().numpy().astype(np.int16)
    return [codes[i, :, :-(-len(w) // hop)] for i, w in enumerate(wavs)]


def save_codes(path: str, codes: np.ndarray) -> None:
    """Atomic write: a reader (the decoder trainer) never sees a torn file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp.npy"  # unique: shards may overlap after a restart
    np.save(tmp, codes)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m livespeech.training.encode_corpus", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True)
    p.add_argument("--codec", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--n-q", type=int, default=8)
    p.add_argument("--splits", default="dev,test,train")
    p.add_argument("--max-utterances", type=int, default=None, help="stop after this many (all splits)")
    p.add_argument("--max-seconds", type=float, default=None, help="skip utterances longer than this")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--shard", default="0/1",
                   help="K/N: encode every N-th utterance of the order starting at K (run N processes in parallel)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=1, help="utterances per codec call (causal zero-padded codecs)")
    a = p.parse_args(argv)
    if a.batch < 1:
        p.error("--batch must be >= 1")

    device = setup_device(a.device, a.threads)
    codec = load_codec(a.codec, a.n_q).to(device)
    n_q = min(a.n_q, codec.config.n_q)
    if a.batch > 1 and not batchable(codec):
        p.error("--batch > 1 needs a causal codec with zero padding: padding would change the codes")
    recs = read_manifest(a.corpus)
    order = []
    for split in a.splits.split(","):
        part = sorted((r for r in recs if r["split"] == split), key=lambda r: r["id"])
        if split == "train":
            random.Random(a.seed).shuffle(part)
        order.extend(part)
    if a.max_seconds:
        order = [r for r in order if r["duration_s"] <= a.max_seconds]
    if a.max_utterances is not None:
        order = order[: a.max_utterances]
    k, n = (int(x) for x in a.shard.split("/"))
    if not 0 <= k < n:
        p.error("--shard K/N needs 0 <= K < N")
    order = order[k::n]
    os.makedirs(a.out, exist_ok=True)
    info_tmp = os.path.join(a.out, f"info.json.{os.getpid()}.tmp")
    with open(info_tmp, "w") as f:
        json.dump({"codec": os.path.abspath(a.codec), "n_q": n_q, "corpus": os.path.abspath(a.corpus)}, f)
    os.replace(info_tmp, os.path.join(a.out, "info.json"))
    t0 = time.time()
    todo = [r for r in order if not os.path.exists(codes_path(a.out, r["id"]))]
    skipped = len(order) - len(todo)
    done = 0
    audio_s = 0.0
    for batch in batches(todo, a.batch):
        wavs = [read_wav_segment(os.path.join(a.corpus, r["audio"])) for r in batch]
        for r, codes in zip(batch, encode_batch(codec, wavs, n_q, device)):
            save_codes(codes_path(a.out, r["id"]), codes)
        done += len(batch)
        audio_s += sum(len(w) for w in wavs) / SAMPLE_RATE
        if done // 200 != (done - len(batch)) // 200:
            el = time.time() - t0
            print(f"{skipped + done}/{len(order)} encoded {done} ({audio_s / 3600:.2f} h audio) in {el:.0f} s, "
                  f"{audio_s / max(el, 1e-9):.0f}x real time", flush=True)
    el = time.time() - t0
    print(f"done: {done} encoded, {skipped} already there, {audio_s / 3600:.2f} h in {el:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
