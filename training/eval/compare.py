"""Two evaluations of the same clips, compared clip by clip.

    python -m livespeech.training.eval.compare runs/a.json runs/b.json --mode online --lambda 1
    python -m livespeech.training.eval.compare runs/a.json runs/b.json --mode online --lambda 1 --lambda-b 0
    python -m livespeech.training.eval.compare a-seed0.json,a-seed1.json b-seed0.json,b-seed1.json --mode online --lambda 1
    python -m livespeech.training.eval.compare run.json run.json --system "ground truth" --system-b "codec resynthesis" --voices flite-

Reads the per-utterance JSON of two `python -m livespeech.training.eval` runs, pairs the
rows of one system (the model in a mode at a guidance lambda, or `--system "ground
truth"`) by utterance (B's rows in another mode or at another lambda with `--mode-b`,
`--lambda-b`, or another system with `--system-b`: the codec's resynthesis against the
ground truth), and prints WER and CER of each, B minus A and B over A, with 95 % paired
bootstrap intervals over the clips (the corpus rate: errors over reference words or
characters, resampled by clip) and how many clips got better or worse. A difference
whose interval holds 0 is not shown to be one. `--voices PREFIX` keeps the clips of the
voices whose names start with it (`espeak-`, `flite-`: one synthesiser's voices).
`--against-said` scores each row's transcript against the words said for its text
(models/spoken_form.py: "example dot com" for "example.com") rather than against the
text as written, where Whisper's normaliser drops what a written address or symbol
says ("example.com" becomes "example com", "~5%" "5%").

Several runs a side (comma-separated, e.g. one a sampling seed): A's i-th run is paired
with B's i-th, and a clip's errors and reference lengths are summed over the pairs, so
the bootstrap still resamples clips (a clip's runs are not independent draws).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Optional

import numpy as np


def rows(path: Path, system: str, mode: Optional[str], lam: Optional[float], voices: str = "",
         against_said: bool = False) -> dict[str, dict]:
    """utterance id -> its row of `system` (for the model: in `mode` at `lam`), of the
    voices whose names start with `voices`; `against_said`: its errors counted against
    the words said for its text."""
    from livespeech.training.eval.text import get_normalizer

    out = {}
    normalize = get_normalizer() if against_said else None
    for u in json.loads(path.read_text())["utterances"]:
        if u["system"] != system or not u.get("voice", "").startswith(voices):
            continue
        if mode is not None and u.get("mode") != mode:
            continue
        if lam is not None and (u.get("lambda") is None or not math.isclose(u["lambda"], lam)):
            continue
        out[u["utt"]] = said_counts(u, normalize) if normalize else u
    return out


def said_counts(row: dict, normalize) -> dict:
    """The row with its word and character errors counted against the words said for
    its text (`spoken_words` of each written word)."""
    from livespeech.models.spoken_form import spoken_words
    from livespeech.training.eval.text import error_counts

    said = " ".join(w for word in row["text"].split() for w in spoken_words(word))
    c = error_counts(said, row["hyp"], normalize)
    return {**row, "word_errors": c.word_errors, "ref_words": c.ref_words, "char_errors": c.char_errors,
            "ref_chars": c.ref_chars}


def pooled(runs_a: list[dict[str, dict]], runs_b: list[dict[str, dict]]) -> tuple[dict[str, dict], dict[str, dict]]:
    """Pairs of runs (A's i-th with B's i-th) pooled by clip: a clip's counts summed over
    the pairs that both hold it, a clip held by no pair left out."""
    if len(runs_a) != len(runs_b):
        raise ValueError(f"{len(runs_a)} runs against {len(runs_b)}: pair them one to one")
    keys = ("word_errors", "ref_words", "char_errors", "ref_chars")
    out_a: dict[str, dict] = {}
    out_b: dict[str, dict] = {}
    for ra, rb in zip(runs_a, runs_b):
        for utt in set(ra) & set(rb):
            for src, dst in ((ra, out_a), (rb, out_b)):
                acc = dst.setdefault(utt, dict.fromkeys(keys, 0.0))
                for k in keys:
                    acc[k] += float(src[utt][k])
    return out_a, out_b


def paired(a: dict[str, dict], b: dict[str, dict], errors: str, ref: str, n_boot: int = 10_000,
           seed: int = 0) -> dict:
    """Corpus rates of A and B on their common clips, B - A and B / A with 95 % bootstrap intervals."""
    ids = sorted(set(a) & set(b))
    if not ids:
        raise ValueError("no utterance in common")
    ea, eb = (np.array([float(x[i][errors]) for i in ids]) for x in (a, b))
    n = np.array([float(a[i][ref]) for i in ids])
    rate_a, rate_b = ea.sum() / n.sum(), eb.sum() / n.sum()
    pick = np.random.default_rng(seed).integers(0, len(ids), (n_boot, len(ids)))
    sa, sb = ea[pick].sum(1), eb[pick].sum(1)
    lo, hi = np.percentile((sb - sa) / n[pick].sum(1), [2.5, 97.5])
    ratio = eb.sum() / ea.sum() if ea.sum() else math.inf
    r_lo, r_hi = np.percentile(sb / np.maximum(sa, 1e-9), [2.5, 97.5]) if ea.sum() else (math.inf, math.inf)
    per_a, per_b = ea / np.maximum(n, 1), eb / np.maximum(n, 1)
    return {"n": len(ids), "a": rate_a, "b": rate_b, "diff": rate_b - rate_a, "ci": (float(lo), float(hi)),
            "ratio": float(ratio), "ratio_ci": (float(r_lo), float(r_hi)),
            "better": int((per_b < per_a).sum()), "worse": int((per_b > per_a).sum())}


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m livespeech.training.eval.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="A's run (JSON), or its runs comma-separated")
    p.add_argument("b", help="B's run, or its runs (as many as A's, paired in order)")
    p.add_argument("--system", default="model", help='the rows to compare (default: model; or "ground truth", ...)')
    p.add_argument("--system-b", default=None, help="B's rows where they differ from --system (e.g. \"codec resynthesis\")")
    p.add_argument("--voices", default="", metavar="PREFIX", help="only the voices whose names start with this")
    p.add_argument("--mode", default=None, help="the model's mode (online, offline, 1word)")
    p.add_argument("--lambda", dest="lam", type=float, default=None, help="the guidance lambda")
    p.add_argument("--mode-b", default=None, help="B's mode where it differs from --mode")
    p.add_argument("--lambda-b", dest="lam_b", type=float, default=None, help="B's lambda where it differs from --lambda")
    p.add_argument("--against-said", action="store_true",
                   help="errors against the words said for each text (models/spoken_form.py), not the text as written")
    a = p.parse_args(argv)
    system_b = a.system_b or a.system
    mode, lam = (a.mode, a.lam) if a.system == "model" else (None, None)
    mode_b = (a.mode_b or a.mode) if system_b == "model" else None
    lam_b = (a.lam if a.lam_b is None else a.lam_b) if system_b == "model" else None
    files_a, files_b = a.a.split(","), a.b.split(",")
    try:
        ra, rb = pooled([rows(Path(f), a.system, mode, lam, a.voices, a.against_said) for f in files_a],
                        [rows(Path(f), system_b, mode_b, lam_b, a.voices, a.against_said) for f in files_b])
    except (ValueError, OSError) as e:  # runs unpaired (`pooled` says so), or a run not there
        p.error(str(e))
    runs = f" x {len(files_a)} runs a side" if len(files_a) > 1 else ""

    def setting(m, x):
        return f"{f' {m}' if m else ''}{f' lambda {x:g}' if x is not None else ''}"
    voices = (f" (voices {a.voices}*)" if a.voices else "") + (" (against the words said)" if a.against_said else "")
    if (a.system, mode, lam) == (system_b, mode_b, lam_b):
        print(f"{a.system}{setting(mode, lam)}{voices}: A = {a.a}, B = {a.b}")
    else:
        print(f"A = {a.system}{setting(mode, lam)} of {a.a}, B = {system_b}{setting(mode_b, lam_b)} of {a.b}{voices}")
    for name, errors, ref in (("WER", "word_errors", "ref_words"), ("CER", "char_errors", "ref_chars")):
        r = paired(ra, rb, errors, ref)
        lo, hi = r["ci"]
        print(f"{name} % on {r['n']} clips{runs}: A {100 * r['a']:.1f}, B {100 * r['b']:.1f}, B - A {100 * r['diff']:+.1f} "
              f"(95 % CI {100 * lo:+.1f} to {100 * hi:+.1f}), B / A {r['ratio']:.2f}x ({r['ratio_ci'][0]:.2f} to "
              f"{r['ratio_ci'][1]:.2f}); B better on {r['better']} clips, worse on {r['worse']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
