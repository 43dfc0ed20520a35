"""Encode corpus audio to codec codes, one int16 .npy [Q, F] per utterance.

    python -m training.encode_corpus --corpus data/corpus --codec runs/codec/best.pt --out data/codes

Resumable (existing files are skipped; files are written atomically). Order: dev, test,
then train in a seeded shuffle, so a partial run is a random subset of the training
set that the decoder trainer can already use (it re-scans the codes directory).
`--codec` may also be an official `encodec_24khz*.th` (then `--n-q` codebooks).
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

from models.config import SAMPLE_RATE
from models.loading import load_codec

from .dataset import codes_path, read_manifest, read_wav_segment
from .schedule import setup_device


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.encode_corpus", description=__doc__,
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
    a = p.parse_args(argv)

    device = setup_device(a.device, a.threads)
    codec = load_codec(a.codec, a.n_q).to(device)
    n_q = min(a.n_q, codec.config.n_q)
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
    done = skipped = 0
    audio_s = 0.0
    for i, r in enumerate(order):
        path = codes_path(a.out, r["id"])
        if os.path.exists(path):
            skipped += 1
            continue
        wav = read_wav_segment(os.path.join(a.corpus, r["audio"]))
        with torch.no_grad():
            codes = codec.encode(torch.from_numpy(wav).view(1, 1, -1).to(device), n_q)[0].cpu()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp.npy"  # unique: shards may overlap after a restart
        np.save(tmp, codes.numpy().astype(np.int16))
        os.replace(tmp, path)
        done += 1
        audio_s += len(wav) / SAMPLE_RATE
        if done % 200 == 0:
            el = time.time() - t0
            print(f"{i + 1}/{len(order)} encoded {done} ({audio_s / 3600:.2f} h audio) in {el:.0f} s, "
                  f"{audio_s / max(el, 1e-9):.0f}x real time", flush=True)
    el = time.time() - t0
    print(f"done: {done} encoded, {skipped} already there, {audio_s / 3600:.2f} h in {el:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
