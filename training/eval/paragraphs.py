"""Long texts sent at once, as an LLM far ahead of the speech sends them: WER and CER of
paragraphs of consecutive test sentences (or of a file's lines) spoken in one session
each, through the server's engine with its defaults, in one built-in voice.

    python -m livespeech.training.eval.paragraphs --corpus data/corpus --model models/weights/default \\
        --paragraphs 30 --sentences 6 --out runs/paragraphs.json
    python -m livespeech.training.eval.paragraphs --text-file training/eval/numbers.txt --out runs/numbers.json \\
        [--no-spoken-form]
    python -m livespeech.training.eval.compare A.json B.json --mode paragraph --lambda 1

The sentence-level evaluation (`python -m livespeech.training.eval`) pushes one test
sentence a session; a paragraph's text outruns the model's text memory (75 tokens), so
this is where the memory's upkeep shows. There is no ground truth recording of a
paragraph: WER is against its text. The JSON's rows have the evaluation's fields, so
`compare` pairs two runs paragraph by paragraph.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Optional

from livespeech.api.session import Finished, SessionConfig
from livespeech.training.dataset import read_manifest
from livespeech.training.eval.backends import WhisperASR
from livespeech.training.eval.evaluate import SR, run_session, session_audio
from livespeech.training.eval.text import error_counts, get_normalizer

MODE = "paragraph"


def paragraphs(corpus: Path, n: int, sentences: int, split: str = "test") -> list[str]:
    """The first `n` runs of `sentences` consecutive sentences of the corpus split."""
    texts = [r["text"] for r in read_manifest(corpus) if r.get("split") == split]
    out = [" ".join(texts[i * sentences:(i + 1) * sentences]) for i in range(min(n, len(texts) // sentences))]
    if not out:
        raise ValueError(f"{corpus}: fewer than {sentences} {split} sentences")
    return out


def evaluate(model: str, texts: list[str], voice: str = "default", asr: Optional[WhisperASR] = None,
             timeout_s: float = 600.0, log=print, spoken_form: bool = True) -> list[dict]:
    """One session a text (seed = its index), all of it pushed at once; a row each.
    spoken_form: the engine's (numbers and symbols said in words, models/spoken_form.py)."""
    from livespeech.models.loading import load_bundle
    from livespeech.server.engine import Engine, EngineConfig
    from livespeech.server.runner import codec_runtime

    bundle = load_bundle(None if model == "default" else model)
    if voice not in bundle.builtin_voices:
        raise ValueError(f"voice {voice!r} is not built in: {sorted(bundle.builtin_voices)}")
    engine = Engine(bundle, EngineConfig(max_sessions=1, max_lead_s=1e6, codec_runtime=codec_runtime("auto", "cpu"),
                                         spoken_form=spoken_form))
    engine.start()
    normalize = get_normalizer()
    rows = []
    try:
        ref = engine.make_voice(voice, bundle.builtin_voices[voice], SR)
        for i, text in enumerate(texts):
            cfg = SessionConfig(seed=i)
            t0 = time.perf_counter()
            events, _ = run_session(engine, cfg, ref, [(text, None, False)], timeout_s)
            if events is None:
                raise TimeoutError(f"paragraph {i}: no end within {timeout_s:g} s")
            audio = session_audio(events)
            summary = next((e.summary for e in events if isinstance(e, Finished)), None)
            if summary is None:
                raise RuntimeError(f"paragraph {i}: the session failed ({events[-1] if events else 'no events'})")
            row = {"utt": f"p{i:03d}", "system": "model", "mode": MODE, "lambda": cfg.guidance_lambda,
                   "voice": voice, "text": text, "audio_s": len(audio) / SR, "wall_s": time.perf_counter() - t0,
                   "unspoken_words": list(summary.unspoken_words)}
            if asr is not None:
                hyp = asr.transcribe(audio, SR)
                c = error_counts(text, hyp, normalize)
                row.update(hyp=hyp, word_errors=c.word_errors, ref_words=c.ref_words, char_errors=c.char_errors,
                           ref_chars=c.ref_chars)
            rows.append(row)
            log(f"{row['utt']}: {row.get('word_errors', '-')} / {row.get('ref_words', '-')} words wrong, "
                f"{row['audio_s']:.1f} s")
    finally:
        engine.stop()
    return rows


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m livespeech.training.eval.paragraphs",
                                description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", type=Path, help="paragraphs of the corpus's test sentences")
    source.add_argument("--text-file", type=Path, help="a text a line instead")
    p.add_argument("--model", default="default", help="a model directory (default: the embedded default)")
    p.add_argument("--paragraphs", type=int, default=30)
    p.add_argument("--sentences", type=int, default=6, help="consecutive test sentences a paragraph")
    p.add_argument("--voice", default="default", help="a built-in voice of the model")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-asr", action="store_true", help="speak only (no Whisper)")
    p.add_argument("--no-spoken-form", dest="spoken_form", action="store_false",
                   help="every word read as written (the server's --spoken-form false)")
    p.add_argument("--out", type=Path, required=True, help="the rows as JSON")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    asr = None
    if not a.skip_asr:
        asr = WhisperASR("base", threads=a.threads)
        if not asr.available():
            p.error(f"Whisper base: {asr.reason}")
    if a.text_file is not None:
        texts = [line.strip() for line in a.text_file.read_text().splitlines() if line.strip()]
    else:
        texts = paragraphs(a.corpus, a.paragraphs, a.sentences)
    rows = evaluate(a.model, texts, a.voice, asr, spoken_form=a.spoken_form)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"meta": {"model": a.model, "corpus": str(a.corpus), "text_file": str(a.text_file),
                                          "paragraphs": len(texts), "sentences": a.sentences, "voice": a.voice,
                                          "spoken_form": a.spoken_form,
                                          "asr": None if asr is None else asr.description},
                                 "utterances": rows}, indent=1))
    if asr is not None:
        words = sum(r["ref_words"] for r in rows)
        print(f"WER {100 * sum(r['word_errors'] for r in rows) / words:.1f} % "
              f"CER {100 * sum(r['char_errors'] for r in rows) / sum(r['ref_chars'] for r in rows):.1f} % "
              f"over {len(rows)} paragraphs ({words} words)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
