"""Building (and resuming) a corpus directory.

Layout of ``--out``::

    config.json       the options that define the corpus (checked on resume)
    sentences.jsonl   the sentence pool used (index, source, split, text)
    voices.json       the voice catalog (synthesiser parameters, held out or not)
    manifest.jsonl    one record per finished utterance (appended as they finish)
    rejects.jsonl     planned utterances that could not be made (not retried)
    wav/NNNNN/*.wav   24 kHz mono 16-bit audio
    summary.json      totals (rewritten at the end of every build / by ``summary``)

Resuming: the plan is a deterministic sequence, so a re-run regenerates it, skips the ids
already in manifest.jsonl / rejects.jsonl and continues. The manifest is only appended to
by the parent process, one flushed line per finished utterance, after its WAV was renamed
into place; a torn last line (killed mid-write) is cut off on resume. A killed run
therefore loses only the utterances being synthesised at that moment.
"""
from __future__ import annotations

import concurrent.futures as cf
from concurrent.futures.process import BrokenProcessPool
import gzip
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from .plan import SPLITS, Job, plan, sentence_split, source_weights
from .sentences import Sentence, extract_pool, pool_fingerprint, source_counts
from .voices import CATALOGS, Voice, build_catalog

FORMAT_VERSION = 1
ENGINES = tuple(CATALOGS)


@dataclass
class CorpusConfig:
    seed: int = 0
    dev_frac: float = 0.02
    test_frac: float = 0.03
    heldout_frac: float = 0.1
    voices_per_combo: int = 2
    accents: list[str] | None = None
    variants: list[str] | None = None
    sources: list[str] | None = None  # None: all package sources
    sentence_file: str | None = None
    weights: dict[str, float] | None = None
    heldout_eval_share: float = 0.5
    max_seconds: float = 20.0
    # synthesiser -> share of utterances, e.g. {"espeak": 0.8, "flite": 0.2}; None: eSpeak only
    engines: dict[str, float] | None = None
    version: int = FORMAT_VERSION

    # the fields that define the plan: a resume must agree on these (a corpus made before
    # `engines` existed has none saved, which reads as None: eSpeak only)
    KEYS = ("seed", "dev_frac", "test_frac", "heldout_frac", "voices_per_combo", "accents",
            "variants", "sources", "sentence_file", "weights", "heldout_eval_share",
            "max_seconds", "engines", "version")

    def __post_init__(self):
        unknown = sorted(set(self.engines or {}) - set(ENGINES))
        if unknown:
            raise ValueError(f"unknown synthesisers {unknown}; choose from {list(ENGINES)}")
        if self.engines is not None and not any(w > 0 for w in self.engines.values()):
            raise ValueError("engines: no synthesiser with a positive share")

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.KEYS}


class ConfigMismatch(RuntimeError):
    pass


def _log(msg: str) -> None:
    """Status lines go to stderr, flushed (stdout of a background build is a file)."""
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- files
def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _write_jsonl(path: str, rows) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    os.replace(tmp, path)


def read_jsonl(path: str, repair: bool = False) -> list[dict]:
    """Records of a JSONL file; with ``repair`` a torn last line is cut off the file."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        data = f.read()
    rows = []
    good_end = 0
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break  # no newline: torn write
        line = data[pos:nl]
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
        pos = nl + 1
        good_end = pos
    if repair and good_end < len(data):
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return rows


@dataclass
class Corpus:
    out: str
    config: CorpusConfig
    pool: list[Sentence]
    splits: list[str]
    voices: list[Voice]
    rejected_combos: dict[str, str] = field(default_factory=dict)

    @property
    def voice_map(self) -> dict[str, Voice]:
        return {v.id: v for v in self.voices}

    def jobs(self):
        return plan(self.pool, self.splits, self.voices, self.config.seed, self.config.weights,
                    self.config.heldout_eval_share, self.config.engines)


def seed_definition(out: str, definition: str) -> None:
    """Start ``out`` from a saved corpus definition (``definition`` holds config.json,
    voices.json and sentences.jsonl or sentences.jsonl.gz), so that the same sentences,
    splits and voices are built on any machine: a pool extracted from Debian's packages
    changes with their versions. A corpus already started must have been started from
    this definition."""
    with open(os.path.join(definition, "config.json")) as f:
        cfg = json.load(f)
    cfg_path = os.path.join(out, "config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            have = json.load(f).get("pool_fingerprint")
        if have != cfg.get("pool_fingerprint"):
            raise ConfigMismatch(f"{out} was started from another sentence pool ({have}) than "
                                 f"{definition} ({cfg.get('pool_fingerprint')}); use a new --out")
        return
    os.makedirs(out, exist_ok=True)
    plain = os.path.join(definition, "sentences.jsonl")
    gzipped = not os.path.exists(plain)
    with (gzip.open if gzipped else open)(plain + ".gz" if gzipped else plain, "rt") as f, \
            open(os.path.join(out, "sentences.jsonl"), "w") as g:
        shutil.copyfileobj(f, g)
    shutil.copyfile(os.path.join(definition, "voices.json"), os.path.join(out, "voices.json"))
    _write_json(cfg_path, cfg)  # written last: its presence means the definition is complete


def prepare(out: str, config: CorpusConfig, log=_log) -> Corpus:
    """Create the corpus definition in ``out`` (pool, splits, voices), or load it and check
    that ``config`` agrees with what the directory was started with."""
    os.makedirs(out, exist_ok=True)
    cfg_path = os.path.join(out, "config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            saved = json.load(f)
        want = config.to_json()
        diff = {k: (saved.get(k), want[k]) for k in CorpusConfig.KEYS if saved.get(k) != want[k]}
        if diff:
            lines = ", ".join(f"{k}: corpus has {a!r}, asked for {b!r}" for k, (a, b) in diff.items())
            raise ConfigMismatch(f"{out} was started with other options ({lines}); "
                                 "use the same options to resume, or a new --out")
        rows = read_jsonl(os.path.join(out, "sentences.jsonl"))
        pool = [Sentence(r["text"], r["source"]) for r in rows]
        splits = [r["split"] for r in rows]
        with open(os.path.join(out, "voices.json")) as f:
            vj = json.load(f)
        voices = [Voice.from_json(v) for v in vj["voices"]]
        if saved.get("pool_fingerprint") != pool_fingerprint(pool):
            raise ConfigMismatch(f"{out}/sentences.jsonl does not match config.json")
        return Corpus(out, config, pool, splits, voices, vj.get("rejected_combos", {}))
    t0 = time.time()
    pool = extract_pool(config.sources, config.sentence_file)
    if not pool:
        raise RuntimeError("empty sentence pool: install the sentence packages (see docs/corpus.md) "
                           "or pass --sentences FILE")
    log(f"sentence pool: {len(pool)} sentences in {time.time() - t0:.1f} s: {source_counts(pool)}")
    splits = [sentence_split(s.text, config.seed, config.dev_frac, config.test_frac) for s in pool]
    t0 = time.time()
    engines = {e for e, w in (config.engines or {"espeak": 1.0}).items() if w > 0}
    voices, rejected = [], {}
    if "espeak" in engines:
        voices, rejected = build_catalog(config.seed, config.voices_per_combo, config.heldout_frac,
                                         config.accents, config.variants)
    for e in sorted(engines - {"espeak"}):
        more, why = CATALOGS[e](config.seed, config.voices_per_combo, config.heldout_frac)
        voices, rejected = voices + more, {**rejected, **why}
    if not voices:
        raise RuntimeError("no usable voice")
    ids = [v.id for v in voices]
    if len(set(ids)) != len(ids):
        raise RuntimeError("duplicate voice ids")
    log(f"voices: {len(voices)} ({sum(v.heldout for v in voices)} held out), "
        f"{len(rejected)} accent/variant combinations rejected, {time.time() - t0:.1f} s")
    _write_jsonl(os.path.join(out, "sentences.jsonl"),
                 ({"index": i, "source": s.source, "split": sp, "text": s.text}
                  for i, (s, sp) in enumerate(zip(pool, splits))))
    from . import espeak, flite, piper

    synthesisers = {}
    if "espeak" in engines:
        synthesisers["espeak"] = {"library": espeak.find_library(), "native_sample_rate": espeak.NATIVE_RATE}
    if "flite" in engines:
        synthesisers["flite"] = {"binary": flite.binary()}
    if "piper" in engines:
        synthesisers["piper"] = {"voice": "en_US-joe-medium", "native_sample_rate": piper.voice().config.sample_rate}
    _write_json(os.path.join(out, "voices.json"), {
        "engines": synthesisers,
        "heldout_variants": sorted({v.timbre for v in voices if v.heldout}),
        "voices": [v.to_json() for v in voices],
        "rejected_combos": rejected,
    })
    saved = config.to_json()
    saved["pool_fingerprint"] = pool_fingerprint(pool)
    saved["n_sentences"] = len(pool)
    saved["source_weights"] = source_weights(pool, config.weights)
    _write_json(cfg_path, saved)  # written last: its presence means the definition is complete
    return Corpus(out, config, pool, splits, voices, rejected)


# ----------------------------------------------------------------------------- workers
_W: dict = {}


def _watch_parent(parent: int) -> None:
    """Exit when the parent dies (killed build): orphaned workers would otherwise keep
    each other alive through the shared task queue."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def _init_worker(out: str, voices: list[dict], max_seconds: float, watch: bool = False) -> None:
    if watch:  # a pool worker: Ctrl-C is the parent's business
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    _W["out"] = out
    _W["voices"] = {v["id"]: Voice.from_json(v) for v in voices}
    _W["max_seconds"] = max_seconds


def _work(job: dict) -> tuple[str, dict]:
    from .synth import Rejected, synthesize

    j = Job(**job)
    try:
        rec = synthesize(j, _W["voices"][j.voice], _W["out"], max_seconds=_W["max_seconds"])
        return "ok", rec
    except Rejected as e:
        return "reject", {"id": j.id, "reason": str(e), "text": j.text, "voice": j.voice}


# ----------------------------------------------------------------------------- progress
class Progress:
    """tqdm when installed, else one line on stderr (rewritten in place on a terminal,
    every 30 s otherwise)."""

    def __init__(self, total_s: float, done_s: float, n_done: int, enabled: bool = True):
        self.total_h = total_s / 3600
        self.start_done_s = done_s
        self.t0 = time.time()
        self.n = n_done
        self.n0 = n_done
        self.done_s = done_s
        self.enabled = enabled
        self.started = False
        self.last = 0.0
        self.bar = None
        self.tty = sys.stderr.isatty()
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=round(self.total_h, 3), initial=round(done_s / 3600, 3), unit="h",
                            desc="corpus", dynamic_ncols=True, mininterval=1.0 if self.tty else 30.0,
                            bar_format="{l_bar}{bar}| {n:.3f}/{total:.3f} h [{elapsed}<{remaining}{postfix}]")
        except ImportError:
            self.bar = None

    def rate(self) -> tuple[float, float]:
        dt = max(1e-6, time.time() - self.t0)
        return (self.done_s - self.start_done_s) / dt, (self.n - self.n0) / dt

    def update(self, seconds: float, rejects: int = 0) -> None:
        self.n += 1
        self.done_s += seconds
        if not self.started:  # rates from the first result on (not counting start-up)
            self.started = True
            self.t0, self.start_done_s, self.n0 = time.time(), self.done_s, self.n
        if not self.enabled:
            return
        xrt, ups = self.rate()
        if self.bar is not None:
            self.bar.n = round(self.done_s / 3600, 3)
            self.bar.set_postfix_str(f"{self.n} utt, {ups:.1f} utt/s, {xrt:.0f}x real time, {rejects} rejected",
                                     refresh=False)
            self.bar.update(0)
            return
        now = time.time()
        if now - self.last < (0.5 if self.tty else 30.0):
            return
        self.last = now
        self._line(rejects)

    def _line(self, rejects: int) -> None:
        xrt, ups = self.rate()
        done_h = self.done_s / 3600
        left = max(0.0, self.total_h * 3600 - self.done_s) / xrt if xrt > 0 else float("inf")
        eta = f"{left / 60:.1f} min" if left != float("inf") else "?"
        msg = (f"corpus: {done_h:.3f}/{self.total_h:.3f} h ({100 * done_h / max(self.total_h, 1e-9):.1f}%), "
               f"{self.n} utt, {ups:.1f} utt/s, {xrt:.0f}x real time, {rejects} rejected, eta {eta}")
        if self.tty:
            sys.stderr.write("\r" + msg + "\x1b[K")
        else:
            sys.stderr.write(msg + "\n")
        sys.stderr.flush()

    def close(self, rejects: int = 0) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        else:
            self._line(rejects)
            if self.tty:
                sys.stderr.write("\n")


# ----------------------------------------------------------------------------- build
def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _graceful_sigterm():
    """Make SIGTERM stop a build like Ctrl-C (main thread only); returns the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        return signal.signal(signal.SIGTERM, _raise_interrupt)
    except (ValueError, OSError):
        return None


def build(out: str, hours: float, config: CorpusConfig | None = None, workers: int = 1,
          max_utterances: int | None = None, progress: bool = True, log=_log,
          stop_after: int | None = None, skip_train_before: int = 0) -> dict:
    """Synthesise until ``hours`` of audio (or ``max_utterances``) are in ``out``; resumes.

    ``skip_train_before``: leave out the plan's training utterances below this index, so
    that a model continued on a new corpus meets sentences it has not seen; dev and test
    stay the plan's own, comparable across corpora.
    ``stop_after``: stop (as if killed) after that many new utterances in this call; for tests.
    Returns the summary."""
    config = config or CorpusConfig()
    corpus = prepare(out, config, log=log)
    manifest_path = os.path.join(out, "manifest.jsonl")
    rejects_path = os.path.join(out, "rejects.jsonl")
    done = read_jsonl(manifest_path, repair=True)
    rejected = read_jsonl(rejects_path, repair=True)
    done_ids = {r["id"] for r in done} | {r["id"] for r in rejected}
    done_s = sum(r["duration_s"] for r in done)
    n_done = len(done)
    n_rej = len(rejected)
    target_s = hours * 3600
    avg_s = done_s / n_done if n_done else 4.0
    if done:
        log(f"resuming: {n_done} utterances ({done_s / 3600:.3f} h) already in {out}")
    voices_json = [v.to_json() for v in corpus.voices]
    jobs = (j for j in corpus.jobs()
            if j.id not in done_ids and not (j.split == "train" and j.index < skip_train_before))
    bar = Progress(target_s, done_s, n_done, enabled=progress)
    new = 0

    def want_more(in_flight: int) -> bool:
        if max_utterances is not None and n_done + in_flight >= max_utterances:
            return False
        if stop_after is not None and new + in_flight >= stop_after:
            return False
        return done_s + in_flight * avg_s < target_s

    mf = open(manifest_path, "a")
    rf = open(rejects_path, "a")

    def record(kind: str, rec: dict) -> None:
        nonlocal done_s, n_done, n_rej, avg_s, new
        if kind == "ok":
            mf.write(json.dumps(rec, separators=(",", ":")) + "\n")
            mf.flush()
            done_s += rec["duration_s"]
            n_done += 1
            new += 1
            avg_s = done_s / n_done
            bar.update(rec["duration_s"], n_rej)
        else:
            rf.write(json.dumps(rec, separators=(",", ":")) + "\n")
            rf.flush()
            n_rej += 1

    interrupted = False
    old_term = _graceful_sigterm()
    try:
        if workers <= 1:
            _init_worker(out, voices_json, config.max_seconds)
            while want_more(0):
                record(*_work(next(jobs).to_json()))
        else:
            ctx = mp.get_context("spawn")  # a fresh eSpeak per worker
            with cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                        initargs=(out, voices_json, config.max_seconds, True)) as ex:
                pending: set[cf.Future] = set()
                try:
                    while True:
                        while len(pending) < 4 * workers and want_more(len(pending)):
                            pending.add(ex.submit(_work, next(jobs).to_json()))
                        if not pending:
                            break
                        finished, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                        for fut in finished:
                            record(*fut.result())
                except KeyboardInterrupt:
                    # the workers ignore SIGINT: keep what they are finishing, then stop
                    interrupted = True
                    log("\ninterrupted: finishing the utterances in flight")
                    for fut in pending:
                        try:
                            record(*fut.result(timeout=120))
                        except (cf.CancelledError, cf.TimeoutError, BrokenProcessPool):
                            pass
    except (KeyboardInterrupt, BrokenProcessPool):
        interrupted = True
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        if interrupted:
            log("stopped: re-run the same command to continue")
        mf.close()
        rf.close()
        bar.close(n_rej)
    summary = summarize(out, corpus)
    summary["interrupted"] = interrupted
    return summary


# ----------------------------------------------------------------------------- summary
def summarize(out: str, corpus: Corpus | None = None) -> dict:
    """Totals of a corpus directory; also written to summary.json."""
    if corpus is None:
        with open(os.path.join(out, "config.json")) as f:
            saved = json.load(f)
        cfg = CorpusConfig(**{k: saved[k] for k in CorpusConfig.KEYS if k in saved})
        corpus = prepare(out, cfg, log=lambda *a: None)
    recs = read_jsonl(os.path.join(out, "manifest.jsonl"))
    rejects = read_jsonl(os.path.join(out, "rejects.jsonl"))
    per_split = {s: {"utterances": 0, "hours": 0.0, "sentences": set(), "voices": set(),
                     "heldout_voice_utterances": 0} for s in SPLITS}
    per_source: dict[str, dict] = {}
    for r in recs:
        s = per_split[r["split"]]
        s["utterances"] += 1
        s["hours"] += r["duration_s"] / 3600
        s["sentences"].add(r["sentence"])
        s["voices"].add(r["voice"])
        s["heldout_voice_utterances"] += bool(r["heldout_voice"])
        ps = per_source.setdefault(r["source"], {"utterances": 0, "hours": 0.0, "sentences": set()})
        ps["utterances"] += 1
        ps["hours"] += r["duration_s"] / 3600
        ps["sentences"].add(r["sentence"])
    pool_by_source = source_counts(corpus.pool)
    pool_splits = {s: corpus.splits.count(s) for s in SPLITS}
    reasons: dict[str, int] = {}
    for r in rejects:
        k = r["reason"].split(":")[0].split("(")[0].strip()
        reasons[k] = reasons.get(k, 0) + 1
    durs = sorted(r["duration_s"] for r in recs)
    summary = {
        "out": out,
        "utterances": len(recs),
        "hours": round(sum(durs) / 3600, 4),
        "duration_s": {"min": durs[0], "median": durs[len(durs) // 2], "max": durs[-1]} if durs else {},
        "splits": {s: {"utterances": v["utterances"], "hours": round(v["hours"], 4),
                       "sentences": len(v["sentences"]), "voices": len(v["voices"]),
                       "heldout_voice_utterances": v["heldout_voice_utterances"]}
                   for s, v in per_split.items()},
        "voices": {"total": len(corpus.voices),
                   "train": sum(not v.heldout for v in corpus.voices),
                   "heldout": sum(v.heldout for v in corpus.voices),
                   "heldout_variants": sorted({v.timbre for v in corpus.voices if v.heldout}),
                   "accents": sorted({v.accent for v in corpus.voices}),
                   "used": len({r["voice"] for r in recs})},
        "sentences": {"pool": len(corpus.pool), "pool_by_split": pool_splits,
                      "used": len({r["sentence"] for r in recs})},
        "sources": {src: {"pool_sentences": pool_by_source.get(src, 0),
                          "weight": round(w, 4),
                          "utterances": per_source.get(src, {}).get("utterances", 0),
                          "hours": round(per_source.get(src, {}).get("hours", 0.0), 4),
                          "sentences_used": len(per_source.get(src, {}).get("sentences", ()))}
                    for src, w in source_weights(corpus.pool, corpus.config.weights).items()},
        "engines": {e: {"utterances": sum(r.get("engine", "espeak") == e for r in recs),
                        "hours": round(sum(r["duration_s"] for r in recs if r.get("engine", "espeak") == e) / 3600, 4)}
                    for e in sorted({v.engine for v in corpus.voices})},
        "rejected": {"utterances": len(rejects), "by_reason": reasons},
    }
    _write_json(os.path.join(out, "summary.json"), summary)
    return summary


def format_summary(s: dict) -> str:
    lines = [f"corpus {s['out']}: {s['utterances']} utterances, {s['hours']:.3f} h"]
    for name, v in s["splits"].items():
        lines.append(f"  {name:5s} {v['hours']:8.3f} h  {v['utterances']:7d} utt  {v['sentences']:6d} sentences"
                     f"  {v['voices']:5d} voices  ({v['heldout_voice_utterances']} utt with held-out voices)")
    vo = s["voices"]
    lines.append(f"  voices: {vo['train']} train + {vo['heldout']} held out "
                 f"(variants {', '.join(vo['heldout_variants'])}); {len(vo['accents'])} accents; {vo['used']} used")
    if len(s.get("engines", {})) > 1:
        lines.append("  synthesisers: " + ", ".join(f"{e} {v['hours']:.3f} h ({v['utterances']} utt)"
                                                   for e, v in s["engines"].items()))
    se = s["sentences"]
    lines.append(f"  sentences: pool {se['pool']} ({', '.join(f'{k} {v}' for k, v in se['pool_by_split'].items())}),"
                 f" {se['used']} used")
    lines.append("  per source:   pool   weight   utt     hours")
    for src, v in s["sources"].items():
        lines.append(f"    {src:12s} {v['pool_sentences']:6d}  {v['weight']:.3f}  {v['utterances']:6d}  {v['hours']:8.3f}")
    rj = s["rejected"]
    lines.append(f"  rejected: {rj['utterances']} {rj['by_reason'] if rj['by_reason'] else ''}".rstrip())
    return "\n".join(lines)
