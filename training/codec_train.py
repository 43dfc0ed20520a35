"""Train the small causal codec (models/codec preset 'small') on the corpus audio.

    python -m livespeech.training.codec_train --corpus data/corpus --out runs/codec [--steps N] [--resume]

Random 1 s crops of train-split audio, batch 8, AdamW, L1 + multi-resolution STFT + mel,
k-means codebook init on the first batch (few iterations). `--phone-weight W`
adds a phone classifier on the first quantiser level's output (labels from the corpus's
phone timelines, training/phones.py), so codebook 1 carries which sound is made; the
probe of training/phones.py runs at each evaluation. `--adversarial` adds
EnCodec's multi-scale STFT discriminator (hinge + feature matching); `--init CODEC
--decoder-only` fine-tunes an existing codec's decoder alone, so its codes, and a
decoder trained on them, stay valid. Writes
  out/last_state.pt   resumable state (model, optimizer, step, RNG)
  out/last.pt         codec checkpoint (CodecModel.from_checkpoint format)
  out/best.pt         codec checkpoint with the lowest dev mel distance
  out/log.jsonl       one line per logged step / eval
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

from livespeech.models.codec import CodecLossConfig, CodecModel, preset
from livespeech.models.codec.discriminator import MultiScaleSTFTDiscriminator, discriminator_loss, generator_losses
from livespeech.models.codec.losses import reconstruction_losses, weighted_reconstruction_losses
from livespeech.models.config import SAMPLE_RATE

from .corpus.cli import parse_weights
from .dataset import AudioCrops, read_manifest, read_wav_segment
from .phones import IGNORE, PhoneVocab, probe_codec
from .schedule import Schedule, setup_device


def _atomic_save(obj, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _save_codec(model: CodecModel, path: str) -> None:
    tmp = path + ".tmp"
    model.save(tmp)
    os.replace(tmp, path)


# The config's dead-code threshold (EnCodec's EMA count of 2) holds for batches of 64
# one-second crops: 4,800 vectors a step, ~4.7 a code when all are in use. A code's EMA count
# scales with the vectors a step, so at batch 8 most counts sat below 2 and the codebooks were
# re-seeded from the batch (of the shipped codec's 1,024 first-level codes, 562 within 120
# steps), undoing what they had learnt: the threshold scales with the vectors a step.
DEAD_CODE_REFERENCE_VECTORS = 64 * 75


def dead_code_threshold(config_threshold: float, vectors_per_step: int) -> float:
    return config_threshold * vectors_per_step / DEAD_CODE_REFERENCE_VECTORS


def dev_set(corpus: str, records: list[dict], n: int, seconds: float, seed: int = 1234) -> torch.Tensor:
    """Fixed dev crops (deterministic), [n, 1, seconds * sr]."""
    dev = [r for r in records if r["split"] == "dev"] or [r for r in records if r["split"] != "train"]
    if not dev:
        dev = records
    rng = random.Random(seed)
    dev = sorted(dev, key=lambda r: r["id"])
    rng.shuffle(dev)
    length = int(seconds * SAMPLE_RATE)
    out = []
    for r in dev[:n]:
        total = int(round(r["duration_s"] * SAMPLE_RATE))
        start = max(0, (total - length) // 2)
        out.append(read_wav_segment(os.path.join(corpus, r["audio"]), start, length))
    return torch.from_numpy(np.stack(out)).unsqueeze(1)


@torch.no_grad()
def evaluate(model: CodecModel, wav: torch.Tensor, batch: int = 8) -> dict[str, float]:
    """Resynthesis distances on wav [N, 1, T]: L1, multi-res STFT, mel (the training
    losses, unweighted) and SNR in dB."""
    was_training = model.training
    model.eval()
    cfg = CodecLossConfig()
    sums: dict[str, float] = {}
    n = 0
    snr = []
    for i in range(0, wav.shape[0], batch):
        x = wav[i:i + batch]
        codes = model.encode(x)
        y = model.decode(codes)[..., : x.shape[-1]]
        losses = reconstruction_losses(x, y, model.sample_rate, cfg)
        for k, v in losses.items():
            sums[k] = sums.get(k, 0.0) + float(v) * x.shape[0]
        n += x.shape[0]
        err = ((x - y) ** 2).sum(dim=(1, 2))
        sig = (x ** 2).sum(dim=(1, 2)).clamp_min(1e-9)
        snr.extend((10 * torch.log10(sig / err.clamp_min(1e-12))).tolist())
    model.train(was_training)
    out = {f"dev_{k}": v / n for k, v in sums.items()}
    out["dev_snr_db"] = float(np.mean(snr))
    return out


def _engine_weights(s: str) -> dict[str, float]:
    """--engine-weight: the corpus build's NAME=W list (its --engines), every W >= 0."""
    try:
        out = parse_weights(s) or {}
    except ValueError:
        out = None
    if out is None or not all(w >= 0 for w in out.values()):
        raise argparse.ArgumentTypeError(f"{s!r}: expected ENGINE=W[,...] with every W >= 0")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m livespeech.training.codec_train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--crop-s", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--kmeans-iters", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--dev-n", type=int, default=16)
    p.add_argument("--dev-seconds", type=float, default=2.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1 measured 3x faster than 2 on the shared 2-core CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None, help="stop (with a checkpoint) after this long")
    p.add_argument("--minutes", type=float, default=None,
                   help="run length in training minutes instead of --steps (the LR decays over it)")
    p.add_argument("--engine-weight", type=_engine_weights, default={}, metavar="ENGINE=W[,...]",
                   help="draw an utterance of this synthesis engine W times as often as one of weight 1 "
                        "(every engine's default), e.g. flite=4")
    p.add_argument("--device", default="cpu")
    p.add_argument("--init", default=None, help="start from this codec checkpoint (its config, not --preset)")
    p.add_argument("--decoder-only", action="store_true",
                   help="train the decoder alone: encoder and codebooks frozen, so the codes do not change")
    p.add_argument("--adversarial", action="store_true", help="add the multi-scale STFT discriminator's losses")
    p.add_argument("--disc-lr", type=float, default=None, help="discriminator peak LR (default --lr)")
    p.add_argument("--phone-weight", type=float, default=0.0,
                   help="weight of the phone classifier on the first quantiser level (0: none)")
    p.add_argument("--phone-min-count", type=int, default=20,
                   help="phones with fewer segments in the train split are left unlabelled")
    p.add_argument("--probe-n", type=int, default=100,
                   help="utterances the codebook-1 probe fits on and scores at each evaluation (0: no probe)")
    a = p.parse_args(argv)

    device = setup_device(a.device, a.threads)
    os.makedirs(a.out, exist_ok=True)
    records = read_manifest(a.corpus)
    train = [r for r in records if r["split"] == "train"]
    print(f"manifest: {len(records)} utterances, {len(train)} train "
          f"({sum(r['duration_s'] for r in train) / 3600:.2f} h)", flush=True)
    if not train:
        print("no training utterances", file=sys.stderr)
        return 1

    torch.manual_seed(a.seed)
    if a.init:
        model = CodecModel.from_checkpoint(a.init).to(device)
        cfg = model.config
    else:
        cfg = preset(a.preset, kmeans_iters=a.kmeans_iters)
        model = CodecModel(cfg).to(device)
    if a.decoder_only:
        if not a.init:
            print("--decoder-only needs --init: a codec whose codes to keep", file=sys.stderr)
            return 2
        model.freeze_codes()
    vocab = phone_head = None
    if a.phone_weight > 0:
        if a.decoder_only:
            print("--phone-weight trains the encoder: not with --decoder-only", file=sys.stderr)
            return 2
        vocab = PhoneVocab.from_records(train, a.phone_min_count)
        if len(vocab) < 2:
            print("--phone-weight needs a corpus with phone timelines (manifest 'phones')", file=sys.stderr)
            return 2
        # one linear map per frame: codebook 1's codewords themselves must tell the phones apart
        phone_head = torch.nn.Conv1d(cfg.dimension, len(vocab), 1).to(device)
        print(f"phone classifier: {len(vocab)} phones, weight {a.phone_weight}", flush=True)
    trained = [q for q in model.parameters() if q.requires_grad]
    trained += list(phone_head.parameters()) if phone_head is not None else []
    opt = torch.optim.AdamW(trained, lr=a.lr, betas=(0.8, 0.99), weight_decay=0.0)
    disc = d_opt = None
    if a.adversarial:
        disc = MultiScaleSTFTDiscriminator().to(device)
        d_opt = torch.optim.AdamW(disc.parameters(), lr=a.disc_lr or a.lr, betas=(0.5, 0.9), weight_decay=0.0)
    d_scale = (a.disc_lr or a.lr) / a.lr
    state_path = os.path.join(a.out, "last_state.pt")
    step, best, train_s = 0, float("inf"), 0.0
    sched = Schedule(a.lr, a.warmup, a.steps, a.minutes)
    try:
        crops = AudioCrops(a.corpus, train, int(a.crop_s * SAMPLE_RATE), seed=a.seed, engine_weights=a.engine_weight)
    except ValueError as e:  # no utterance long enough, or a weighted engine with none
        print(f"codec_train: {e}", file=sys.stderr)
        return 2
    vectors_per_step = a.batch * -(-int(a.crop_s * SAMPLE_RATE) // model.hop_length)
    model.quantizer.set_dead_code_threshold(dead_code_threshold(cfg.threshold_ema_dead_code, vectors_per_step))
    if a.resume and os.path.exists(state_path):
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        if phone_head is not None:
            if tuple(st.get("phones", ())) != vocab.names:
                print("--resume: the checkpoint's phone classes differ from this corpus's", file=sys.stderr)
                return 2
            phone_head.load_state_dict(st["phone_head"])
        if disc is not None and "disc" in st:
            disc.load_state_dict(st["disc"])
            d_opt.load_state_dict(st["d_opt"])
        step, best, train_s = st["step"], st["best"], st.get("train_s", 0.0)
        torch.set_rng_state(st["torch_rng"])
        crops.rng.setstate(st["data_rng"])
        print(f"resumed at step {step} (best dev mel {best:.4f})", flush=True)
    devwav = dev_set(a.corpus, records, a.dev_n, a.dev_seconds).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"codec {a.preset}: {n_params / 1e6:.2f} M params; dev {tuple(devwav.shape)}", flush=True)

    log = open(os.path.join(a.out, "log.jsonl"), "a")
    with open(os.path.join(a.out, "args.json"), "w") as f:  # for the model card
        json.dump(vars(a), f)

    def checkpoint() -> None:
        _atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "best": best,
                      "train_s": train_s, "torch_rng": torch.get_rng_state(), "data_rng": crops.rng.getstate(),
                      "config": cfg.to_dict(), "args": vars(a),
                      **({"disc": disc.state_dict(), "d_opt": d_opt.state_dict()} if disc is not None else {}),
                      **({"phone_head": phone_head.state_dict(), "phones": list(vocab.names)}
                         if phone_head is not None else {})},
                     state_path)
        _save_codec(model, os.path.join(a.out, "last.pt"))

    def dev_eval() -> dict[str, float]:
        ev = evaluate(model, devwav)
        if a.probe_n > 0 and any(r.get("phones") for r in records):
            model.eval()
            ev.update(probe_codec(model, a.corpus, records, vocab, n=a.probe_n, device=device))
            model.train()
        return {k: round(v, 5) for k, v in ev.items()}

    def log_row(row: dict) -> None:
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(json.dumps(row), flush=True)

    if a.init and step == 0:  # where the run starts from, measured as its evaluations are
        log_row({"step": 0, "eval": True, "best": False, **dev_eval()})
    t0 = time.time()
    t_last = t0
    acc: dict[str, float] = {}
    n_acc = 0
    model.train()
    t_resume = time.time() - train_s  # training time carried over from earlier runs
    while not sched.finished(step, train_s):
        lr = sched.lr(step, train_s)
        for g in opt.param_groups:
            g["lr"] = lr
        wav, sources = crops.sample(a.batch)
        wav = wav.to(device, non_blocking=True)
        recon, commit, first = model.train_forward(wav, first_level=True)
        losses = weighted_reconstruction_losses(wav, recon, commit, model.sample_rate)
        if phone_head is not None:
            logits = phone_head(first)  # [B, phones, F]
            labels = torch.from_numpy(np.stack([vocab.frame_labels(r, start, logits.shape[-1], model.hop_length,
                                                                    model.sample_rate) for r, start in sources]))
            labels = labels.to(device, non_blocking=True)
            losses["phone"] = torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE)
            known = labels != IGNORE
            losses["phone_acc"] = ((logits.argmax(1) == labels) & known).sum() / known.sum().clamp_min(1)
            losses["total"] = losses["total"] + a.phone_weight * losses["phone"]
        if disc is not None:
            real = disc(wav)
            losses.update(generator_losses(real, disc(recon)))
            losses["total"] = (losses["total"] + disc.config.adv_weight * losses["adv"]
                               + disc.config.feat_weight * losses["feat"])
        opt.zero_grad(set_to_none=True)
        losses["total"].backward()
        gn = torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        if disc is not None:  # then the discriminator, on this step's (pre-update) reconstruction
            for g in d_opt.param_groups:
                g["lr"] = lr * d_scale
            d_loss = discriminator_loss(real, disc(recon.detach()))
            d_opt.zero_grad(set_to_none=True)
            d_loss.backward()
            d_opt.step()
            losses["disc"] = d_loss
        step += 1
        train_s = time.time() - t_resume
        for k, v in losses.items():
            acc[k] = acc.get(k, 0.0) + float(v.detach())
        n_acc += 1
        if step % a.log_every == 0 or step == 1:
            now = time.time()
            row = {"step": step, "time_s": round(now - t0, 1), "lr": opt.param_groups[0]["lr"],
                   "grad_norm": round(float(gn), 4),
                   "s_per_step": round((now - t_last) / n_acc, 3), **{k: round(v / n_acc, 5) for k, v in acc.items()}}
            log_row(row)
            acc, n_acc, t_last = {}, 0, now
        done = sched.finished(step, train_s) or (a.max_minutes is not None and time.time() - t0 > a.max_minutes * 60)
        if step % a.eval_every == 0 or done:
            ev = dev_eval()
            is_best = ev["dev_mel"] < best
            if is_best:
                best = ev["dev_mel"]
                _save_codec(model, os.path.join(a.out, "best.pt"))
            log_row({"step": step, "eval": True, "best": is_best, **ev})
        if step % a.ckpt_every == 0 or done:
            checkpoint()
        if done:
            break
    if not os.path.exists(os.path.join(a.out, "best.pt")):
        _save_codec(model, os.path.join(a.out, "best.pt"))
    print(f"done: step {step}, best dev mel {best:.4f}, {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
