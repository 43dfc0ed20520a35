"""The letter schedule: when each letter of the text is spoken, and which phone each
frame sounds.

The decoder alone loses the phone once it reads back its own codebook-1 samples; with
the letters forced on a timeline and codebook 1 drawn given each frame's phone, it
speaks (docs/eval.md, "What ships now"). Two small networks give that from the text
alone, without the acoustic history:

- `LetterDurationModel`: frames of each letter (or word gap) from its letter window,
  the synthesiser's engine and the voice's pace;
- `LetterPhoneModel`: the phone of a frame from its letter window, how many frames the
  letter has lasted, and the engine (phone sets are per engine);

and, for the codec's codebook-1 codes, how often each sounds each phone and the phone
each sounds most often, and optionally how that shifts with the phone's context
(`phone_context`: which half of its run a frame is in, and the phone on that side).
`FrontEnd` holds them (a model directory's `front_end.pt`, written by
livespeech.training.letter_phones); `LetterSchedule` is one session's timeline: words are
added as their text arrives, letters laid as the session's speech reaches them
(server/session.py).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from . import graphemes as G

WINDOW = 4  # letters either side
MAX_OFFSET = 12  # frames into the letter, clipped
PAD = G.VOCAB_SIZE


def contexts(letters: Sequence[int], positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per frame, the letter window around its position [N, 2W+1] (PAD outside the
    letters, and for position -1) and the frames its letter has lasted so far [N]."""
    padded = np.full(len(letters) + 2 * WINDOW, PAD, np.int64)
    padded[WINDOW:WINDOW + len(letters)] = letters
    pos = np.asarray(positions, np.int64)
    idx = np.clip(pos, 0, None)[:, None] + np.arange(2 * WINDOW + 1)[None, :]
    ctx = np.where((pos >= 0)[:, None], padded[idx], PAD)
    offset = np.zeros(len(pos), np.int64)
    for t in range(1, len(pos)):
        offset[t] = offset[t - 1] + 1 if pos[t] == pos[t - 1] else 0
    return ctx, offset


def phone_context(phones: Sequence[int], frame: int, complete: bool) -> Optional[tuple[int, int, int]]:
    """(phone, half, neighbour) of a frame of a per-frame phone timeline: the half of its
    phone's run the frame is in (0: the first) and the phone of the run on that side (-1:
    none, or a frame without a phone); a run's first frames sound the transition from the
    phone before, its last ones that into the next. None for a frame without a phone, and
    for one whose half is not known: past the first half of a run that may go on past the
    timeline's end (`complete` False: more frames will be laid)."""
    p = phones[frame]
    if p < 0:
        return None
    a, b = frame, frame + 1
    while a > 0 and phones[a - 1] == p:
        a -= 1
    while b < len(phones) and phones[b] == p:
        b += 1
    if 2 * (frame - a) < b - a:  # a longer run keeps it in the first half
        return p, 0, max(-1, phones[a - 1]) if a > 0 else -1
    if b == len(phones) and not complete:
        return None
    return p, 1, max(-1, phones[b]) if b < len(phones) else -1


class LetterPhoneModel(nn.Module):
    def __init__(self, n_phones: int, n_engines: int, dim: int = 32, hidden: int = 256):
        super().__init__()
        self.chars = nn.Embedding(PAD + 1, dim)
        self.offset = nn.Embedding(MAX_OFFSET + 1, 16)
        self.engine = nn.Embedding(n_engines, 8)
        self.mlp = nn.Sequential(nn.Linear((2 * WINDOW + 1) * dim + 24, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, n_phones))

    def forward(self, context: torch.Tensor, offset: torch.Tensor, engine: torch.Tensor) -> torch.Tensor:
        """context [N, 2W+1], offset [N], engine [N] -> phone logits [N, phones]."""
        x = torch.cat((self.chars(context).flatten(1), self.offset(offset.clamp(0, MAX_OFFSET)),
                       self.engine(engine)), dim=1)
        return self.mlp(x)


class LetterDurationModel(nn.Module):
    def __init__(self, n_engines: int, dim: int = 32, hidden: int = 256):
        super().__init__()
        self.chars = nn.Embedding(PAD + 1, dim)
        self.engine = nn.Embedding(n_engines, 8)
        self.mlp = nn.Sequential(nn.Linear((2 * WINDOW + 1) * dim + 9, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, context: torch.Tensor, engine: torch.Tensor, pace: torch.Tensor) -> torch.Tensor:
        """context [N, 2W+1], engine [N], pace [N] (log frames per letter) -> log(1 + frames) [N]."""
        x = torch.cat((self.chars(context).flatten(1), self.engine(engine), pace.view(-1, 1)), dim=1)
        return self.mlp(x).squeeze(1)


class FrontEnd:
    """The two networks, the phone each codebook-1 code names (`code_phones` [V], -1: none),
    how often each code sounds each phone (`phone_given_code` [phones, V], log p(phone |
    code), -inf for a code never seen; None: not known), what a phone's context adds to it
    (`contexts`: keys [R, 3] of `phone_context`, and a sparse [R, V] refinement, pairs
    [N, 2] (row, code) and values [N]; None: phones alone), the phone and engine names, the
    pace a voice is given, and the factor on the predicted durations (`duration_scale`:
    the networks regress log(1 + frames), whose exp falls short of the mean frames;
    training sets it so the train set's total comes out)."""

    def __init__(self, phones: LetterPhoneModel, durations: LetterDurationModel, code_phones: torch.Tensor,
                 phone_names: Sequence[str], engines: Sequence[str], pace: float, duration_scale: float = 1.0,
                 phone_given_code: Optional[torch.Tensor] = None, contexts: Optional[dict] = None):
        self.phones, self.durations = phones.eval(), durations.eval()
        self.code_phones = code_phones.long()
        self.phone_names, self.engines, self.pace = tuple(phone_names), tuple(engines), float(pace)
        self.duration_scale = float(duration_scale)
        self.phone_given_code = None if phone_given_code is None else phone_given_code.float()
        self.contexts = contexts
        keys = contexts["keys"].tolist() if contexts is not None else []
        self._context_rows = {tuple(k): len(self.phone_names) + i for i, k in enumerate(keys)}

    def to_dict(self) -> dict:
        return {"phones": self.phones.state_dict(), "durations": self.durations.state_dict(),
                "code_phones": self.code_phones, "phone_names": list(self.phone_names),
                "engines": list(self.engines), "pace": self.pace, "duration_scale": self.duration_scale,
                "phone_given_code": self.phone_given_code, "contexts": self.contexts}

    @classmethod
    def from_dict(cls, d: dict) -> "FrontEnd":
        phones = LetterPhoneModel(len(d["phone_names"]), len(d["engines"]))
        phones.load_state_dict(d["phones"])
        durations = LetterDurationModel(len(d["engines"]))
        durations.load_state_dict(d["durations"])
        return cls(phones, durations, d["code_phones"], d["phone_names"], d["engines"], d["pace"],
                   d.get("duration_scale", 1.0), d.get("phone_given_code"), d.get("contexts"))

    def first_code_bias(self) -> torch.Tensor:
        """[phones + contexts, V]: what codebook 1's logits get added at a frame of each
        phone, so a code is drawn as the decoder's choice given the phone (p(code |
        history) x p(phone | code)); finite (-1e4 stands for never: a non-finite logit is
        a numerical failure to the sampler). Without `phone_given_code`, 0 on the phone's
        own codes and never elsewhere (a phone no code names: no bias). Then a row for
        each known context (`bias_row`): its phone's row plus log p(code | context) -
        log p(code | phone), a constant per row dropped."""
        if self.phone_given_code is not None:
            base = self.phone_given_code.clamp_min(-1e4)
        else:
            own = self.code_phones.view(1, -1) == torch.arange(len(self.phone_names)).view(-1, 1)
            own |= ~own.any(1, keepdim=True)
            base = torch.zeros(own.shape).masked_fill(~own, -1e4)
        if self.contexts is None:
            return base
        rows = base[self.contexts["keys"][:, 0]].clone()
        pairs = self.contexts["pairs"].long()
        rows[pairs[:, 0], pairs[:, 1]] += self.contexts["values"].float()
        return torch.cat((base, rows))

    def bias_phones(self) -> torch.Tensor:
        """[rows of `first_code_bias`]: the phone of each row."""
        own = torch.arange(len(self.phone_names))
        return own if self.contexts is None else torch.cat((own, self.contexts["keys"][:, 0].long()))

    def bias_row(self, phones: Sequence[int], frame: int) -> int:
        """The row of `first_code_bias` for a frame of a schedule's phones (laid so far):
        its phone in context where that context is known, else its phone (-1: none)."""
        if not self._context_rows:
            return phones[frame]
        ctx = phone_context(phones, frame, complete=False)
        return phones[frame] if ctx is None else self._context_rows.get(ctx, ctx[0])

    @classmethod
    def load(cls, path: os.PathLike | str) -> "FrontEnd":
        return cls.from_dict(torch.load(path, map_location="cpu", weights_only=True))

    def voice_engine(self, first_codes: torch.Tensor) -> int:
        """The engine whose phones a voice's codebook-1 codes name most often."""
        named = self.code_phones[first_codes.long().cpu()]
        named = named[named >= 0]
        votes = [sum(1 for i in named.tolist() if self.phone_names[i].startswith(e + ":")) for e in self.engines]
        return int(np.argmax(votes))

    @torch.no_grad()
    def frames_of(self, letters: Sequence[int], first: int, last: int, engine: int, carry: float) -> tuple[list[int], float]:
        """Frames of letters[first:last] (their windows read all of `letters`), at least one
        each (a letter left out would leave the grapheme stream short of the text), the
        rounding carried from the letters before and on to the ones after."""
        ctx, _ = contexts(letters, range(first, last))
        n = last - first
        f = self.durations(torch.from_numpy(ctx), torch.full((n,), engine), torch.full((n,), self.pace))
        out = []
        for x in ((f.exp() - 1).clamp_min(0) * self.duration_scale).tolist():
            carry += x
            out.append(max(1, int(round(carry))))
            carry -= out[-1]
        return out, carry

    @torch.no_grad()
    def phones_of(self, letters: Sequence[int], positions: Sequence[int], offsets: Sequence[int],
                  engine: int) -> list[int]:
        ctx, _ = contexts(letters, positions)
        n = len(positions)
        return self.phones(torch.from_numpy(ctx), torch.tensor(offsets, dtype=torch.long),
                           torch.full((n,), engine)).argmax(1).tolist()


class LetterSchedule:
    """One session's letters on its frames. Words are added as their text arrives; `lay`
    lays every letter whose window (the letters it reads) is there, all of them when the
    text is complete; the session calls it when its speech reaches the last letter laid.
    Frames the speech stepped with no letter laid (waiting at the end of the text) stay
    unscheduled: the next letters start where the speech is."""

    def __init__(self, front_end: FrontEnd, engine: int):
        self.front_end, self.engine = front_end, engine
        self.letters: list[int] = []
        self.laid = 0  # letters laid so far
        self.graphemes: list[int] = []  # per frame: the letter (-1: unscheduled)
        self.phones: list[int] = []  # per frame: its phone (-1: unscheduled)
        self.first_word_end = 0  # letters of the first word
        self._carry = 0.0

    def add_word(self, word_letters: Sequence[int]) -> None:
        if word_letters:
            self.first_word_end = self.first_word_end or len(word_letters)
            self.letters += ([G.SPACE] if self.letters else []) + list(word_letters)

    def lay(self, now: int, final: bool) -> None:
        """Lay the letters whose window is complete (all with `final`) from frame `now` on
        (or after the frames already laid)."""
        last = len(self.letters) if final else max(self.laid, len(self.letters) - WINDOW)
        if last <= self.laid:
            return
        fe = self.front_end
        if len(self.graphemes) < now:
            gap = now - len(self.graphemes)
            self.graphemes += [-1] * gap
            self.phones += [-1] * gap
        counts, self._carry = fe.frames_of(self.letters, self.laid, last, self.engine, self._carry)
        positions = [self.laid + i for i, n in enumerate(counts) for _ in range(n)]
        offsets = [k for n in counts for k in range(n)]
        if positions:
            self.graphemes += [self.letters[p] for p in positions]
            self.phones += fe.phones_of(self.letters, positions, offsets, self.engine)
        self.laid = last

    def lay_first_word(self, now: int) -> None:
        """Lay the text so far whole while its first word is not (its last letters'
        windows read the text's end where the next word will be, as a text's last word
        is laid), so the first audio need not wait for the second word."""
        if self.laid < self.first_word_end:
            self.lay(now, final=True)

    @property
    def n_frames(self) -> int:
        return len(self.graphemes)

    def grapheme(self, frame: int) -> int:
        return self.graphemes[frame] if 0 <= frame < len(self.graphemes) else -1

    def phone(self, frame: int) -> int:
        return self.phones[frame] if 0 <= frame < len(self.phones) else -1

    def bias_row(self, frame: int) -> int:
        """The front end's `first_code_bias` row for the frame (-1: none)."""
        return self.front_end.bias_row(self.phones, frame) if 0 <= frame < len(self.phones) else -1


def load_front_end(model_dir: Optional[os.PathLike | str]) -> Optional[FrontEnd]:
    path = None if model_dir is None else os.path.join(model_dir, "front_end.pt")
    return FrontEnd.load(path) if path and os.path.exists(path) else None
