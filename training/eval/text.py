"""Text normalisation and word/character error rates without jiwer.

WER follows the usual ASR-evaluation recipe (and the paper's): both the reference and
the ASR transcript go through Whisper's `EnglishTextNormalizer` (spelling, numbers,
contractions, punctuation), then a word-level Levenshtein distance is divided by the
number of reference words. The normaliser ships inside `openai-whisper`
(`whisper/normalizers/`), but `import whisper` needs torch, numba and tqdm, so its two
files are loaded directly from the installed package folder (they need `regex` and
`more-itertools`). Without them a simple fallback (lower case, no punctuation) is used
and the report says which normaliser produced the numbers.
"""
from __future__ import annotations

import importlib.util
import re
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

_PKG = "_livespeech_whisper_normalizers"


def load_whisper_normalizer() -> Callable[[str], str]:
    """Whisper's EnglishTextNormalizer without importing the `whisper` package.
    Raises ImportError (with the missing package in the message) when unavailable."""
    if _PKG in sys.modules and hasattr(sys.modules[_PKG], "EnglishTextNormalizer"):
        return sys.modules[_PKG].EnglishTextNormalizer()
    spec = importlib.util.find_spec("whisper")
    if spec is None or spec.origin is None:
        raise ImportError("package openai-whisper not installed")
    folder = Path(spec.origin).parent / "normalizers"
    if not (folder / "english.py").exists():
        raise ImportError(f"openai-whisper has no normalizers/ folder at {folder}")
    pkg_spec = importlib.util.spec_from_file_location(
        _PKG, folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(pkg_spec)
    sys.modules[_PKG] = module
    try:
        pkg_spec.loader.exec_module(module)
    except ImportError as exc:  # regex / more-itertools missing
        del sys.modules[_PKG]
        for sub in ("basic", "english"):
            sys.modules.pop(f"{_PKG}.{sub}", None)
        name = getattr(exc, "name", None) or str(exc)
        raise ImportError(f"package {name.replace('_', '-')} not installed (needed by Whisper's normalizer)") from exc
    return module.EnglishTextNormalizer()


def simple_normalize(text: str) -> str:
    """Fallback: NFKD, lower case, apostrophes dropped, other punctuation to spaces."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = re.sub(r"[’']", "", text)
    text = re.sub(r"[^\w\s]|_", " ", text)
    return " ".join(text.split())


@dataclass
class Normalizer:
    name: str
    fn: Callable[[str], str]
    note: str = ""

    def __call__(self, text: str) -> str:
        # Whisper's normaliser keeps a final "." that follows a word ("here..." -> "here ."):
        # tokens of punctuation alone are not words
        return " ".join(t for t in self.fn(text).split() if any(c.isalnum() for c in t))


def get_normalizer(prefer_whisper: bool = True) -> Normalizer:
    if prefer_whisper:
        try:
            return Normalizer("whisper EnglishTextNormalizer", load_whisper_normalizer())
        except ImportError as exc:
            return Normalizer("simple (lower case, no punctuation)", simple_normalize,
                              note=f"Whisper normaliser unavailable: {exc}")
    return Normalizer("simple (lower case, no punctuation)", simple_normalize)


def edit_distance(ref: Sequence, hyp: Sequence) -> int:
    """Levenshtein distance (substitutions + deletions + insertions), O(len(hyp)) memory."""
    if not ref:
        return len(hyp)
    if not hyp:
        return len(ref)
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


@dataclass
class ErrorCounts:
    word_errors: int
    ref_words: int
    char_errors: int
    ref_chars: int

    @property
    def wer(self) -> float:
        return self.word_errors / max(1, self.ref_words)

    @property
    def cer(self) -> float:
        return self.char_errors / max(1, self.ref_chars)


def error_counts(ref: str, hyp: str, normalize: Optional[Callable[[str], str]] = None) -> ErrorCounts:
    """Word and character edit distances between normalised strings (characters: spaces
    kept as one separator, as in the usual CER)."""
    normalize = normalize or simple_normalize
    r, h = normalize(ref), normalize(hyp)
    rw, hw = r.split(), h.split()
    rc, hc = " ".join(rw), " ".join(hw)
    return ErrorCounts(edit_distance(rw, hw), len(rw), edit_distance(rc, hc), len(rc))


def corpus_rates(counts: Sequence[ErrorCounts]) -> tuple[float, float]:
    """Corpus-level (WER, CER) in [0, inf): total errors / total reference units."""
    we = sum(c.word_errors for c in counts)
    rw = sum(c.ref_words for c in counts)
    ce = sum(c.char_errors for c in counts)
    rc = sum(c.ref_chars for c in counts)
    return we / max(1, rw), ce / max(1, rc)
