"""How much a decoder reads its text, teacher-forced on dev utterances.

    python -m livespeech.training.eval.reading --model models/weights/default/decoder.pt \\
        --corpus data/corpus --codes data/corpus_codes_v2 [--batches 8]

The model is any exported decoder.pt or a training run's checkpoint. Prints, with each
utterance's own text and with another utterance's (the batch's texts rotated):
- the grapheme stream's cross-entropy;
- at letter changes, how often the most likely letter other than the current one is
  the next letter (when a letter ends is not asked, only which comes next);
and the attention mass each layer's heads put on the word being spoken
(`train.reading_loss`'s targets), as a layer x head table.
A decoder that reads does much better with its own text; one that guesses letters from
the letters before does about as well with another's.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from livespeech.training import train
from livespeech.training.dataset import Batch, DecoderData


@torch.no_grad()
def reading_stats(model, batches: list[Batch]) -> dict:
    """{"true"/"other": (grapheme CE, next-letter accuracy at changes)} and "mass": [layers, heads]."""
    model.eval()
    out: dict = {}
    heads = model.cfg.n_heads
    mass = torch.zeros(model.n_layers, heads)
    for name in ("true", "other"):
        ce = n = hits = changes = 0
        for b in batches:
            weights: list = []
            logits = train.grapheme_logits(model, b, b if name == "true" else train._rotate_texts(b), weights)
            target, valid = b.targets[:, 0], b.valid[:, 0]
            ce += float(F.cross_entropy(logits[valid].float(), target[valid], reduction="sum"))
            n += int(valid.sum())
            right, total = train.letter_change_hits(logits, b, bar_current=True)
            hits, changes = hits + right, changes + total
            if name == "true":
                m = train.spoken_word_mass(weights, b.reading, b.text_valid, heads)
                if m is not None:
                    mass += m.mean(0)
        out[name] = (ce / max(n, 1), hits / max(changes, 1))
    out["mass"] = mass / max(len(batches), 1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m livespeech.training.eval.reading", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="decoder.pt (exported) or a run's last.pt / best.pt")
    p.add_argument("--corpus", default="data/corpus")
    p.add_argument("--codes", required=True, help="the corpus's codes from the decoder's codec")
    p.add_argument("--split", default="dev")
    p.add_argument("--batches", type=int, default=8, help="batches of 8 utterances (train.dev_batches' choice)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = train.load_trained_decoder(a.model)
    data = DecoderData(a.corpus, a.codes, model.cfg, a.split, letters="phones")
    if len(data) < 2:
        print(f"fewer than 2 {a.split} utterances with codes in {a.corpus}", file=sys.stderr)
        return 2
    s = reading_stats(model, train.dev_batches(data, model, a.batches, 8))
    print(f"{a.model}: {a.split} utterances of {a.corpus}, teacher forcing")
    print("| text | grapheme CE | next letter at changes % |\n|---|---:|---:|")
    for name, label in (("true", "its own"), ("other", "another utterance's")):
        print(f"| {label} | {s[name][0]:.3f} | {100 * s[name][1]:.1f} |")
    print("\nattention mass on the word being spoken (rows: layers, columns: heads)")
    for layer, row in enumerate(s["mass"].tolist()):
        print(f"layer {layer}: " + " ".join(f"{x:.2f}" for x in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
