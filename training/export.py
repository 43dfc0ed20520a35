"""Export a trained codec + decoder as a model directory the server loads.

    python -m livespeech.training.export --codec runs/codec/best.pt --decoder runs/decoder/last.pt \
        --corpus data/corpus --out models/weights/default

Writes decoder.pt (fp16, livespeech.models.loading.save_decoder), codec.pt, voices/<id>.wav
(built-in reference voices: 3-5 s of TRAIN voices, 24 kHz 16-bit) and MODEL_CARD.md.
Checks that fp16 loses nothing (logits fp32 vs fp16-loaded on a dev batch) and that
`load_bundle` loads the directory.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time

import numpy as np
import torch

from livespeech.models.codec import CodecModel
from livespeech.models.config import SAMPLE_RATE, ModelConfig
from livespeech.models.livespeech import LiveSpeech2
from livespeech.models.loading import load_bundle, load_decoder, save_decoder, write_wav

from .dataset import read_manifest, read_wav_segment
from .plot import read_log

VOICE_IDS = ["default", "voice-a", "voice-b", "voice-c"]


def pick_voices(corpus: str, records: list[dict], n: int, seed: int = 0) -> list[tuple[str, dict, np.ndarray]]:
    """n train utterances of different voices and accents, 3-5 s each (trimmed)."""
    rng = random.Random(seed)
    cands = [r for r in records if r["split"] == "train" and not r.get("heldout_voice") and 3.2 <= r["duration_s"] <= 6.0]
    cands.sort(key=lambda r: r["id"])
    rng.shuffle(cands)
    out, seen_voice, seen_accent = [], set(), set()
    for strict in (True, False):
        for r in cands:
            if len(out) >= n:
                break
            accent = r["voice"].split("-x-")[0] if "-x-" in r["voice"] else r["voice"].rsplit("-", 2)[0]
            if r["voice"] in seen_voice or (strict and accent in seen_accent):
                continue
            path = os.path.join(corpus, r["audio"])
            if not os.path.exists(path):
                continue
            x = read_wav_segment(path)
            x = x[: int(5.0 * SAMPLE_RATE)]
            out.append((VOICE_IDS[len(out)] if len(out) < len(VOICE_IDS) else f"voice-{len(out)}", r, x))
            seen_voice.add(r["voice"])
            seen_accent.add(accent)
    return out


def load_training_decoder(path: str) -> tuple[LiveSpeech2, dict]:
    obj = torch.load(path, map_location="cpu", weights_only=False)
    cfg = ModelConfig.from_dict(obj["config"])
    model = LiveSpeech2(cfg)
    model.load_state_dict(obj["model"] if "model" in obj else {k: v.float() for k, v in obj["state_dict"].items()})
    return model.eval(), obj


@torch.no_grad()
def fp16_check(model: LiveSpeech2, path: str, corpus: str, codes: str | None) -> dict:
    """Max |logit difference| and argmax agreement between the fp32 model and the
    fp16-stored one (loaded back to fp32 as the server does)."""
    from .dataset import DecoderData, collate

    loaded = load_decoder(path)
    batch = None
    if codes and os.path.isdir(codes):
        dev = DecoderData(corpus, codes, model.cfg, "dev")
        if len(dev):
            rng = random.Random(0)
            batch = collate([dev.example(i, rng) for i in range(min(4, len(dev)))], model)
    if batch is None:  # synthetic batch
        from .smoke import make_smoke_corpus
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            c, cd = make_smoke_corpus(tmp, n_q=model.cfg.n_acoustic_codebooks)
            d = DecoderData(c, cd, model.cfg, "train")
            batch = collate([d.example(i) for i in range(min(4, len(d)))], model)
    outs = []
    for m in (model, loaded):
        e = m.encode_enrollment(batch.enroll_codes, batch.enroll_len)
        outs.append(m(batch.inputs, e, batch.text_ids, batch.text_pos, batch.text_valid, phones=batch.phone_input))
    diff = max(float((a - b).abs().max()) for a, b in zip(*outs))
    agree = float(np.mean([float((a.argmax(-1) == b.argmax(-1)).float().mean()) for a, b in zip(*outs)]))
    return {"max_abs_logit_diff": diff, "argmax_agreement": agree}


def _run_log(run_dir: str) -> tuple[list[dict], list[dict]]:
    """(steps, evals) of a run's log.jsonl; none for a checkpoint that has no run beside it."""
    if not os.path.exists(os.path.join(run_dir, "log.jsonl")):
        return [], []
    return read_log(run_dir)


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def model_card(out: str, dec_obj: dict, dec_path: str, codec_path: str, corpus: str, records: list[dict],
               voices, check: dict, sizes: dict, shown_out: str | None = None) -> None:
    dec_run = os.path.dirname(os.path.abspath(dec_path))
    codec_run = os.path.dirname(os.path.abspath(codec_path))
    dsteps, devals = _run_log(dec_run)
    csteps, cevals = _run_log(codec_run)
    train = [r for r in records if r["split"] == "train"]
    cfg = dec_obj["config"]
    n_params = sum(v.numel() for v in dec_obj["model"].values()) if "model" in dec_obj else None
    last = dsteps[-1] if dsteps else {}
    lev = devals[-1] if devals else {}
    best_dev = min((e["dev_loss"] for e in devals), default=None)
    cev = [e for e in cevals if "dev_mel" in e]
    cbest = min(cev, key=lambda e: e["dev_mel"]) if cev else {}
    s_per_step = [r["s_per_step"] for r in dsteps[1:] if "s_per_step" in r]
    dargs = dec_obj.get("args", {})
    cargs = _read_json(os.path.join(codec_run, "args.json"))
    hours: dict[str, float] = {}
    for r in train:  # voice ids start with their synthesiser's name
        eng = r["voice"].split("-", 1)[0]
        hours[eng] = hours.get(eng, 0.0) + r["duration_s"] / 3600
    engines = ", ".join(f"{e} {h:.1f} h" for e, h in sorted(hours.items(), key=lambda kv: -kv[1]))
    lines = [
        "# Model card: livespeech default model",
        "",
        "Measured quality (WER, speaker similarity, MOS against ground truth and codec",
        "resynthesis) is in docs/eval.md; how it was trained is below and in docs/training.md.",
        "",
        "## Contents",
        f"- `decoder.pt`: LiveSpeech 2 decoder, preset `tiny` ({n_params / 1e6:.1f} M parameters, "
        f"d_model {cfg['d_model']}, {cfg['n_shared_layers']} shared + {len(cfg['codebook_groups'])}x"
        f"{cfg['n_group_layers']} group layers, groups {tuple(cfg['codebook_groups'])}), stored fp16 "
        f"({sizes['decoder.pt'] / 1e6:.1f} MB)." if n_params else "- `decoder.pt`",
        f"- `codec.pt`: causal EnCodec-style codec, preset `{cargs.get('preset', 'small')}` (8 x 1024 RVQ, 75 Hz "
        f"at 24 kHz), stored fp16 ({sizes['codec.pt'] / 1e6:.1f} MB; loaded back to fp32).",
        "- `voices/`: built-in reference voices (train-split eSpeak NG voices):",
    ]
    for vid, r, x in voices:
        lines.append(f"  - `{vid}`: {r['voice']} ({len(x) / SAMPLE_RATE:.1f} s, utterance {r['id']})")
    lines += [
        "",
        "## Training data",
        f"Synthetic corpus `{corpus}` built with `python -m livespeech.training.corpus build` (offline "
        f"sentence pool; train hours by synthesiser: {engines}): {len(records)} utterances, "
        f"{len(train)} train ({sum(r['duration_s'] for r in train) / 3600:.1f} h, "
        f"{len({r['voice'] for r in train})} voices). Dev/test use held-out sentences and "
        f"partly held-out voices. English only."
        + (f" The decoder also trained on {', '.join(str(c[0]) for c in dargs['extra_corpus'])} (`--extra-corpus`)."
           if dargs.get("extra_corpus") else ""),
        "",
        "## Codec",
        *([f"`python -m livespeech.training.codec_train` ({codec_run}): {max((r['step'] for r in csteps + cevals), default='?')} steps on "
           f"{cargs.get('device', '?')}, batch {cargs.get('batch', '?')} x {cargs.get('crop_s', '?')} s crops, AdamW lr "
           f"{cargs.get('lr', '?')}, L1 + multi-res STFT + mel, no discriminator.",
           f"Dev resynthesis (16 x 2 s dev crops, 8 codebooks): mel distance {cbest.get('dev_mel', float('nan')):.3f}, "
           f"multi-res STFT {cbest.get('dev_stft', float('nan')):.3f}, L1 {cbest.get('dev_l1', float('nan')):.4f}, "
           f"SNR {cbest.get('dev_snr_db', float('nan')):.1f} dB (step {cbest.get('step', '?')})."]
          if csteps or cevals else
          # an exported codec travels without its run; the README beside it says how it was made
          [f"`{codec_path}`, exported without its training run: how it was trained is in the README.md beside it."]),
        "",
        "## Decoder",
        f"`python -m livespeech.training.train` ({dec_run}): step {dec_obj.get('step', '?')}, AdamW lr "
        f"{dargs.get('lr', '?')} warmup+cosine, grad clip 1.0, length-bucketed batches of "
        f"<= {dargs.get('batch_frames', '?')} frames, A.5 streaming text mask with p="
        f"{dargs.get('stream_p', '?')}, LiveSpeech codebook loss weights "
        f"(lambda {cfg['cb_loss_lambda']}).",
        f"Speed: {np.median(s_per_step) if s_per_step else float('nan'):.2f} s/step median on "
        f"{dargs.get('device', '?')}.",
        f"Last train log (step {last.get('step', '?')}): weighted loss {last.get('loss', float('nan')):.3f}, "
        f"grapheme CE {last.get('ce_graph', float('nan')):.3f} (acc {last.get('acc_graph', float('nan')):.3f}), "
        f"acoustic CE mean {last.get('ce_acoustic', float('nan')):.3f} (acc {last.get('acc_acoustic', float('nan')):.3f}).",
        f"Dev (full text context, step {lev.get('step', '?')}): sum CE {lev.get('dev_loss', float('nan')):.3f} "
        f"(best {best_dev if best_dev is not None else float('nan'):.3f}), grapheme CE "
        f"{lev.get('dev_loss_graph', float('nan')):.3f} / acc {lev.get('dev_acc_graph', float('nan')):.3f}, "
        f"acoustic CE {lev.get('dev_loss_acoustic', float('nan')):.3f} / acc {lev.get('dev_acc_acoustic', float('nan')):.3f}.",
        f"Per-codebook dev CE: {lev.get('dev_loss_k', [])}.",
        *([f"Dev at its starting point (`--init`, before the first step): sum CE {devals[0]['dev_loss']:.3f}."]
          if devals and devals[0].get("start") else []),
        "",
        "## fp16 check",
        f"Logits of the fp32 model vs `decoder.pt` loaded back: max |diff| {check['max_abs_logit_diff']:.4f}, "
        f"argmax agreement {check['argmax_agreement']:.4f}.",
        "",
        "## Reproduce",
        "The stages and their options are in docs/training.md (one CUDA machine: "
        "`scripts/train_gpu.sh`). This directory was written by:",
        "```",
        f"python -m livespeech.training.export --codec {codec_path} --decoder {dec_path} --corpus {corpus} --out {shown_out or out}",
        "```",
        "",
    ]
    with open(os.path.join(out, "MODEL_CARD.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m livespeech.training.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codec", required=True)
    p.add_argument("--decoder", required=True)
    p.add_argument("--corpus", required=True)
    p.add_argument("--codes", default="data/codes", help="for the fp16 check on dev examples")
    p.add_argument("--out", required=True)
    p.add_argument("--n-voices", type=int, default=4)
    p.add_argument("--codec-fp32", action="store_true", help="store the codec in fp32 (default fp16)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)

    tmp_out = a.out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp_out, ignore_errors=True)
    os.makedirs(os.path.join(tmp_out, "voices"))
    model, dec_obj = load_training_decoder(a.decoder)
    dec_path = os.path.join(tmp_out, "decoder.pt")
    save_decoder(model, dec_path, half=True, meta={"step": dec_obj.get("step"), "source": os.path.abspath(a.decoder),
                                                    "exported": time.strftime("%Y-%m-%d %H:%M:%S")})
    codec = CodecModel.from_checkpoint(a.codec)
    # fp16 storage by default (loaded back to fp32): decode max |diff| ~2e-4, halves the file
    codec.save(os.path.join(tmp_out, "codec.pt"), half=not a.codec_fp32)
    records = read_manifest(a.corpus)
    voices = pick_voices(a.corpus, records, a.n_voices)
    for vid, r, x in voices:
        write_wav(os.path.join(tmp_out, "voices", f"{vid}.wav"), x, SAMPLE_RATE)
    check = fp16_check(model, dec_path, a.corpus, a.codes)
    print(f"fp16 check: {check}", flush=True)
    sizes = {f: os.path.getsize(os.path.join(tmp_out, f)) for f in ("decoder.pt", "codec.pt")}
    model_card(tmp_out, dec_obj, a.decoder, a.codec, a.corpus, records, voices, check, sizes, shown_out=a.out)
    # swap in atomically-ish: the server may be reading the old directory
    t = time.time()
    bundle = load_bundle(tmp_out)
    print(f"load_bundle: {time.time() - t:.2f} s, voices {sorted(bundle.builtin_voices)}", flush=True)
    if os.path.isdir(a.out):
        old = a.out.rstrip("/") + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(a.out, old)
        os.replace(tmp_out, a.out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        os.replace(tmp_out, a.out)
    total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(a.out) for f in fs)
    print(f"exported {a.out}: {total / 1e6:.1f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
