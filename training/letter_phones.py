"""Train the letter schedule's front end (livespeech.models.front_end.FrontEnd).

The decoder's codebook 1 names the wrong phone on most frames once it reads back its own
samples, even with the true letters forced; sampled among the codes of the true phone,
the speech becomes intelligible (docs/eval.md, "How the letter schedule was found").
The front end gives the letters' timing and each frame's phone from the text alone:
`LetterPhoneModel` (cross-entropy on the corpus's phone timelines) and
`LetterDurationModel` (MSE on log(1 + frames) of each letter), both on the letters laid
on the phones as the decoder's training lays them (`--letters phones`), and how often
each of the codec's codebook-1 codes sounds each phone, and in each phone context
(`PhoneTable`).

    python -m livespeech.training.letter_phones --corpus data/corpus \
        --codec models/weights/default/codec.pt --codes data/codes --out models/weights/default/front_end.pt

With `--add-contexts FRONT_END`, that front end is kept and only its table of codebook 1
per phone context (`phone_context`: the half of the phone's run and the phone on that
side) is fitted. With `--refit-phones FRONT_END`, that front end is kept (its phone
classes, durations and code tables) and only its phone classifier is fitted again, on
`--corpus`'s frames: a corpus synthesised for its phone timelines alone needs no audio
encoded, so it can be many times the codes' corpus (more words spelt, docs/eval.md).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

import numpy as np
import torch
from torch import nn

from livespeech.models.config import FRAME_RATE, SAMPLE_RATE
from livespeech.models.front_end import FrontEnd, LetterDurationModel, LetterPhoneModel, contexts
from livespeech.training.dataset import phone_letter_positions
from livespeech.training.phones import IGNORE, PhoneTable, PhoneVocab

HOP = SAMPLE_RATE // FRAME_RATE


def pace_of(positions: Sequence[int]) -> float:
    """log frames per position of a laid-out row (the leading silence is in its first
    letter's frames, as the durations learn it)."""
    pos = [p for p in positions if p >= 0]
    return float(np.log(max(1, len(pos)) / max(1, len(set(pos)))))


def letter_durations(recs: Sequence[dict], engines: Sequence[str]):
    """Every letter (and word gap) of the records: (letter windows, engines, the record's
    pace, log(1 + its frames))."""
    ctxs, engs, paces, target = [], [], [], []
    for r in recs:
        letters, pos = phone_letter_positions(r)
        counts = np.bincount(np.asarray([p for p in pos if p >= 0], np.int64), minlength=len(letters))[:len(letters)]
        ctx, _ = contexts(letters, list(range(len(letters))))
        ctxs.append(ctx), target.append(np.log1p(counts.astype(np.float32)))
        engs.append(np.full(len(letters), engines.index(r.get("engine", "espeak")), np.int64))
        paces.append(np.full(len(letters), pace_of(pos), np.float32))
    cat = lambda xs: torch.from_numpy(np.concatenate(xs))  # noqa: E731
    return cat(ctxs), cat(engs), cat(paces), cat(target)


def phone_frames(recs: Sequence[dict], vocab: PhoneVocab, engines: Sequence[str]):
    """Every frame of the records with a letter and a phone label: (letter windows, frames
    into the letter, engines, phone classes)."""
    ctxs, offs, engs, labels = [], [], [], []
    for r in recs:
        letters, pos = phone_letter_positions(r)
        ctx, off = contexts(letters, pos)
        lab = vocab.frame_labels(r, 0, len(pos), HOP, SAMPLE_RATE)
        keep = (np.asarray(pos) >= 0) & (lab != IGNORE)
        ctxs.append(ctx[keep]), offs.append(off[keep]), labels.append(lab[keep])
        engs.append(np.full(int(keep.sum()), engines.index(r.get("engine", "espeak")), np.int64))
    cat = lambda xs: torch.from_numpy(np.concatenate(xs))  # noqa: E731
    return cat(ctxs), cat(offs), cat(engs), cat(labels)


def fit(model: nn.Module, data: tuple, loss_fn, epochs: int, batch: int, lr: float, score) -> None:
    """AdamW with a one-cycle schedule over shuffled batches of `data` (inputs..., target);
    after each epoch prints `score()` (evaluated without gradients)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    n = len(data[0])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=epochs * max(1, n // batch))
    t0 = time.time()
    for epoch in range(epochs):
        perm = torch.randperm(n)
        model.train()
        for i in range(max(1, n // batch)):
            b = perm[i * batch:(i + 1) * batch]
            loss = loss_fn(model(*(x[b] for x in data[:-1])), data[-1][b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        model.eval()
        with torch.no_grad():
            print(f"{type(model).__name__} epoch {epoch + 1}: loss {loss.item():.3f}, {score()} "
                  f"({time.time() - t0:.0f} s)", flush=True)


def add_contexts(a: argparse.Namespace, rows: Sequence[dict]) -> int:
    """--add-contexts: the front end as it is, with the context table of the codes' phones."""
    from livespeech.models.loading import load_codec

    fe = FrontEnd.load(a.add_contexts)
    codec = load_codec(a.codec, 1)
    table = PhoneTable.fit(codec, a.corpus, rows, min_count=a.phone_min_count,
                           **({"n": 0, "codes_dir": a.codes} if a.codes else {}))
    if table.vocab.names != fe.phone_names:
        print("the corpus's phones are not the front end's", file=sys.stderr)
        return 1
    fe.contexts = table.contexts(codec.config.codebook_size, a.context_strength)
    torch.save(FrontEnd.from_dict(fe.to_dict()).to_dict(), a.out)
    print(f"wrote {a.out}: {len(fe.contexts['keys'])} phone contexts, {len(fe.contexts['values'])} codes refined")
    return 0


def fit_phones(rows: Sequence[dict], vocab: PhoneVocab, engines: Sequence[str], epochs: int, batch: int,
               lr: float) -> LetterPhoneModel:
    """The phone classifier on the train records' frames, scored each epoch on the others'."""
    train = phone_frames([r for r in rows if r["split"] == "train"], vocab, engines)
    test = phone_frames([r for r in rows if r["split"] != "train"], vocab, engines)
    print(f"{len(train[0])} train frames, {len(test[0])} other frames, {len(vocab)} phones, engines {engines}",
          flush=True)
    model = LetterPhoneModel(len(vocab), len(engines))
    fit(model, train, lambda out, y: nn.functional.cross_entropy(out, y), epochs, batch, lr,
        lambda: f"accuracy on other splits {(model(*test[:3]).argmax(1) == test[3]).float().mean().item():.3f}")
    return model.eval()


def refit_phones(a: argparse.Namespace, rows: Sequence[dict]) -> int:
    """--refit-phones: the front end as it is, with its phone classifier fitted on --corpus."""
    fe = FrontEnd.load(a.refit_phones)
    fe.phones = fit_phones(rows, PhoneVocab(tuple(fe.phone_names)), fe.engines, a.epochs, a.batch, a.lr)
    torch.save(FrontEnd.from_dict(fe.to_dict()).to_dict(), a.out)
    print(f"wrote {a.out}: the phone classifier of {a.refit_phones} fitted on {a.corpus}")
    return 0


def main(argv=None) -> int:
    from livespeech.training.dataset import read_manifest

    p = argparse.ArgumentParser(prog="python -m livespeech.training.letter_phones", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="data/corpus")
    p.add_argument("--codec", default="models/weights/default/codec.pt",
                   help="the codec whose codebook-1 codes the phones are read from (the decoder's)")
    p.add_argument("--codes", default=None,
                   help="the corpus encoded with --codec (livespeech.training.encode_corpus's output): the code-phone "
                        "table counts all its train utterances instead of encoding 300")
    p.add_argument("--out", required=True, help="front_end.pt (livespeech.models.front_end.FrontEnd)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--phone-min-count", type=int, default=20,
                   help="as livespeech.training.phones.PhoneTable.fit's (the phone classes must match)")
    p.add_argument("--context-strength", type=float, default=80.0,
                   help="codebook 1's bias per phone context (FrontEnd.contexts): frames' worth of the phone's own "
                        "code distribution a context's counts are smoothed with; 0: phones alone")
    p.add_argument("--add-contexts", metavar="FRONT_END", default=None,
                   help="keep this front end (networks and phone table) and only fit its context table (--codes)")
    p.add_argument("--refit-phones", metavar="FRONT_END", default=None,
                   help="keep this front end (phone classes, durations, code tables) and only fit its phone "
                        "classifier, on --corpus (no codec or codes needed)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    rows = [r for r in read_manifest(a.corpus) if r.get("phones")]
    if a.add_contexts:
        return add_contexts(a, rows)
    if a.refit_phones:
        return refit_phones(a, rows)
    vocab = PhoneVocab.from_records(rows, a.phone_min_count)
    engines = sorted({r.get("engine", "espeak") for r in rows})
    model = fit_phones(rows, vocab, engines, a.epochs, a.batch, a.lr)
    dur = LetterDurationModel(len(engines))
    dtrain = letter_durations([r for r in rows if r["split"] == "train"], engines)
    dtest = letter_durations([r for r in rows if r["split"] != "train"], engines)
    fit(dur, dtrain, nn.functional.mse_loss, 2 * a.epochs, max(64, a.batch // 8), a.lr,
        lambda: f"mean abs error on other splits {(dur(*dtest[:3]).exp() - dtest[3].exp()).abs().mean().item():.2f} frames")
    from livespeech.models.loading import load_codec

    codec = load_codec(a.codec, 1)
    table = PhoneTable.fit(codec, a.corpus, rows, min_count=a.phone_min_count,
                           **({"n": 0, "codes_dir": a.codes} if a.codes else {}))
    if table.vocab.names != vocab.names:
        print("the codec's phone table has other phones than the classifier", file=sys.stderr)
        return 1
    pace = float(np.median([pace_of(phone_letter_positions(r)[1]) for r in rows if r["split"] == "train"]))
    with torch.no_grad():  # exp of a log-space regression is short of the mean: rescale to the train total
        scale = float((dtrain[3].exp() - 1).sum() / (dur(*dtrain[:3]).exp() - 1).clamp_min(0).sum())
    size = codec.config.codebook_size
    fe = FrontEnd(model, dur, table.code_phones(size), vocab.names, engines, pace, scale, table.phone_given_code(size),
                  table.contexts(size, a.context_strength) if a.context_strength > 0 else None)
    torch.save(fe.to_dict(), a.out)
    print(f"wrote {a.out}: pace {pace:.3f} (log frames a letter), durations scaled by {scale:.3f}, "
          f"{int((fe.code_phones >= 0).sum())} codes name a phone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
