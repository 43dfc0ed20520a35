"""LiveSpeech 2 decoder (paper Sec. 4, 5.2): Mamba layers each followed by
cross-attention over [enrollment ; text window], grapheme + acoustic codebooks with a
delay pattern, shared layers then one branch per codebook group.

Two ways to run it, with the same weights:
- `forward` (teacher forcing over whole sequences) for training;
- `step` (one frame for a batch of sessions) for inference, over a caller-owned
  `DecodeState` (models/inference.py), like mamba-ssm's `step` + inference cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .attention import CrossAttention, rope_angles, rope_query_matrix
from .config import ModelConfig
from .derived import INT8, derived, matmul_t, transposed
from .mamba import MambaBlock, make_mamba
from .speech_encoder import SpeechEncoder
from .spelling import SpellingEmbedding

if TYPE_CHECKING:
    from .inference import DecodeStateView


class DecoderLayer(nn.Module):
    """h += Mamba(norm(h)); h += CrossAttn(norm(h), [enrollment ; text])."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, device=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        # mamba-ssm's CUDA kernels when built on a CUDA device and installed, else ours
        self.mamba = make_mamba(cfg.d_model, d_state=cfg.d_state, d_conv=cfg.d_conv, expand=cfg.expand,
                                layer_idx=layer_idx, device=device)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.xattn = CrossAttention(cfg.d_model, cfg.n_heads, cfg.rope_base)

    def forward(self, h, qpos, enr_kv, txt_kv, txt_pos, txt_mask, text_weights=None):
        h = h + self.mamba(self.norm1(h))
        a = self.xattn.attend(self.norm2(h), qpos, *enr_kv, *txt_kv, txt_pos, txt_mask, text_weights)
        return h + a

    @staticmethod
    def attention_matmul_dtype(matmul_dtype: Optional[torch.dtype],
                               memory_dtype: torch.dtype = torch.float32) -> Optional[torch.dtype]:
        """The weights of the attention's query and output projections for a step whose
        widest matmuls take `matmul_dtype`: int8 as those; bfloat16 with a bfloat16
        memory (a GPU's bf16 path, server/runner.py); else float32 (None): on the CPU
        its 256-wide projections ran slower with bf16 weights (16 x 256 x 256, 38 against
        20 us), while int8 halved them (16 sessions, an AVX2 EPYC: 0.85 -> 0.41 ms a step,
        their distributions' distance from float32 as the other int8 matmuls' left it:
        loadtest/precision.py)."""
        if matmul_dtype == INT8 or memory_dtype != torch.float32:
            return matmul_dtype
        return None

    def step(self, h, conv_state, ssm_state, q_rope, mem_k, mem_v, bias, matmul_dtype=None):
        """h [B, D]; Mamba states updated in place (mamba-ssm's step convention)."""
        # only our block takes a matmul dtype; mamba-ssm's (on CUDA where it is installed)
        # keeps its own projections' dtype
        kw = {"matmul_dtype": matmul_dtype} if matmul_dtype is not None and isinstance(self.mamba, MambaBlock) else {}
        y, _, _ = self.mamba.step(self.norm1(h).unsqueeze(1), conv_state, ssm_state, **kw)
        h = h + y.squeeze(1)
        attn_dtype = self.attention_matmul_dtype(matmul_dtype, mem_k.dtype)
        return h + self.xattn.attend_step(self.norm2(h), q_rope, mem_k, mem_v, bias, attn_dtype)


@dataclass
class StepLogits:
    graphemes: torch.Tensor  # [B, n_graphemes]
    acoustic: torch.Tensor  # [B, Q, codebook_size]


def text_guided(conditioned: StepLogits, unconditioned: StepLogits, scale: float) -> StepLogits:
    """Classifier-free guidance on the text: each stream's logits moved `scale` times
    their difference further from the decoder's prediction without text (all text keys
    masked; training/train.py `--text-dropout` trains it), so what the text adds is
    amplified. 0: the conditioned logits unchanged."""
    def guided(c: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return c + scale * (c - u)
    return StepLogits(graphemes=guided(conditioned.graphemes, unconditioned.graphemes),
                      acoustic=guided(conditioned.acoustic, unconditioned.acoustic))


class LiveSpeech2(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        # +1: the "none" input token for positions the delay pattern leaves empty
        self.vocab_sizes = [cfg.n_graphemes] + [cfg.codebook_size] * cfg.n_acoustic_codebooks
        self.code_emb = nn.ModuleList(nn.Embedding(v + 1, d) for v in self.vocab_sizes)
        self.text_emb = SpellingEmbedding(cfg) if cfg.text_embedding == "spelling" else nn.Embedding(cfg.text_vocab_size, d)
        # the phone input (row n_phones: none); zero at first, so a decoder trained without
        # it and continued with it starts where it was
        self.phone_emb = nn.Embedding(cfg.n_phones + 1, d) if cfg.n_phones else None
        self.speech_encoder = SpeechEncoder(cfg)
        n_layers = cfg.n_shared_layers + len(cfg.codebook_groups) * cfg.n_group_layers
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, device) for i in range(n_layers))
        self.group_norms = nn.ModuleList(nn.LayerNorm(d) for _ in cfg.codebook_groups)
        self.heads = nn.ModuleList(nn.Linear(d, v, bias=False) for v in self.vocab_sizes)
        self.apply(self._init)
        if self.phone_emb is not None:
            nn.init.zeros_(self.phone_emb.weight)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    # --- structure -------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def none_ids(self) -> list[int]:
        return list(self.vocab_sizes)

    def group_layer_ids(self, g: int) -> range:
        start = self.cfg.n_shared_layers + g * self.cfg.n_group_layers
        return range(start, start + self.cfg.n_group_layers)

    # --- memory ----------------------------------------------------------------
    def encode_enrollment(self, codes: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.speech_encoder(codes, lengths)

    def project_enrollment(self, enroll: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer unrotated K/V of the enrollment vectors ([B, N, D] -> [B, H, N, hd] each)."""
        return [layer.xattn.project_memory(enroll) for layer in self.layers]

    def project_text(self, token_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer unrotated K/V of text tokens ([B, L] -> [B, H, L, hd] each), computed
        once per chunk: a decode step never re-projects old text."""
        emb = self.text_emb(token_ids)
        return [layer.xattn.project_memory(emb) for layer in self.layers]

    # --- training ----------------------------------------------------------------
    def embed_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        """inputs [B, K, S] token ids (none id where empty) -> summed embeddings [B, S, D]."""
        return sum(emb(inputs[:, k]) for k, emb in enumerate(self.code_emb))

    def forward(
        self,
        inputs: torch.Tensor,  # [B, K, S] delayed input tokens (see delay.py)
        enroll: torch.Tensor,  # [B, N, D]
        text_ids: torch.Tensor,  # [B, L]
        text_pos: torch.Tensor,  # [B, L]
        text_mask: torch.Tensor,  # [B, L] or [B, S, L] bool
        text_weights: Optional[list] = None,
        phones: Optional[torch.Tensor] = None,  # [B, S] with a phone input (`phone_inputs`)
    ) -> list[torch.Tensor]:
        """Teacher-forced logits, one [B, S, V_k] tensor per codebook (grapheme first).
        ``text_weights``: a list each layer appends its text attention weights
        [B, H, S, L] to, in layer order."""
        b, _, s = inputs.shape
        h = self._with_phones(self.embed_inputs(inputs), phones)
        qpos = torch.arange(s, device=inputs.device).unsqueeze(0).expand(b, s)
        enr = self.project_enrollment(enroll)
        txt = self.project_text(text_ids)

        def run(h, ids):
            for i in ids:
                h = self.layers[i](h, qpos, enr[i], txt[i], text_pos, text_mask, text_weights)
            return h

        return self._grouped_logits(h, run)

    def phone_inputs(self, phones: torch.Tensor) -> torch.Tensor:
        """Phone classes (-1 or any negative: none) as the phone input's ids."""
        return torch.where(phones >= 0, phones, self.cfg.n_phones)

    def _with_phones(self, h: torch.Tensor, phones: Optional[torch.Tensor]) -> torch.Tensor:
        if self.phone_emb is None:
            return h
        if phones is None:
            raise ValueError("this decoder reads a phone each step: pass phones")
        return h + self.phone_emb(self.phone_inputs(phones))

    def _grouped_logits(self, h: torch.Tensor, run, fused_heads: bool = False,
                        matmul_dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
        """Shared layers, then each codebook group's branch, norm and heads; `run(h, ids)`
        applies layers `ids` (whole sequences in training, one step in inference).
        `fused_heads`: a group's heads as one matmul over their stacked weights (the
        same numbers; one op instead of one per codebook, for the decode step)."""
        shared = run(h, range(self.cfg.n_shared_layers))
        logits: list[torch.Tensor] = []
        for g, (a, z) in enumerate(self.cfg.group_slices()):
            hg = self.group_norms[g](run(shared, self.group_layer_ids(g)))
            if fused_heads:
                logits.extend(self._fused_heads(g, hg, matmul_dtype))
            else:
                logits.extend(self.heads[k](hg) for k in range(a, z))
        return logits

    def _fused_heads(self, g: int, hg: torch.Tensor, matmul_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, ...]:
        """Group g's heads on hg [B, D] as one matmul with their stacked, transposed weights."""
        a, z = self.cfg.group_slices()[g]
        return matmul_t(hg, self.group_head_weights(g, matmul_dtype)).split(self.vocab_sizes[a:z], dim=-1)

    def group_head_weights(self, g: int, matmul_dtype: Optional[torch.dtype] = None):
        """Group g's heads stacked and transposed for `matmul_t`, derived once."""
        a, z = self.cfg.group_slices()[g]
        heads = [self.heads[k].weight for k in range(a, z)]
        return derived(self, f"_group_heads_{g}_{matmul_dtype}", heads, lambda: transposed(torch.cat(heads), matmul_dtype))

    def _embed_step(self, inputs: torch.Tensor) -> torch.Tensor:
        """inputs [B, K] -> summed code embeddings [B, D], as one lookup in the stacked
        tables (K lookups and adds otherwise)."""
        table, offsets = self.step_embedding()
        return F.embedding(inputs + offsets, table).sum(1)

    def step_embedding(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The code embeddings stacked [sum of (vocab + 1), D] and each codebook's first
        row in it [K], derived once."""
        tables = [e.weight for e in self.code_emb]

        def build():
            sizes = torch.tensor([t.shape[0] for t in tables])
            offsets = torch.cumsum(sizes, 0) - sizes
            return torch.cat([t.detach() for t in tables]), offsets.to(tables[0].device)
        return derived(self, "_step_embedding", tables, build)

    # --- inference ---------------------------------------------------------------
    def step(self, inputs: torch.Tensor, frame: torch.Tensor, state: "DecodeStateView",
             text_mask: torch.Tensor, matmul_dtype: Optional[torch.dtype] = None,
             phones: Optional[torch.Tensor] = None) -> StepLogits:
        """One decode step for a batch of sessions.

        inputs [B, K] previous tokens (none id where empty); frame [B] query positions;
        state: the batch's view of the caller-owned DecodeState (recurrent parts updated
        in place); text_mask [B, L] the np/nf window over the first L text slots (L may
        be less than the memory's: slots past L are not read, so a caller that knows
        they are all masked saves their memory traffic). matmul_dtype: the widest
        matmuls' weights (the heads, the Mamba in and out projections; the cross-attention's
        too where the state's memory is in bfloat16, a GPU's path) in this dtype (bfloat16:
        models/derived.py); None = the model's. The attention runs in the dtype of the
        state's memory (`mem_k`). A model converted to bfloat16 as a whole (not a server
        setting: loadtest/precision.py) steps in its dtype; the logits come back in
        float32 either way.
        phones [B]: with a phone input, the phone of the frame codebook 1 is drawn for.
        """
        h = self._with_phones(self._embed_step(inputs), phones)
        cfg = self.cfg
        q_rope = rope_query_matrix(*rope_angles(frame, cfg.d_model // cfg.n_heads, cfg.rope_base)).to(h.dtype)
        # additive window mask: enrollment always visible, text keys by the np/nf window
        m = cfg.n_enroll + text_mask.shape[1]
        bias = torch.zeros(h.shape[0], 1, 1, m, dtype=state.mem_k.dtype, device=h.device)
        bias[:, 0, 0, cfg.n_enroll:].masked_fill_(~text_mask, float("-inf"))

        # every layer's state as views, made in four ops (two per layer and tensor otherwise);
        # under torch.compile indexed per layer, as unbinding a state the step updates in
        # place fixes its batch size there (one compiled step serves every batch size)
        if torch.compiler.is_compiling():
            conv, ssm = state.conv, state.ssm
        else:
            conv, ssm = state.conv.unbind(0), state.ssm.unbind(0)
        mem_k, mem_v = state.mem_k[:, :, :, :m].unbind(0), state.mem_v[:, :, :, :m].unbind(0)

        def run(h, ids):
            for i in ids:
                h = self.layers[i].step(h, conv[i], ssm[i], q_rope, mem_k[i], mem_v[i], bias, matmul_dtype)
            return h

        outs = self._grouped_logits(h, run, fused_heads=True, matmul_dtype=matmul_dtype)
        # float32 logits whatever the model's dtype: the sampler and the biases added to
        # them work in float32 (a no-op for a float32 model)
        return StepLogits(graphemes=outs[0].float(), acoustic=torch.stack(outs[1:], dim=1).float())


class CodebookLossWeights:
    """Per-codebook loss weights from prediction performance (LiveSpeech's weighting,
    lambda_cb = 0.1). Our reading, as the formula is not in the paper: a codebook's
    weight grows with its running error rate, and lambda_cb is a floor so codebooks that
    are already predicted well keep training: w_k ∝ (1 - acc_k) + lambda_cb, mean 1."""

    def __init__(self, n_codebooks: int, lambda_cb: float = 0.1, momentum: float = 0.99,
                 boost: Optional[dict[int, float]] = None):
        self.lambda_cb = lambda_cb
        self.momentum = momentum
        self.acc = torch.zeros(n_codebooks)
        # codebook -> a factor on its weight before the mean is taken: the first acoustic
        # codebook carries the intelligibility (docs/eval.md, "oracle graphemes"), while
        # accuracy-based weights give it less than the others
        self.boost = torch.ones(n_codebooks)
        for k, x in (boost or {}).items():
            if not (0 <= k < n_codebooks and x > 0):
                raise ValueError(f"codebook boost {k}:{x}: codebook in [0, {n_codebooks}), factor > 0")
            self.boost[k] = x

    def update(self, accuracies: torch.Tensor) -> None:
        """Kept where the accuracies are (on a GPU, no read of the device a step)."""
        acc = accuracies.detach().float()
        self.acc = self.momentum * self.acc.to(acc.device) + (1 - self.momentum) * acc

    def weights(self) -> torch.Tensor:
        w = ((1.0 - self.acc) + self.lambda_cb) * self.boost.to(self.acc.device)
        return w / w.mean()


def codebook_losses(logits: list[torch.Tensor], targets: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy and accuracy per codebook over valid positions (0 where there
    is none). targets/valid [B, K, S]. Returns (loss [K], acc [K]). The invalid positions
    are ignored rather than cut out: cutting needs their count on the host, which on a GPU
    stops the host until the device catches up, twice a codebook a step."""
    losses, accs = [], []
    for k, lg in enumerate(logits):
        m = valid[:, k]
        n = m.sum().clamp_min(1)
        tgt = targets[:, k].masked_fill(~m, -100)
        ce = F.cross_entropy(lg.float().flatten(0, -2), tgt.flatten(), ignore_index=-100, reduction="sum")
        losses.append(ce / n)
        accs.append(((lg.argmax(-1) == targets[:, k]) & m).sum() / n)
    return torch.stack(losses), torch.stack(accs)
