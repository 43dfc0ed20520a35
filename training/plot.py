"""Plot the loss curves of a run: ``python -m livespeech.training.plot runs/decoder [--out curves.png]``.

Reads `<run>/log.jsonl` (decoder or codec run) and writes `<run>/curves.png`.
Needs matplotlib (the `train` extra)."""
from __future__ import annotations

import argparse
import json
import os
import sys


def read_log(run: str) -> tuple[list[dict], list[dict]]:
    steps, evals = [], []
    with open(os.path.join(run, "log.jsonl")) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            (evals if row.get("eval") else steps).append(row)
    # a resumed run appends: keep the last row written for each step
    dedup = lambda rows: list({r["step"]: r for r in rows}.values())  # noqa: E731
    return sorted(dedup(steps), key=lambda r: r["step"]), sorted(dedup(evals), key=lambda r: r["step"])


def plot(run: str, out: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, evals = read_log(run)
    out = out or os.path.join(run, "curves.png")
    decoder = bool(steps) and "ce_graph" in steps[0]
    if decoder:
        panels = [("loss (weighted sum of CE)", [("loss", "train")], [("dev_loss", "dev (sum of CE)")]),
                  ("cross-entropy", [("ce_graph", "train grapheme"), ("ce_acoustic", "train acoustic (mean)")],
                   [("dev_loss_graph", "dev grapheme"), ("dev_loss_acoustic", "dev acoustic (mean)")]),
                  ("accuracy", [("acc_graph", "train grapheme"), ("acc_acoustic", "train acoustic (mean)")],
                   [("dev_acc_graph", "dev grapheme"), ("dev_acc_acoustic", "dev acoustic (mean)")])]
    else:
        panels = [("total loss", [("total", "train")], []),
                  ("reconstruction", [("mel", "train mel"), ("stft", "train stft")],
                   [("dev_mel", "dev mel"), ("dev_stft", "dev stft")]),
                  ("dev SNR (dB)", [], [("dev_snr_db", "dev SNR")])]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8))
    for ax, (title, tr, ev) in zip(axes, panels):
        for key, label in tr:
            xs = [r["step"] for r in steps if key in r]
            ax.plot(xs, [r[key] for r in steps if key in r], label=label, lw=1)
        for key, label in ev:
            xs = [r["step"] for r in evals if key in r]
            ax.plot(xs, [r[key] for r in evals if key in r], "o-", label=label, ms=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(os.path.basename(os.path.abspath(run)))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m livespeech.training.plot")
    p.add_argument("run")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    print(plot(a.run, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
