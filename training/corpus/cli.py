"""Command line: ``python -m livespeech.training.corpus {build,summary,sentences,voices} ...``.

``main(argv)`` is what ``livespeech corpus ...`` forwards to.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .build import ConfigMismatch, CorpusConfig, build, format_summary, seed_definition, summarize


def _csv(s: str | None) -> list[str] | None:
    if not s:
        return None
    return sorted({x.strip() for x in s.split(",") if x.strip()})


def _sources(s: str | None) -> list[str] | None:
    """None (all package sources) when not given; [] for --sources ''."""
    if s is None:
        return None
    return _csv(s) or []


def parse_weights(s: str | None) -> dict[str, float] | None:
    """'espeak=0.8,flite=0.2' -> {'espeak': 0.8, 'flite': 0.2}; None when not given."""
    if not s:
        return None
    out = {}
    for part in s.split(","):
        k, v = part.split("=")
        out[k.strip()] = float(v)
    return out


# the corpus-definition options: argparse dest -> (CorpusConfig field, parser of the value)
_DEFINITION = {
    "seed": ("seed", None), "dev_frac": ("dev_frac", None), "test_frac": ("test_frac", None),
    "heldout_frac": ("heldout_frac", None), "voices_per_combo": ("voices_per_combo", None),
    "accents": ("accents", _csv), "variants": ("variants", _csv), "sources": ("sources", _sources),
    "sentences": ("sentence_file", None), "weights": ("weights", parse_weights),
    "heldout_eval_share": ("heldout_eval_share", None), "max_seconds": ("max_seconds", None),
    "engines": ("engines", parse_weights),
}


def _config(a, saved: dict | None = None) -> CorpusConfig:
    """The options given on the command line; the others from ``saved`` (the definition of
    the corpus being resumed) when there is one, else the defaults: resuming needs no flags,
    and a flag that disagrees with the corpus is still refused (ConfigMismatch)."""
    fields = {}
    for dest, (field, parse) in _DEFINITION.items():
        if hasattr(a, dest):
            value = getattr(a, dest)
            fields[field] = parse(value) if parse else value
        elif saved is not None and field in saved:
            fields[field] = saved[field]
    return CorpusConfig(**fields)


def _saved_definition(out: str) -> dict | None:
    try:
        with open(os.path.join(out, "config.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m livespeech.training.corpus",
                                description="Synthetic LiveSpeech 2 training corpus (eSpeak NG, offline).")
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="synthesise (or resume) a corpus")
    b.add_argument("--out", default="data/corpus", help="corpus directory (default data/corpus)")
    b.add_argument("--hours", type=float, default=1.0, help="total audio to reach, all splits (default 1)")
    b.add_argument("--workers", type=int, default=1, help="synthesis processes (default 1)")
    b.add_argument("--max-utterances", type=int, default=None, help="stop at this many utterances")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--skip-train-before", type=int, default=0, metavar="INDEX",
                   help="leave out the training utterances below this index (u%%08d ids): fresh sentences for "
                        "a model continued from one trained on an earlier corpus; dev and test are unchanged")
    b.add_argument("--definition", metavar="DIR",
                   help="start from this saved definition (config.json, voices.json, sentences.jsonl[.gz]): "
                        "the same sentences, splits and voices on any machine; the repository's is "
                        "training/corpus/definition")
    g = b.add_argument_group("corpus definition (fixed when the directory is created; a resume "
                             "takes the corpus's own, and refuses values that disagree)",
                             argument_default=argparse.SUPPRESS)
    g.add_argument("--seed", type=int, help="(default 0)")
    g.add_argument("--dev-frac", type=float, help="share of sentences in dev (default 0.02)")
    g.add_argument("--test-frac", type=float, help="share of sentences in test (default 0.03)")
    g.add_argument("--heldout-frac", type=float,
                   help="share of voice variants held out of training (zero-shot dev/test voices; default 0.1)")
    g.add_argument("--heldout-eval-share", type=float,
                   help="share of dev/test utterances spoken by held-out voices (default 0.5)")
    g.add_argument("--voices-per-combo", type=int,
                   help="(rate, pitch, range) draws per accent x variant (default 2)")
    g.add_argument("--accents", help="comma list of eSpeak accents (default: all English)")
    g.add_argument("--variants", help="comma list of eSpeak variants (default: all but whisper)")
    g.add_argument("--sources",
                   help="comma list of package sentence sources (default all; '' for none)")
    g.add_argument("--sentences", help="extra sentence file: one a line, or source<TAB>text")
    g.add_argument("--weights", help="source weights, e.g. fortunes=0.4,wordnet=0.3")
    g.add_argument("--max-seconds", type=float, help="reject longer utterances (default 20 s)")
    g.add_argument("--engines",
                   help="synthesisers and their shares of utterances, e.g. espeak=0.8,flite=0.2 "
                        "(default: eSpeak NG only)")

    s = sub.add_parser("summary", help="print (and rewrite) summary.json of a corpus")
    s.add_argument("--out", default="data/corpus")
    s.add_argument("--json", action="store_true")

    t = sub.add_parser("sentences", help="extract the sentence pool and print statistics")
    t.add_argument("--sources", default=None)
    t.add_argument("--dump", default=None, help="write the pool to this file (source<TAB>text)")
    t.add_argument("--examples", type=int, default=5, help="examples per source")

    v = sub.add_parser("voices", help="list the voice catalog")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--voices-per-combo", type=int, default=2)
    v.add_argument("--heldout-frac", type=float, default=0.1)
    v.add_argument("--engines", default="espeak", help="comma list of synthesisers (espeak, flite, piper)")
    v.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.cmd == "build":
        try:
            if a.definition:
                seed_definition(a.out, a.definition)
            config = _config(a, _saved_definition(a.out))
        except (ValueError, ConfigMismatch) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        try:
            summary = build(a.out, a.hours, config, workers=a.workers,
                            max_utterances=a.max_utterances, progress=not a.no_progress,
                            skip_train_before=a.skip_train_before)
        except ConfigMismatch as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(format_summary(summary))
        return 130 if summary.get("interrupted") else 0
    if a.cmd == "summary":
        s = summarize(a.out)
        print(json.dumps(s, indent=1) if a.json else format_summary(s))
        return 0
    if a.cmd == "sentences":
        import random

        from .sentences import extract_pool, source_counts

        pool = extract_pool(_sources(a.sources))
        print(f"{len(pool)} sentences: {source_counts(pool)}")
        by: dict[str, list[str]] = {}
        for s_ in pool:
            by.setdefault(s_.source, []).append(s_.text)
        rng = random.Random(0)
        for src, texts in by.items():
            print(f"== {src}")
            for t_ in rng.sample(texts, min(a.examples, len(texts))):
                print(f"   {t_}")
        if a.dump:
            with open(a.dump, "w") as f:
                for s_ in pool:
                    f.write(f"{s_.source}\t{s_.text}\n")
        return 0
    if a.cmd == "voices":
        from .voices import CATALOGS as builders

        engines = _csv(a.engines) or []
        if set(engines) - set(builders):
            print(f"error: unknown synthesisers {sorted(set(engines) - set(builders))}", file=sys.stderr)
            return 2
        voices, rejected = [], {}
        for e in engines:
            more, why = builders[e](a.seed, a.voices_per_combo, a.heldout_frac)
            voices, rejected = voices + more, {**rejected, **why}
        if a.json:
            print(json.dumps({"voices": [v.to_json() for v in voices], "rejected": rejected}, indent=1))
        else:
            for v in voices:
                print(f"{v.id:40s} {v.accent:16s} {v.variant:14s} rate={v.rate} pitch={v.pitch} "
                      f"range={v.range}{'  HELD OUT' if v.heldout else ''}")
            print(f"{len(voices)} voices, {sum(v.heldout for v in voices)} held out, "
                  f"{len(rejected)} combinations rejected", file=sys.stderr)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
