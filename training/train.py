"""Train the LiveSpeech 2 decoder (models/livespeech.py, preset 'tiny') on corpus codes.

    python -m livespeech.training.train --corpus data/corpus --codes data/codes --out runs/decoder \
        [--resume] [--device cpu|cuda] [--steps N]
    python -m livespeech.training.train --smoke --out /tmp/smoke      # tiny synthetic run (tests)

Examples follow the server's inference layout (training/dataset.py). Loss = sum over
codebooks of w_k * CE_k with LiveSpeech's accuracy-based weights (CodebookLossWeights);
AdamW with warmup + cosine decay, grad clip 1.0, length-bucketed batches under a frame
budget. The text mask is the full context, or with probability --stream-p the A.5
streaming dropout mask (Algorithm 2, r1/r2 drawn in [1, 3]).

Writes to --out:
  last.pt     resumable checkpoint (model, optimizer, step, loss weights, all RNG and
              sampler state): `--resume` continues exactly where it stopped
  best.pt     same format, lowest dev loss so far
  log.jsonl   one JSON line per logged step / dev evaluation
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import random
import sys
import threading
import time
from typing import NamedTuple, Optional

import numpy as np
import torch

from livespeech.api.session import SessionConfig
from livespeech.models.attention import streaming_dropout_mask
from livespeech.models.config import ModelConfig, preset
from livespeech.models.derived import cpu_has_bf16_dot
from livespeech.models.guidance import _sample_rows
from livespeech.models.livespeech import CodebookLossWeights, LiveSpeech2, codebook_losses

from .dataset import Batch, DecoderData, collate
from .schedule import Schedule, setup_device


def _corpus_and_codes(s: str) -> tuple[str, str]:
    corpus, sep, codes = s.rpartition(":")
    if not sep or not corpus or not codes:
        raise argparse.ArgumentTypeError(f"expected CORPUS:CODES, got {s!r}")
    return corpus, codes


def parse_boost(s: str) -> dict[int, float]:
    """'1:3' or '1:3,0:1.5' -> {codebook: factor} (--codebook-boost)."""
    try:
        return {int(k): float(x) for k, x in (part.split(":") for part in s.split(",") if part.strip())}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K:X[,K:X], got {s!r}") from None


def parse_overrides(s: Optional[str]) -> dict:
    """'d_model=128,n_shared_layers=2' -> dict (ints/floats/tuples as written)."""
    out = {}
    if not s:
        return out
    for part in s.split(";") if ";" in s else s.split(","):
        if not part.strip():
            continue
        k, v = part.split("=")
        v = v.strip()
        if "/" in v:
            out[k.strip()] = tuple(int(x) for x in v.split("/"))
        else:
            try:
                out[k.strip()] = int(v)
            except ValueError:
                out[k.strip()] = float(v)
    return out


class Sampler:
    """Epochs of length-bucketed batches of utterance ids; its state is plain data so a
    resume continues with the same batches."""

    def __init__(self, seed: int, batch_frames: int, max_batch: int):
        self.rng = random.Random(seed)
        self.batch_frames = batch_frames
        self.max_batch = max_batch
        self.epoch = 0
        self.batches: list[list[str]] = []
        self.pos = 0

    def next(self, data: DecoderData) -> list[int]:
        while True:
            if self.pos >= len(self.batches):
                self.batches = [[data.items[i]["rec"]["id"] for i in b]
                                for b in data.buckets(self.batch_frames, self.max_batch, self.rng)]
                self.pos = 0
                self.epoch += 1
            ids = self.batches[self.pos]
            self.pos += 1
            idx = [data.index[u] for u in ids if u in data.index]
            if idx:
                return idx

    def state(self) -> dict:
        return {"rng": self.rng.getstate(), "epoch": self.epoch, "batches": self.batches, "pos": self.pos}

    def load(self, st: dict) -> None:
        self.rng.setstate(_tuplify(st["rng"]))
        self.epoch, self.batches, self.pos = st["epoch"], st["batches"], st["pos"]


class BatchPrefetch:
    """The training batches drawn, read and collated on a thread of their own, up to
    `depth` ahead of the step that takes them: a batch of ~80,000 frames costs 70-450 ms
    of one core (2-core Intel Xeon VM; the least once its codes are cached), which a GPU's
    step of ~180 ms would otherwise wait for. Batch s is a function of the sampler's state
    and of s alone (its examples draw from a generator seeded by the step), so a resumed
    run takes the batches a straight one does; each comes with the sampler's state after
    it, which a checkpoint saves, and the number of training utterances it was drawn
    from. While an encoder is still filling the codes directory, the data is re-read
    every `rescan_every` steps."""

    def __init__(self, load_data, data: DecoderData, sampler: Sampler, model: LiveSpeech2, seed: int,
                 first_step: int, rescan_every: int, pin: bool = False, depth: int = 2):
        self._load_data, self._data, self._sampler, self._model = load_data, data, sampler, model
        self._seed, self._step, self._rescan_every, self._pin = seed, first_step, rescan_every, pin
        self._queue: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batches", daemon=True)
        self._thread.start()

    def next(self) -> tuple[Batch, dict, int]:
        """(the next step's batch, the sampler's state after it, the training utterances)."""
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():  # a producer blocked on a full queue takes its stop
            try:
                self._queue.get(timeout=0.1)
            except queue.Empty:
                pass
        self._thread.join()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                s = self._step
                if self._data.missing and s > 0 and s % self._rescan_every == 0:
                    self._data = self._load_data()
                idx = self._sampler.next(self._data)
                rng = random.Random(self._seed * 1_000_039 + s)
                batch = collate([self._data.example(i, rng) for i in idx], self._model)
                if self._pin:
                    batch = batch.pin_memory()
                self._put((batch, self._sampler.state(), len(self._data)))
                self._step += 1
        except BaseException as e:  # noqa: BLE001 - the training loop raises it
            self._put(e)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                pass


def _tuplify(x):
    return tuple(_tuplify(i) for i in x) if isinstance(x, (list, tuple)) else x


def corrupt_history(inputs: torch.Tensor, p: float, none_ids: list[int], codebook_size: int,
                    gen: torch.Generator) -> torch.Tensor:
    """`inputs` [B, K, S] with the acoustic codes read back at a share `p` of the steps (all
    acoustic codebooks of the step) replaced by random codes; graphemes and "none" ids kept.
    Teacher forcing feeds the true previous codes, from which codebook 1 is mostly a copy; in
    decoding they are the model's own samples, so a model that leans on them drifts. Noisy
    history makes it name the sound from its text and letters (training inputs only)."""
    if p <= 0:
        return inputs
    b, k, s = inputs.shape
    hit = torch.rand(b, 1, s, generator=gen) < p
    rnd = torch.randint(0, codebook_size, (b, k - 1, s), generator=gen)
    return _with_acoustic_history(inputs, hit, rnd, none_ids)


def drop_text(text_mask: torch.Tensor, p: float, gen: torch.Generator) -> torch.Tensor:
    """`text_mask` ([B, L] or [B, S, L]) with every text key hidden from a share `p` of the
    batch's rows: those rows train the decoder without its text, the unconditional model
    that classifier-free guidance (models/livespeech.py `text_guided`) steers away from; the
    enrollment stays visible, so the voice is kept."""
    if p <= 0:
        return text_mask
    keep = torch.rand(text_mask.shape[0], generator=gen) >= p
    return text_mask & keep.to(text_mask.device).view(-1, *([1] * (text_mask.dim() - 1)))


def _with_acoustic_history(inputs: torch.Tensor, hit: torch.Tensor, codes: torch.Tensor,
                           none_ids: list[int]) -> torch.Tensor:
    """`inputs` [B, K, S] with the acoustic rows at the steps `hit` [B, 1, S] taken from
    `codes` [B, K - 1, S]; the graphemes and the "none" ids of the delay pattern are kept."""
    acoustic = inputs[:, 1:]
    none = torch.tensor(none_ids[1:], device=inputs.device).view(1, -1, 1)
    out = inputs.clone()
    out[:, 1:] = torch.where(hit & (acoustic != none), codes, acoustic)
    return out


class OwnSampling(NamedTuple):
    """How `own_history` samples the model's codes: top-k of each codebook (0: all codes)
    and softmax temperatures for codebook 1 and codebooks 2..Q (0: greedy)."""
    top_k: int = 0
    first_codebook_temperature: float = 1.0
    acoustic_temperature: float = 1.0

    @classmethod
    def named(cls, name: str) -> "OwnSampling":
        """"full": the model's whole distribution; "session": what a server session samples
        by default (SessionConfig's top_k and temperatures)."""
        if name == "full":
            return cls()
        if name == "session":
            c = SessionConfig()
            return cls(c.top_k, c.first_codebook_temperature, c.acoustic_temperature)
        raise ValueError(f"unknown own sampling {name!r} (full or session)")


def _sample_codes(lg: torch.Tensor, u: torch.Tensor, top_k: int, temperature: float) -> torch.Tensor:
    """[B, S, V] logits -> [B, S] codes by inverse CDF at the uniforms u [B, S], after the
    temperature and top-k (temperature 0: the most likely code)."""
    lg = lg.float()
    if temperature == 0:
        return lg.argmax(-1)
    lg = lg / temperature
    if 0 < top_k < lg.shape[-1]:  # the server's top-k sampler (models/guidance.py)
        rows = lg.reshape(-1, lg.shape[-1])
        k = torch.full((rows.shape[0],), top_k, dtype=torch.long, device=rows.device)
        return _sample_rows(rows, k, top_k, u.reshape(-1)).view(u.shape)
    cdf = lg.softmax(-1).cumsum(-1)
    return (cdf < u[..., None] * cdf[..., -1:]).sum(-1).clamp_max(lg.shape[-1] - 1)


def own_history(model: LiveSpeech2, batch: Batch, text_mask: torch.Tensor, p: float,
                gen: torch.Generator, passes: int = 1, sampling: OwnSampling = OwnSampling()) -> torch.Tensor:
    """`batch.inputs` with the acoustic codes read back at a share `p` of the steps (all
    acoustic codebooks of the step) replaced by the model's own samples: a pass without
    gradients samples every step's codes (as `sampling` says), and a chosen step reads back what
    was sampled for the step before it instead of the truth (parallel scheduled sampling,
    Duckworth et al. 2019). The first pass is teacher-forced; each further pass reads back
    every step's sample of the pass before, so after `passes` passes a step's sample follows
    that many steps of the model's own history, as in decoding, where errors compound.
    Random codes (`corrupt_history`) teach the model to ignore history that is implausible;
    its own samples are the errors decoding feeds it. Graphemes, "none" ids and the first
    step are kept; uniforms come from the CPU generator `gen`."""
    if p <= 0:
        return batch.inputs
    inputs = batch.inputs
    b, k, s = inputs.shape
    hit = (torch.rand(b, 1, s, generator=gen) < p).to(inputs.device)
    history = inputs
    with torch.no_grad():
        enroll = model.encode_enrollment(batch.enroll_codes, batch.enroll_len)
        for i in range(passes):
            u = torch.rand(b, k - 1, s, generator=gen).to(inputs.device)
            logits = model(history, enroll, batch.text_ids, batch.text_pos, text_mask, phones=batch.phone_input)
            sampled = [_sample_codes(lg, u[:, j], sampling.top_k, sampling.first_codebook_temperature if j == 0
                                     else sampling.acoustic_temperature) for j, lg in enumerate(logits[1:])]
            read_back = torch.cat((inputs[:, 1:, :1], torch.stack(sampled, 1)[:, :, :-1]), 2)
            history = _with_acoustic_history(inputs, hit if i == passes - 1 else torch.ones_like(hit), read_back,
                                             model.none_ids())
    return history


def text_mask_for(batch: Batch, stream: bool, gen: torch.Generator, r1: int, r2: int) -> torch.Tensor:
    if not stream:
        return batch.text_valid
    b, _, s = batch.inputs.shape
    qpos = torch.arange(s, device=batch.inputs.device).unsqueeze(0).expand(b, s)
    return streaming_dropout_mask(qpos, batch.text_pos, batch.text_valid, r1, r2, generator=gen)


def forward_loss(model: LiveSpeech2, batch: Batch, text_mask: torch.Tensor, weights: torch.Tensor,
                 read_heads: int = 0):
    """(weighted codebook loss, CE per codebook, accuracy per codebook, reading) where
    reading is `reading_loss` of the first ``read_heads`` heads of every layer (None at 0)."""
    enroll = model.encode_enrollment(batch.enroll_codes, batch.enroll_len)
    text_weights: Optional[list] = [] if read_heads > 0 else None
    logits = model(batch.inputs, enroll, batch.text_ids, batch.text_pos, text_mask, text_weights, batch.phone_input)
    losses, accs = codebook_losses(logits, batch.targets, batch.valid)
    total = (weights.to(losses.device) * losses).sum()
    reading = None if text_weights is None else reading_loss(text_weights, batch.reading, text_mask, read_heads)
    return total, losses, accs, reading


def spoken_word_mass(text_weights: list[torch.Tensor], reading: torch.Tensor, text_mask: torch.Tensor,
                     heads: int) -> Optional[torch.Tensor]:
    """[N, layers, heads] the attention mass the first ``heads`` heads of each layer put on
    the tokens each step reads, over the N steps whose tokens are visible under
    ``text_mask`` (None when there is none). text_weights: per layer [B, H, S, L] (softmax
    over enrollment and text keys); reading [B, 2, S] the tokens [first, end) each step
    reads (-1: none; dataset.reading_targets)."""
    ln = text_weights[0].shape[-1]
    idx = torch.arange(ln, device=reading.device)
    target = (idx >= reading[:, 0, :, None]) & (idx < reading[:, 1, :, None])  # [B, S, L]
    mask = text_mask if text_mask.dim() == 3 else text_mask[:, None, :]
    target = target & mask
    keep = target.any(-1)  # [B, S]
    if not keep.any():
        return None
    w = torch.stack([tw[:, :heads] for tw in text_weights], 1)  # [B, layers, heads, S, L]
    mass = (w * target[:, None, None].to(w.dtype)).sum(-1).float()  # [B, layers, heads, S]
    return mass.permute(0, 3, 1, 2)[keep]


def reading_loss(text_weights: list[torch.Tensor], reading: torch.Tensor, text_mask: torch.Tensor,
                 heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, mean mass): -log of `spoken_word_mass`, the reading heads' attention on the
    word each step speaks. The synthesisers' word timings tell which word is spoken at
    each frame; without this the cross-attention must find that alignment from the
    codebook losses alone (slowly: docs/training.md)."""
    mass = spoken_word_mass(text_weights, reading, text_mask, heads)
    if mass is None:
        zero = text_weights[0].sum() * 0.0
        return zero, zero.detach()
    return -torch.log(mass + 1e-4).mean(), mass.mean().detach()


class PhoneHead(torch.nn.Module):
    """Training only (`--phone-weight`): a linear classifier of the phone of the frame
    codebook 1 predicts, on the first codebook group's normalised hidden state (read by a
    forward hook on `model.group_norms[0]`), so that the state the codebook-1 head reads
    learns to carry the phone. Not part of the exported decoder."""

    def __init__(self, model: LiveSpeech2, names: list[str]):
        super().__init__()
        self.names = list(names)
        self.proj = torch.nn.Linear(model.cfg.d_model, len(names), device=next(model.parameters()).device)
        self._hidden: Optional[torch.Tensor] = None
        model.group_norms[0].register_forward_hook(lambda _m, _i, out: setattr(self, "_hidden", out))

    def loss(self, phones: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cross-entropy, accuracy) on the labelled steps of the last forward's batch."""
        from .phones import IGNORE

        h, self._hidden = self._hidden, None
        logits = self.proj(h)
        keep = phones != IGNORE
        if not keep.any():
            zero = logits.sum() * 0.0
            return zero, zero.detach()
        lg, y = logits[keep].float(), phones[keep]
        return torch.nn.functional.cross_entropy(lg, y), (lg.argmax(-1) == y).float().mean()


def phone_vocab_for(corpora: list[str], saved: Optional[list[str]] = None, min_count: int = 20):
    """The PhoneVocab of the training corpora's phone timelines (or a checkpoint's own)."""
    from .dataset import read_manifest
    from .phones import PhoneVocab

    if saved is not None:
        return PhoneVocab(tuple(saved))
    return PhoneVocab.from_records([r for c in corpora for r in read_manifest(c)
                                    if r["split"] == "train" and r.get("phones")], min_count)


def grapheme_logits(model: LiveSpeech2, b: Batch, text: Batch, text_weights: Optional[list] = None) -> torch.Tensor:
    """Teacher-forced grapheme logits [B, S, G] of batch ``b`` reading the text of ``text``
    (b itself, or b with the utterances' texts rotated: how much the letters come from
    reading); ``text_weights`` as `LiveSpeech2.forward` takes it."""
    enroll = model.encode_enrollment(b.enroll_codes, b.enroll_len)
    return model(b.inputs, enroll, text.text_ids, text.text_pos, text.text_valid, text_weights, b.phone_input)[0]


def letter_change_hits(logits: torch.Tensor, b: Batch, bar_current: bool = False) -> tuple[int, int]:
    """(right, total) next-letter predictions (`grapheme_logits`) of batch ``b`` at the
    frames where its letter changes. ``bar_current``: the argmax over the letters other
    than the current one (which letter comes next, not when)."""
    target, current = b.targets[:, 0], b.inputs[:, 0]  # the grapheme row's input is the previous letter
    change = b.valid[:, 0] & (target != current)
    if bar_current:
        logits = logits.scatter(-1, current.clamp(max=logits.shape[-1] - 1).unsqueeze(-1), float("-inf"))
    right = (logits.argmax(-1) == target) & change
    return int(right.sum()), int(change.sum())


def _rotate_texts(b: Batch) -> Batch:
    fields = {f: getattr(b, f) for f in b.__dataclass_fields__}
    for f in ("text_ids", "text_pos", "text_valid"):
        fields[f] = fields[f].roll(1, 0)
    return Batch(**fields)


@torch.no_grad()
def evaluate(model: LiveSpeech2, batches: list[Batch], device, phone_head: Optional[PhoneHead] = None,
             read_heads: int = 1) -> dict:
    """Dev losses and accuracies with the full text context, and reading: next-letter
    accuracy at letter changes with the true text and with another utterance's text, and
    the attention mass the first ``read_heads`` heads of each layer put on the word being
    spoken (`reading_loss`); with a phone head, its accuracy."""
    model.eval()
    k = model.cfg.n_codebooks
    sl, sa, n = torch.zeros(k), torch.zeros(k), 0
    phone_acc, read_mass = [], []
    read = {"true": [0, 0], "other": [0, 0]}
    for b in batches:
        b = b.to(device)
        _, losses, accs, reading = forward_loss(model, b, b.text_valid, torch.ones(k), read_heads)
        read_mass.append(float(reading[1]))
        if phone_head is not None:
            phone_acc.append(float(phone_head.loss(b.phones)[1]))
        sl += losses.cpu()
        sa += accs.cpu()
        n += 1
        for name, text in (("true", b), ("other", _rotate_texts(b))):
            if name == "other" and b.text_ids.shape[0] < 2:
                continue
            r, t = letter_change_hits(grapheme_logits(model, b, text), b)
            read[name][0] += r
            read[name][1] += t
    model.train()
    sl, sa = sl / max(n, 1), sa / max(n, 1)
    acc = {name: r / t if t else float("nan") for name, (r, t) in read.items()}
    return {"dev_loss": float(sl.sum()), "dev_loss_graph": float(sl[0]), "dev_loss_acoustic": float(sl[1:].mean()),
            "dev_acc_graph": float(sa[0]), "dev_acc_acoustic": float(sa[1:].mean()),
            "dev_read_acc": round(acc["true"], 4), "dev_read_acc_other_text": round(acc["other"], 4),
            "dev_read_mass": round(float(np.mean(read_mass)), 4),
            "dev_loss_k": [round(float(x), 4) for x in sl], "dev_acc_k": [round(float(x), 4) for x in sa],
            **({"dev_phone_acc": round(float(np.mean(phone_acc)), 4)} if phone_acc else {})}


def dev_batches(data: DecoderData, model: LiveSpeech2, n_batches: int, batch_size: int) -> list[Batch]:
    rng = random.Random(1234)
    idx = sorted(range(len(data)), key=lambda i: data.items[i]["rec"]["id"])
    rng.shuffle(idx)
    idx = idx[: n_batches * batch_size]
    idx.sort(key=lambda i: data.items[i]["T"])
    out = []
    for j in range(0, len(idx), batch_size):
        out.append(collate([data.example(i, rng) for i in idx[j:j + batch_size]], model))
    return out


def save_checkpoint(path: str, model, opt, step: int, lw: CodebookLossWeights, sampler_state: dict,
                    mask_gen: torch.Generator, py_rng: random.Random, best: float, args: dict, extra: dict) -> None:
    obj = {
        "config": model.cfg.to_dict(), "model": model.state_dict(), "opt": opt.state_dict(), "step": step,
        "loss_acc": lw.acc.cpu().clone(), "sampler": sampler_state, "mask_gen": mask_gen.get_state(),
        "py_rng": py_rng.getstate(), "torch_rng": torch.get_rng_state(), "np_rng": np.random.get_state(),
        "best": best, "args": args, **extra,
    }
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def choose_scan(want: str, model: torch.nn.Module, device: torch.device) -> str:
    """Put the model's Mamba blocks on the Triton scan where asked and sound (see --scan);
    says which scan trains."""
    if want == "torch":
        return "pytorch"
    if device.type != "cuda":
        if want == "triton":
            raise SystemExit("--scan triton needs a CUDA device")
        return "pytorch"
    try:
        from livespeech.models.mamba_triton import check_against_torch, time_against_torch, use_triton_scan

        err = check_against_torch(device)
        why = f"differs from the PyTorch scan by {err:.1e}" if not err < 1e-4 else ""
        if not why:
            t_torch, t_triton = time_against_torch(device)
            speed = f"{t_torch * 1e3:.1f} ms PyTorch, {t_triton * 1e3:.1f} ms Triton a forward + backward"
            if want == "auto" and t_triton >= t_torch:
                why = f"is no faster: {speed}"
    except Exception as e:  # no Triton, or its compiler fails on this machine
        why = f"{type(e).__name__}: {e}"
    if why:
        if want == "triton":
            raise SystemExit(f"--scan triton: {why}")
        return f"pytorch (the Triton scan {why})"
    return f"triton ({use_triton_scan(model)} blocks; matches the PyTorch scan to {err:.1e}; {speed})"


def load_trained_decoder(path: str) -> LiveSpeech2:
    """The decoder of an exported decoder.pt or of a run's own checkpoint (last.pt /
    best.pt: our file, which also holds the optimizer state, so not loadable weights-only)."""
    from livespeech.models.loading import decoder_from_weights

    obj = torch.load(path, map_location="cpu", weights_only=False)
    return decoder_from_weights(obj if "state_dict" in obj else {"config": obj["config"], "state_dict": obj["model"]})


def build_model(cfg: ModelConfig, device) -> LiveSpeech2:
    # the device goes to the constructor too: make_mamba picks mamba-ssm's kernels from it
    return LiveSpeech2(cfg, device=device).to(device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m livespeech.training.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default="data/corpus")
    p.add_argument("--codes", default="data/codes")
    p.add_argument("--extra-corpus", type=_corpus_and_codes, action="append", default=[], metavar="CORPUS:CODES",
                   help="also train on this corpus's train split, its codes in CODES (its manifest and codes "
                        "suffice: a voice synthesised elsewhere); dev stays --corpus's. Repeatable")
    p.add_argument("--out", default="runs/decoder")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--init", default=None,
                   help="start from these weights (an exported decoder.pt) with a fresh optimizer; ignored on --resume")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cuda-memory-share", type=float, default=1.0,
                   help="the share of the GPU's memory this run may hold (runs side by side on one GPU)")
    p.add_argument("--steps", type=int, default=2000, help="total steps (also sets the LR schedule)")
    p.add_argument("--stop-at", type=int, default=None, help="stop at this step (schedule still uses --steps)")
    p.add_argument("--smoke", action="store_true", help="tiny synthetic corpus + small model, a few steps")
    p.add_argument("--model-overrides", default=None, help="preset('tiny', **overrides), e.g. d_model=128")
    p.add_argument("--batch-frames", type=int, default=3000, help="padded frames per batch")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-seconds", type=float, default=8.0, help="skip longer utterances")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--stream-p", type=float, default=0.5, help="probability of the A.5 streaming text mask")
    p.add_argument("--stream-after", type=float, default=0.5,
                   help="share of the run (the LR schedule's progress) before the streaming mask is used: the "
                        "model first learns to read its text with the whole text visible (the paper's [M5]); 0: from the start")
    p.add_argument("--text-embedding", choices=("table", "spelling"), default=None,
                   help="a new model's text-token embedding (models/spelling.py; default spelling); "
                        "--init / --resume keep their model's")
    p.add_argument("--autocast", choices=("auto", "bf16", "off"), default="auto",
                   help="bfloat16 autocast of the forward pass: auto = on a CPU with bf16 dot products "
                        "(AVX512-BF16 / AMX); off elsewhere and on CUDA (not yet measured there)")
    p.add_argument("--phone-weight", type=float, default=0.0,
                   help="weight of an auxiliary loss: the phone of the frame codebook 1 predicts, classified from "
                        "the first codebook group's hidden state (PhoneHead; corpora with phone timelines; training "
                        "only, not exported); 0: off")
    p.add_argument("--phone-input", metavar="FRONT_END", default=None,
                   help="the decoder reads each step the phone this front end (front_end.pt) gives the frame "
                        "codebook 1 predicts, from the letters on their frames, as the letter schedule gives it "
                        "a session; with --init from a decoder without it, its phone embedding starts at zero")
    p.add_argument("--phone-min-count", type=int, default=20,
                   help="the phone head's classes: phones with at least this many segments (rarer: unlabelled)")
    p.add_argument("--scan", choices=("auto", "torch", "triton"), default="auto",
                   help="the Mamba blocks' selective scan: triton = models/mamba_triton.py's kernels (CUDA); auto = "
                        "those on CUDA when they import and match the PyTorch scan on the device "
                        "(check_against_torch), else the PyTorch scan (models/mamba.py)")
    p.add_argument("--history-noise", type=float, default=0.0,
                   help="share of training steps whose acoustic input codes (the previous frames read back) are "
                        "replaced by random codes (corrupt_history): codebook 1 learnt from the text and letters "
                        "rather than copied from the true history teacher forcing gives; 0: off")
    p.add_argument("--own-history", type=float, default=0.0,
                   help="share of training steps whose acoustic input codes are the model's own samples from a "
                        "teacher-forced pass without gradients (own_history, parallel scheduled sampling; ~1.3x "
                        "the step's time); 0: off")
    p.add_argument("--own-passes", type=int, default=1,
                   help="passes without gradients behind --own-history: each further pass reads back every step's "
                        "sample of the pass before, so the history holds errors compounded over that many steps "
                        "(own_history; each pass costs about a third of a training step)")
    p.add_argument("--text-dropout", type=float, default=0.0,
                   help="share of each batch's utterances trained with no text visible (drop_text): the "
                        "unconditional model that classifier-free guidance needs (ServerConfig.text_cfg_scale); 0: off")
    p.add_argument("--own-sampling", choices=("full", "session"), default="full",
                   help="how --own-history samples: the model's whole distribution (full), or as a server session "
                        "does by default (session: SessionConfig's top-k and codebook temperatures)")
    p.add_argument("--letters", choices=("even", "phones"), default="phones",
                   help="grapheme targets: a word's letters over its phones with pauses as SPACE, where the corpus "
                        "has phone timelines (phones), or the manifest's even split (even)")
    p.add_argument("--eos-jitter", type=float, default=0.0,
                   help="log-normal sigma of the end-of-text key's position around the last frame "
                        "(0: at the last frame, as the paper; training data only, dev stays exact)")
    p.add_argument("--codebook-boost", type=parse_boost, default=parse_boost("0:3,1:3"), metavar="K:X[,K:X]",
                   help="multiply codebook K's loss weight by X (0 = graphemes, 1 = the first acoustic "
                        "codebook), before the weights are normalised to mean 1. Default 0:3,1:3: the "
                        "accuracy-based weights alone give the letters and codebook 1, which carry what "
                        "is said, the least; '' for none")
    p.add_argument("--read-weight", type=float, default=0.0,
                   help="weight of the reading loss (reading_loss): the first --read-heads heads of every layer's "
                        "cross-attention are pulled onto the word each frame speaks (corpus word timings); 0: off")
    p.add_argument("--read-heads", type=int, default=1, help="heads per layer the reading loss trains (and dev measures)")
    p.add_argument("--ckpt-minutes", type=float, default=3.0)
    p.add_argument("--ckpt-every", type=int, default=None, help="also checkpoint every N steps")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--dev-batches", type=int, default=4)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--rescan-every", type=int, default=200, help="re-read codes dir (encoding may still run)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None, help="stop (with a checkpoint) after this long")
    p.add_argument("--minutes", type=float, default=None,
                   help="run length in training minutes instead of --steps (the LR decays over it)")
    a = p.parse_args(argv)

    device = setup_device(a.device, a.threads, a.cuda_memory_share)
    os.makedirs(a.out, exist_ok=True)
    overrides = parse_overrides(a.model_overrides)
    if a.smoke:
        from .smoke import make_smoke_corpus

        a.corpus, a.codes = make_smoke_corpus(os.path.join(a.out, "smoke_data"), n_q=preset("tiny").n_acoustic_codebooks)
        overrides = {**dict(d_model=64, n_shared_layers=1, n_group_layers=1, n_heads=2, enc_d_model=64,
                            enc_layers=1, enc_heads=2, n_enroll=8), **overrides}
        a.batch_frames, a.max_batch, a.eval_every, a.dev_batches = 400, 4, 5, 1
        a.warmup, a.log_every, a.rescan_every = 2, 1, 10**9
        a.phone_min_count = 1
        a.max_seconds = 30.0
    last_path = os.path.join(a.out, "last.pt")
    st = init = None
    if a.resume and os.path.exists(last_path):
        st = torch.load(last_path, map_location="cpu", weights_only=False)
    elif a.init:
        init = load_trained_decoder(a.init)
    front_end = None
    if a.phone_input:
        from livespeech.models.front_end import FrontEnd

        front_end = FrontEnd.load(a.phone_input)
        overrides.setdefault("n_phones", len(front_end.phone_names))
        if init is not None and not init.cfg.n_phones:  # continued with a phone input it did not have
            init_cfg = dataclasses.replace(init.cfg, n_phones=overrides["n_phones"])
            grown = build_model(init_cfg, torch.device("cpu"))
            missing, unexpected = grown.load_state_dict(init.state_dict(), strict=False)
            if unexpected or set(missing) != {"phone_emb.weight"}:
                raise SystemExit(f"--init {a.init}: its weights do not fit a decoder with a phone input")
            init = grown
    if a.text_embedding or init is None:
        overrides.setdefault("text_embedding", a.text_embedding or "spelling")
    else:
        overrides.setdefault("text_embedding", init.cfg.text_embedding)
    cfg = preset("tiny", **overrides)
    if st is not None:
        cfg = ModelConfig.from_dict(st["config"])
    elif init is not None:
        if not parse_overrides(a.model_overrides) and not a.smoke:  # the exported model's own configuration
            cfg = init.cfg
        if front_end is not None and cfg.n_phones != len(front_end.phone_names):
            raise SystemExit(f"--phone-input {a.phone_input}: {len(front_end.phone_names)} phones, the decoder "
                             f"reads {cfg.n_phones}")
        if init.cfg.to_dict() != cfg.to_dict():
            raise SystemExit(f"--init {a.init}: its model config differs from the one asked for")
    torch.manual_seed(a.seed)
    model = build_model(cfg, device)
    n_params = sum(x.numel() for x in model.parameters())
    if not 1 <= a.read_heads <= cfg.n_heads:
        raise SystemExit(f"--read-heads {a.read_heads}: the model has {cfg.n_heads} heads a layer")
    if a.own_passes < 1:
        raise SystemExit(f"--own-passes {a.own_passes}: at least one pass")
    if not 0 <= a.text_dropout < 1:
        raise SystemExit(f"--text-dropout {a.text_dropout}: a share in [0, 1)")
    phone_head = phone_vocab = None
    if a.phone_weight > 0:
        phone_vocab = phone_vocab_for([a.corpus, *(c for c, _ in a.extra_corpus)],
                                      st.get("phone_vocab") if st is not None else None, a.phone_min_count)
        phone_head = PhoneHead(model, list(phone_vocab.names))
        print(f"phone head: {len(phone_vocab)} classes, weight {a.phone_weight}", flush=True)
    decay = [p_ for n, p_ in model.named_parameters() if p_.dim() >= 2 and "emb" not in n]
    no_decay = [p_ for n, p_ in model.named_parameters() if not (p_.dim() >= 2 and "emb" not in n)]
    if phone_head is not None:
        decay.append(phone_head.proj.weight)
        no_decay.append(phone_head.proj.bias)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.98),
                            fused=device.type in ("cpu", "cuda"))
    lw = CodebookLossWeights(cfg.n_codebooks, cfg.cb_loss_lambda, boost=a.codebook_boost)
    sampler = Sampler(a.seed, a.batch_frames, a.max_batch)
    mask_gen = torch.Generator().manual_seed(a.seed + 1)
    py_rng = random.Random(a.seed + 2)
    step, best, train_s = 0, float("inf"), 0.0
    if init is not None:
        model.load_state_dict(init.state_dict())
        print(f"initialised from {a.init}", flush=True)
    if st is not None:
        model.load_state_dict(st["model"])
        if phone_head is not None:
            if "phone_head" not in st:
                raise SystemExit(f"--phone-weight: {last_path} was trained without the phone head")
            phone_head.load_state_dict(st["phone_head"])
        opt.load_state_dict(st["opt"])
        step, best, train_s = st["step"], st["best"], st.get("train_s", 0.0)
        lw.acc = st["loss_acc"].clone()
        sampler.load(st["sampler"])
        mask_gen.set_state(st["mask_gen"])
        py_rng.setstate(_tuplify(st["py_rng"]))
        torch.set_rng_state(st["torch_rng"])
        np.random.set_state(st["np_rng"])
        print(f"resumed from {last_path} at step {step}", flush=True)

    from livespeech.models.tokenizer import get_tokenizer
    tok = get_tokenizer()

    def load_data():
        d = DecoderData(a.corpus, a.codes, cfg, "train", a.max_seconds, tokenizer=tok, eos_jitter=a.eos_jitter,
                        letters=a.letters, phone_vocab=phone_vocab, front_end=front_end)
        for k, (corpus, codes) in enumerate(a.extra_corpus):
            d.merge(DecoderData(corpus, codes, cfg, "train", a.max_seconds, tokenizer=tok, eos_jitter=a.eos_jitter,
                                letters=a.letters, id_prefix=f"x{k}-", phone_vocab=phone_vocab, front_end=front_end))
        d.index = {it["rec"]["id"]: i for i, it in enumerate(d.items)}
        return d

    data = load_data()
    dev = DecoderData(a.corpus, a.codes, cfg, "dev", a.max_seconds, tokenizer=tok, letters=a.letters,
                      phone_vocab=phone_vocab, front_end=front_end)
    if len(dev) == 0:
        dev = data
    devb = dev_batches(dev, model, a.dev_batches, 8)
    print(f"decoder tiny{overrides or ''}: {n_params / 1e6:.2f} M params; train {len(data)} utt "
          f"({data.skipped} skipped), dev {len(dev)}; device {device}", flush=True)
    if len(data) == 0:
        print("no training examples (encode the corpus first)", file=sys.stderr)
        return 1

    bf16 = a.autocast == "bf16" or (a.autocast == "auto" and device.type == "cpu" and cpu_has_bf16_dot())
    print(f"autocast: {'bfloat16' if bf16 else 'off'}; scan: {choose_scan(a.scan, model, device)}", flush=True)
    log = open(os.path.join(a.out, "log.jsonl"), "a")
    sched = Schedule(a.lr, a.warmup, a.steps, a.minutes)
    stop_at = a.stop_at
    t0 = time.time()
    t_ckpt = t0
    t_log = t0
    frames_acc = 0
    accum: dict[str, float] = {}
    n_acc = 0
    model.train()

    sampler_state, n_train = sampler.state(), len(data)  # as of the last batch taken

    def ckpt(path: str) -> None:
        extra = {"n_train": n_train, "train_s": train_s}
        if phone_head is not None:
            extra.update(phone_head=phone_head.state_dict(), phone_vocab=phone_head.names)
        save_checkpoint(path, model, opt, step, lw, sampler_state, mask_gen, py_rng, best, vars(a), extra)

    def emit(row: dict) -> None:
        """A row of the training log, also printed."""
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(json.dumps(row), flush=True)

    if a.init and step == 0:
        # the starting point's dev figures: a continued decoder must beat them (short runs at
        # the recipe's learning rate have ended above where they started), and best.pt is
        # only written by an evaluation that does
        ev = evaluate(model, devb, device, phone_head, a.read_heads)
        best = ev["dev_loss"]
        row = {"step": 0, "eval": True, "start": True, **ev}
        emit(row)
    t_resume = time.time() - train_s  # training time carried over from earlier runs
    # the batches made on a thread of their own (a re-read of the data while an encoder
    # fills the codes directory, which tokenises the whole manifest, there too)
    batches = BatchPrefetch(load_data, data, sampler, model, a.seed, step, a.rescan_every, pin=device.type == "cuda")
    try:
        while not sched.finished(step, train_s) and not (stop_at and step >= stop_at):
            batch, sampler_state, n_train = batches.next()
            # drawn whatever the phase, so a resumed run draws what a straight one does
            stream = py_rng.random() < a.stream_p and sched.progress(step, train_s) >= a.stream_after
            r1, r2 = py_rng.randint(1, 3), py_rng.randint(1, 3)
            # drawn on the CPU from the CPU generator: the same masks on every device
            mask = text_mask_for(batch, stream, mask_gen, r1, r2).to(device)
            if a.text_dropout > 0:  # seeded by the step, as the history noise
                mask = drop_text(mask, a.text_dropout, torch.Generator().manual_seed(a.seed * 1_000_037 + step))
            if a.history_noise > 0:  # seeded by the step: a resumed run corrupts what a straight one does
                noise_gen = torch.Generator().manual_seed(a.seed * 1_000_003 + step)
                batch.inputs = corrupt_history(batch.inputs, a.history_noise, model.none_ids(), model.cfg.codebook_size,
                                               noise_gen)
            batch = batch.to(device, non_blocking=device.type == "cuda")
            for g in opt.param_groups:
                g["lr"] = sched.lr(step, train_s)
            w = lw.weights()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                if a.own_history > 0:  # seeded by the step, as the history noise
                    own_gen = torch.Generator().manual_seed(a.seed * 1_000_033 + step)
                    batch.inputs = own_history(model, batch, mask, a.own_history, own_gen, a.own_passes,
                                               OwnSampling.named(a.own_sampling))
                total, losses, accs, reading = forward_loss(model, batch, mask, w,
                                                            a.read_heads if a.read_weight > 0 else 0)
                if reading is not None:
                    total = total + a.read_weight * reading[0]
                    accum["read_loss"] = accum.get("read_loss", 0.0) + reading[0].detach()
                    accum["read_mass"] = accum.get("read_mass", 0.0) + reading[1]
                if phone_head is not None:
                    phone_ce, phone_acc = phone_head.loss(batch.phones)
                    total = total + a.phone_weight * phone_ce
                    accum["ce_phone"] = accum.get("ce_phone", 0.0) + phone_ce.detach()
                    accum["acc_phone"] = accum.get("acc_phone", 0.0) + phone_acc
            opt.zero_grad(set_to_none=True)
            total.backward()
            gn = torch.nn.utils.clip_grad_norm_(
                [*model.parameters(), *(phone_head.parameters() if phone_head else ())], 1.0)
            opt.step()
            lw.update(accs)
            step += 1
            train_s = time.time() - t_resume
            frames_acc += int(batch.inputs.shape[0] * batch.inputs.shape[2])
            # summed where they are and read at the log's steps: a read of a GPU each step
            # would stop the host from queueing the next step while this one runs
            losses, accs = losses.detach(), accs.detach()
            for k, v in (("loss", total.detach()), ("ce_sum", losses.sum()), ("ce_graph", losses[0]),
                         ("ce_acoustic", losses[1:].mean()), ("acc_graph", accs[0]), ("acc_acoustic", accs[1:].mean()),
                         ("acc_cb1", accs[1]), ("grad_norm", gn), ("stream", float(stream))):
                accum[k] = accum.get(k, 0.0) + v
            n_acc += 1
            if step % a.log_every == 0 or step == 1:
                now = time.time()
                row = {"step": step, "time_s": round(now - t0, 1), "lr": round(opt.param_groups[0]["lr"], 7),
                       "s_per_step": round((now - t_log) / n_acc, 3),
                       "frames_per_s": round(frames_acc / (now - t_log), 1),
                       "epoch": sampler_state["epoch"], "n_train": n_train,
                       **{k: round(float(v) / n_acc, 5) for k, v in accum.items()}}
                emit(row)
                accum, n_acc, t_log, frames_acc = {}, 0, now, 0
            done = (sched.finished(step, train_s) or bool(stop_at and step >= stop_at)
                    or (a.max_minutes is not None and time.time() - t0 > a.max_minutes * 60))
            if step % a.eval_every == 0 or done:
                ev = evaluate(model, devb, device, phone_head, a.read_heads)
                is_best = ev["dev_loss"] < best
                if is_best:
                    best = ev["dev_loss"]
                row = {"step": step, "eval": True, "best": is_best,
                       "loss_weights": [round(float(x), 3) for x in lw.weights()],
                       **ev}
                emit(row)
                if is_best:
                    ckpt(os.path.join(a.out, "best.pt"))
            if done or time.time() - t_ckpt > a.ckpt_minutes * 60 or (a.ckpt_every and step % a.ckpt_every == 0):
                ckpt(last_path)
                t_ckpt = time.time()
            if done:
                break
    finally:
        batches.close()
    print(f"done at step {step}, best dev loss {best:.4f}, {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
