"""Whisper BPE text tokenizer (the paper's word tokens), built offline.

tiktoken's built-in encodings download at first use; Whisper's own ranks ship inside
the `openai-whisper` package, so we build the encoding from that file the way
`whisper.tokenizer.get_encoding` does, without importing whisper (whose __init__
needs numba and torch).
"""
from __future__ import annotations

import base64
import functools
import importlib.util
import os
from pathlib import Path

from .config import TEXT_EOS, WHISPER_VOCAB

# Whisper's pre-tokenizer pattern (same as GPT-2's)
_PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_N_LANGUAGES = 100  # large-v3: 51,866 ids in all


def _find_asset() -> Path:
    override = os.environ.get("LIVESPEECH_TIKTOKEN_FILE")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("whisper")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "Whisper's BPE ranks were not found: install them with "
            "`pip install --no-deps openai-whisper==20250625` (0.8 MB, no torch needed) "
            "or point LIVESPEECH_TIKTOKEN_FILE at multilingual.tiktoken"
        )
    return Path(spec.origin).parent / "assets" / "multilingual.tiktoken"


def _special_tokens() -> list[str]:
    # Same order as whisper.tokenizer.get_encoding, so ids match Whisper's.
    langs = [f"<|lang{i}|>" for i in range(_N_LANGUAGES)]
    return (
        ["<|endoftext|>", "<|startoftranscript|>"]
        + langs
        + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>",
           "<|nospeech|>", "<|notimestamps|>"]
        + [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
    )


class TextTokenizer:
    """Encodes whole words to Whisper ids; `eos_id` ends the text stream."""

    eos_id = TEXT_EOS
    vocab_size = WHISPER_VOCAB + 1

    def __init__(self) -> None:
        import tiktoken

        ranks = {}
        for line in _find_asset().read_text().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        n = len(ranks)
        specials = {tok: n + i for i, tok in enumerate(_special_tokens())}
        self._enc = tiktoken.Encoding(
            name="whisper-multilingual", explicit_n_vocab=n + len(specials),
            pat_str=_PAT_STR, mergeable_ranks=ranks, special_tokens=specials,
        )
        if self._enc.n_vocab != WHISPER_VOCAB:
            raise RuntimeError(f"unexpected Whisper vocabulary size {self._enc.n_vocab}")

    def encode_words(self, words: list[str], first_in_text: bool) -> list[int]:
        """Ids of whole words. A word not at the start of the text carries its leading
        space, as in Whisper's transcripts, so ids do not depend on chunking."""
        text = " ".join(words)
        if not first_in_text:
            text = " " + text
        return self._enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode([i for i in ids if i < WHISPER_VOCAB])


@functools.lru_cache(maxsize=1)
def get_tokenizer() -> TextTokenizer:
    return TextTokenizer()
