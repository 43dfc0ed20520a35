"""Text-token embeddings computed from each token's spelling.

The tokenizer stays Whisper's BPE (the paper's), but a token's vector is not a row of a
51,866 x d table learnt separately for every token from the few times it occurs: it is
computed from the token's bytes by one small shared character encoder. Tokens that share
letters share what was learnt about them, and a token never seen in training is still
read.

The spelling table (token id -> its bytes, padded) is a buffer of the module, so a
saved decoder carries it and loading needs no tokenizer.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from .config import ModelConfig, TEXT_EOS

PAD = 0  # byte b is id b + 1
EOS_CHAR = 257  # the whole spelling of TEXT_EOS
N_CHARS = 258


@functools.lru_cache(maxsize=4)
def spelling_table(vocab_size: int, max_len: int) -> torch.Tensor:
    """int16 [vocab_size, max_len]: each Whisper token's bytes + 1 (truncated, PAD after);
    special tokens and TEXT_EOS get one reserved id."""
    from .tokenizer import get_tokenizer

    enc = get_tokenizer()._enc
    table = torch.zeros(vocab_size, max_len, dtype=torch.int16)
    n_ordinary = enc.n_vocab - len(enc.special_tokens_set)
    for i in range(min(vocab_size, enc.n_vocab)):
        if i >= n_ordinary:
            table[i, 0] = EOS_CHAR  # special tokens never reach the decoder; TEXT_EOS does
            continue
        b = enc.decode_single_token_bytes(i)[:max_len]
        table[i, : len(b)] = torch.tensor(list(b), dtype=torch.int16) + 1
    if TEXT_EOS < vocab_size:
        table[TEXT_EOS] = 0
        table[TEXT_EOS, 0] = EOS_CHAR
    return table


class SpellingEmbedding(nn.Module):
    """token ids [...] -> [..., d_model]: byte embeddings + positions, two convolutions,
    a masked mean and max over the bytes, a linear map."""

    def __init__(self, cfg: ModelConfig, width: int = 192):
        super().__init__()
        n = cfg.spelling_max_len
        self.register_buffer("spellings", spelling_table(cfg.text_vocab_size, n).clone())
        self.char_emb = nn.Embedding(N_CHARS, width, padding_idx=PAD)
        self.pos_emb = nn.Parameter(torch.randn(n, width) * 0.02)
        self.conv1 = nn.Conv1d(width, width, 3, padding=1)
        self.conv2 = nn.Conv1d(width, width, 3, padding=1)
        self.out = nn.Linear(2 * width, cfg.d_model)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        shape = token_ids.shape
        chars = self.spellings[token_ids.reshape(-1)].long()  # [N, L]
        mask = (chars != PAD).unsqueeze(-1)  # [N, L, 1]
        x = self.char_emb(chars) + self.pos_emb
        x = x.transpose(1, 2)  # [N, W, L]
        x = x + nn.functional.gelu(self.conv1(x))
        x = (x + nn.functional.gelu(self.conv2(x))).transpose(1, 2)  # [N, L, W]
        x = x * mask
        mean = x.sum(1) / mask.sum(1).clamp_min(1)
        mx = x.masked_fill(~mask, float("-inf")).amax(1).masked_fill(~mask.any(1), 0.0)
        return self.out(torch.cat([mean, mx], -1)).view(*shape, -1)
