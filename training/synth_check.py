"""Synthesize a few sentences through the server engine with an exported model directory:
``python -m livespeech.training.synth_check --model models/weights/default --out runs/synth``.

Writes <out>/<voice>_<i>.wav (24 kHz) and prints load time, RTF, words and durations.
A sanity check of the shipped weights, not an evaluation."""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

SENTENCES = ["Hello there, this is a short test.", "The folder must exist before you save the file."]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m livespeech.training.synth_check")
    p.add_argument("--model", default="models/weights/default")
    p.add_argument("--out", default="runs/synth")
    p.add_argument("--voices", default="default")
    p.add_argument("--guidance", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from livespeech.models.loading import load_bundle, write_wav
    from livespeech.server.engine import Engine, EngineConfig
    from livespeech.api.session import Failed, SessionConfig, WordTiming

    from .eval.evaluate import run_session, session_audio

    t = time.time()
    bundle = load_bundle(a.model)
    print(f"load_bundle({a.model}): {time.time() - t:.2f} s; voices {sorted(bundle.builtin_voices)}", flush=True)
    eng = Engine(bundle, EngineConfig(max_sessions=2))
    eng.start()
    os.makedirs(a.out, exist_ok=True)
    try:
        for vid in a.voices.split(","):
            voice = eng.make_voice(vid, bundle.builtin_voices[vid], 24000)
            for i, text in enumerate(SENTENCES):
                t0 = time.time()
                cfg = SessionConfig(seed=0, guidance_lambda=a.guidance)
                events, _ = run_session(eng, cfg, voice, [(piece + " ", None, False) for piece in text.split(" ")], 120)
                if events is None:
                    print("timeout", flush=True)
                    continue
                el = time.time() - t0
                audio = session_audio(events)
                path = os.path.join(a.out, f"{vid}_{i}.wav")
                write_wav(path, audio, 24000)
                words = [e.word for e in events if isinstance(e, WordTiming)]
                fail = [e for e in events if isinstance(e, Failed)]
                dur = len(audio) / 24000
                print(f"{vid} #{i}: {dur:.2f} s audio in {el:.2f} s (RTF {el / max(dur, 1e-9):.2f}), "
                      f"rms {float(np.sqrt(np.mean(audio ** 2))) if len(audio) else 0:.3f}, words {words} {fail or ''} -> {path}",
                      flush=True)
    finally:
        eng.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
