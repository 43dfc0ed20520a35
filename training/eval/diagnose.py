"""Where the decoder fails: the grapheme stream (which letter when) or the acoustic
codebooks (intelligible audio for a given letter)?

    python -m livespeech.training.eval.diagnose --corpus data/corpus --model default --limit 20 \\
        --out docs/eval-runs/2026-11-23-oracle-graphemes.md

On the test utterances livespeech.training.eval.evaluate picks (same selection, same enrollment, same
per-utterance seed), each laid out exactly as training lays it out
(training/dataset.py `DecoderData.example`, the enrollment replaced by the eval's):

1. teacher forcing: per-codebook accuracy and cross-entropy of `LiveSpeech2.forward`
   (livespeech.training.train `forward_loss`) with the text fully visible (training's dev metric)
   and with the server's np/nf chunk window at the ground-truth chunk times;
2. synthesis through `LiveSpeech2.step` + `DecodeState` (as server/runner.py steps it),
   the text chunks at their ground-truth times with the end-of-text key at the last
   frame (as in training), the np/nf window of server/session.py, top-k sampling of
   every codebook, no guidance, the engine's runaway guard (EOS forced 3 s past the end
   key), in these modes:
   - `free`: every codebook sampled;
   - `oracle-g`: the grapheme codebook forced to the ground truth (EOS at the last
     frame), the acoustic codebooks sampled;
   - `oracle-g+cb1`: also the first acoustic codebook forced (codebook k at step t
     carries frame t - delay_k), codebooks 2-8 sampled;
   - `oracle-acoustic` (not run by default): every acoustic codebook forced, the
     graphemes sampled (the alignment given the true audio so far);
   and (not run by default) codebook 1 sampled only among the codes of one phone
   (each code's majority phone, `PhoneTable`): the true phone (`oracle-g+phone`), its own
   likeliest phone (`*+phone-argmax`), or the phone the front end's classifier gives the
   letter (`*+letter-phone`, with `--front-end`); the graphemes free, true (`oracle-g`),
   bound to the text (`bound`: guidance lambda inf) or on the letter schedule (`timed`:
   the server's letter schedule, livespeech.models.front_end).
   Every step draws its samples in the same order whatever is forced, so the modes
   share their random numbers. Each result is decoded with the bundle's codec and
   scored with livespeech.training.eval.evaluate's Whisper scorer, next to the ground truth and its
   codec resynthesis;
3. how much codebook 1 leans on the acoustic codes read back (teacher forcing, text fully
   visible, true letters): its argmax's accuracy and how often it names the ground-truth
   phone with that history true, with 30 % of its steps random (livespeech.training.train
   `corrupt_history`), with 30 % and all of its steps the model's own samples from a
   teacher-forced pass (`own_history`), all of them its own samples compounded over 4 and
   16 passes, and with none at all. A decoder that names the phone only from a true
   history drifts once it reads back its own samples.

Writes a markdown report and, next to it, a JSON with every utterance's numbers.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import random
import shlex
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from livespeech.models import graphemes as G
from livespeech.models.attention import current_chunk, window_chunk_range
from livespeech.models.guidance import GuidanceState, sample_top_k
from livespeech.api.session import SessionConfig
from livespeech.training.dataset import DecoderData, Example, codes_path, collate, read_manifest, read_wav_segment
from livespeech.training.encode_corpus import encode_batch, save_codes
from livespeech.training.phones import PhoneTable, PhoneVocab
from livespeech.training.eval import report
from livespeech.training.eval.backends import make_backends
from livespeech.training.eval.text import edit_distance, error_counts, get_normalizer
from livespeech.training.eval.evaluate import (SR, Scorer, Utterance, _json_default, codec_resynthesis, model_info, read_audio,
                               select_utterances)

SYNTH_MODES = ("free", "oracle-g", "oracle-g+cb1", "oracle-acoustic", "oracle-g+phone", "free+phone-argmax",
               "oracle-g+phone-argmax", "oracle-g+letter-phone", "free+letter-phone", "bound", "bound+letter-phone",
               "timed", "timed+letter-phone")
DEFAULT_MODES = SYNTH_MODES[:3]
MODE_LABELS = {"free": "free (graphemes sampled)", "oracle-g": "oracle graphemes",
               "oracle-g+cb1": "oracle graphemes + codebook 1",
               "oracle-acoustic": "oracle acoustic codes (graphemes sampled)",
               "oracle-g+phone": "oracle graphemes, codebook 1 sampled among the true phone's codes",
               "free+phone-argmax": "free, codebook 1 sampled among its likeliest phone's codes",
               "oracle-g+phone-argmax": "oracle graphemes, codebook 1 sampled among its likeliest phone's codes",
               "oracle-g+letter-phone": "oracle graphemes, codebook 1 among the codes of the letter's phone",
               "free+letter-phone": "free, codebook 1 among the codes of the emitted letter's phone",
               "bound": "graphemes bound to the text (guidance lambda inf)",
               "bound+letter-phone": "graphemes bound to the text, codebook 1 among the codes of the letter's phone",
               "timed": "graphemes forced to the predicted letter timeline",
               "timed+letter-phone": "graphemes forced to the predicted letter timeline, codebook 1 among the codes of the letter's phone"}
# per mode: (graphemes forced, how many acoustic codebooks forced, first ones first)
FORCING = {"free": (False, 0), "oracle-g": (True, 0), "oracle-g+cb1": (True, 1), "oracle-acoustic": (False, None),
           "oracle-g+phone": (True, 0), "free+phone-argmax": (False, 0), "oracle-g+phone-argmax": (True, 0),
           "oracle-g+letter-phone": (True, 0), "free+letter-phone": (False, 0), "bound": (False, 0),
           "bound+letter-phone": (False, 0), "timed": (True, 0), "timed+letter-phone": (True, 0)}


@dataclasses.dataclass
class Prepared:
    """One test utterance in the training layout."""
    utt: Utterance
    example: Example  # codes [K, T + 1] (graphemes + EOS, acoustic), text ids / positions, enrollment
    token_chunk: list[int]  # chunk of each text token; the end-of-text key is a chunk of its own
    chunk_tau: list[int]  # first position of each chunk (the end key's: T)

    @property
    def n_frames(self) -> int:  # T: frames of speech (the grapheme EOS is frame T)
        return self.example.n_frames - 1


def prepare(bundle, rows: list[dict], utts: list[Utterance], codes_dir: str, letters: str = "even") -> list[Prepared]:
    """Encode the utterances with the bundle's codec as livespeech.training.encode_corpus does, build
    their training examples (DecoderData) and put in each the enrollment the eval uses
    (the whole enrollment utterance, encoded as the server's `make_voice` does)."""
    model, tok = bundle.model, bundle.tokenizer
    q = model.cfg.n_acoustic_codebooks
    for u in utts:
        codes = encode_batch(bundle.codec, [read_wav_segment(str(u.audio))], q, bundle.device)[0]
        save_codes(codes_path(codes_dir, u.id), codes)
    by_id = {r["id"]: r for r in rows}
    recs = [by_id[u.id] for u in utts]
    split = recs[0]["split"] if recs else "test"
    data = DecoderData("", codes_dir, model.cfg, split, max_seconds=1e9, records=recs, tokenizer=tok, letters=letters)
    index = {it["rec"]["id"]: i for i, it in enumerate(data.items)}
    out = []
    for u in utts:
        if u.id not in index:  # text longer than the model's text memory (as in training: skipped)
            continue
        ex = data.example(index[u.id], random.Random(0))
        enroll = bundle.encode_audio(read_audio(u.enroll_audio), SR).cpu().numpy()
        ex = dataclasses.replace(ex, enroll=enroll)
        rec = by_id[u.id]
        words = [w[0] for w in rec["words"]]
        token_chunk: list[int] = []
        for i, (first, n, _tau) in enumerate(rec["chunks"]):  # as livespeech.training.dataset.text_tokens
            token_chunk += [i] * len(tok.encode_words(words[first:first + n], first_in_text=(i == 0)))
        token_chunk.append(len(rec["chunks"]))
        assert len(token_chunk) == len(ex.text_ids), "chunking differs from livespeech.training.dataset.text_tokens"
        chunk_tau = [int(c[2]) for c in rec["chunks"]] + [ex.text_pos[-1]]
        out.append(Prepared(u, ex, token_chunk, chunk_tau))
    return out


def window(chunk_tau: list[int], step: int, n_past: int, n_future: int) -> tuple[int, int]:
    """(first, last) chunk visible at `step` with the chunks at these positions (n_past < 0:
    unbounded), by the window functions the server uses."""
    return window_chunk_range(current_chunk(step, chunk_tau), None if n_past < 0 else n_past, n_future,
                              len(chunk_tau))


# --- 1. teacher forcing --------------------------------------------------------------------------
@torch.no_grad()
def teacher_forced(model, prep: Prepared, n_past: int, n_future: int) -> dict:
    """Per-codebook CE and accuracy (and the count of positions scored) of model.forward
    on the utterance's training batch, text fully visible and with the np/nf window."""
    from livespeech.training.train import forward_loss

    batch = collate([prep.example], model).to(next(model.parameters()).device)
    s = batch.inputs.shape[2]
    chunk = torch.tensor(prep.token_chunk)
    win = torch.zeros(1, s, len(prep.token_chunk), dtype=torch.bool)
    for t in range(s):
        lo, hi = window(prep.chunk_tau, t, n_past, n_future)
        win[0, t] = (chunk >= lo) & (chunk <= hi)
    n = batch.valid.sum((0, 2)).tolist()
    out = {}
    for name, mask in (("full", batch.text_valid), ("window", win.to(batch.inputs.device))):
        _, losses, accs, _ = forward_loss(model, batch, mask, torch.ones(model.cfg.n_codebooks))
        out[name] = {"ce": [round(float(x), 4) for x in losses], "acc": [round(float(x), 4) for x in accs], "n": n}
    return out


# (name, kind, share, passes): the acoustic codes read back, true, random (`corrupt_history`),
# the model's own samples (`own_history`: from a teacher-forced pass, or compounded over
# further passes), or all the empty id
HISTORIES = (("true", "true", 0.0, 0), ("30 % random", "random", 0.3, 0), ("30 % own samples", "own", 0.3, 1),
             ("all own samples", "own", 1.0, 1), ("all own samples, 4 passes", "own", 1.0, 4),
             ("all own samples, 16 passes", "own", 1.0, 16), ("none", "none", 1.0, 0))


@torch.no_grad()
def history_reliance(model, prep: Prepared, phones: Optional[PhoneTable], rec: dict, seed: int) -> dict:
    """Per history of HISTORIES: codebook-1 argmax hits / scored positions, and (with a
    phone table) frames whose argmax code names the ground-truth phone / labelled frames."""
    from livespeech.training.train import corrupt_history, own_history

    batch = collate([prep.example], model).to(next(model.parameters()).device)
    enroll = model.encode_enrollment(batch.enroll_codes, batch.enroll_len)
    none = model.none_ids()
    d1, T = model.cfg.delays[1], prep.n_frames
    out = {}
    for name, kind, p, passes in HISTORIES:
        inputs = batch.inputs
        if kind == "none":
            inputs = inputs.clone()
            inputs[:, 1:] = torch.tensor(none[1:], device=inputs.device).view(1, -1, 1)
        elif kind == "random":
            inputs = corrupt_history(inputs.cpu(), p, none, model.cfg.codebook_size,
                                     torch.Generator().manual_seed(seed)).to(inputs.device)
        elif kind == "own":
            inputs = own_history(model, batch, batch.text_valid, p, torch.Generator().manual_seed(seed), passes)
        pred = model(inputs, enroll, batch.text_ids, batch.text_pos, batch.text_valid)[1][0].argmax(-1)
        tgt, valid = batch.targets[0, 1], batch.valid[0, 1]
        r = {"cb1_hits": int(((pred == tgt) & valid).sum()), "cb1_n": int(valid.sum())}
        if phones is not None and rec.get("phones"):
            r["phone_hits"], r["phone_n"] = phones.hits(rec, pred[d1:d1 + T].cpu().numpy())
        out[name] = r
    return out


# --- 2. synthesis with forcing -------------------------------------------------------------------
@dataclasses.dataclass
class Synth:
    frames: np.ndarray  # [F, K] emitted frames (grapheme first), F = frames before the grapheme EOS
    steps: int


# a codebook-1 rule: (frame, the grapheme row so far, codebook 1's logits [1, V]) -> the
# codes codebook 1 may take at that frame ([V] bool) or a bias on its logits ([V] float),
# or None to leave it free
Cb1Rule = Callable[[int, list, torch.Tensor], Optional[torch.Tensor]]


@torch.inference_mode()
def synthesize(runner, voice, prep: Prepared, mode: str, seed: int, top_k: int = SessionConfig.top_k,
               n_past: int = 4, n_future: int = 2, max_overrun: int = 225,
               cb1_rule: Optional[Cb1Rule] = None, row_forced: Optional[list[int]] = None) -> Synth:
    """Decode one utterance in slot 0 of `runner` (a livespeech.server.runner.ModelRunner), stepping
    the model as ModelRunner.step does (its model step; guidance off), with the forcing
    of `mode` and, for codebook 1, what `cb1_rule` allows or favours (the phone modes). The
    forced graphemes are the ground truth's, or `row_forced` (then EOS)."""
    if mode not in SYNTH_MODES:
        raise ValueError(f"mode must be one of {SYNTH_MODES}")
    model, st = runner.model, runner.state
    runner.admit(0, voice, seed)
    ids, pos = prep.example.text_ids, prep.example.text_pos
    for c in range(len(prep.chunk_tau)):
        js = [j for j, cj in enumerate(prep.token_chunk) if cj == c]
        if js:
            runner.add_chunk(0, [ids[j] for j in js], pos[js[0]], c)
    gt = torch.from_numpy(prep.example.codes)  # [K, T + 1]
    T = prep.n_frames
    force_g, n_ac = FORCING[mode]
    n_ac = model.cfg.n_acoustic_codebooks if n_ac is None else n_ac
    delays = model.cfg.delays
    slot = torch.tensor([0], device=runner.device)
    forced = gt[0, :T + 1].tolist() if row_forced is None else list(row_forced) + [G.EOS]
    frames, row = [], []
    # "bound" modes: the graphemes sampled among guidance's guiding set (lambda inf)
    bound = (GuidanceState(G.collapse_repeats(G.text_to_ids(prep.utt.text)), input_complete=True)
             if mode.startswith("bound") else None)
    for t in range(max(T, len(forced)) + max_overrun + model.cfg.max_delay + 2):
        lo, hi = window(prep.chunk_tau, t, n_past, n_future)
        st.rotate_windows([0], [(lo, hi)])  # the chunks' keys, as the runner's step rotates them
        view = st.view([0])
        mask = st.window_mask(view, [lo], [hi])
        logits = runner.model_step(view.inputs, view.step, view, mask[:, : st.visible_length([0], [lo], [hi])])
        u = runner.uniforms(slot, view.step)  # as the runner's step draws them, grapheme first
        g_logits = logits.graphemes.float()
        if bound is not None and bound.guiding_set():
            keep = torch.zeros(g_logits.shape[-1], dtype=torch.bool)
            keep[bound.guiding_set()] = True
            g_logits = g_logits.masked_fill(~keep.to(g_logits.device), float("-inf"))
        g = sample_top_k(g_logits, [top_k], u[:, :1])
        if bound is not None:
            bound.observe(int(g[0]))
        if force_g:
            g[:] = forced[min(t, len(forced) - 1)]  # frame t; then EOS (later steps: none ids in commit)
        elif t > T + max_overrun:  # the engine's runaway guard (server/session.py EngineSession.must_end)
            g[:] = G.EOS
        row.append(int(g[0]))
        acoustic = logits.acoustic.float()
        allowed = cb1_rule(t - delays[1], row, acoustic[:, 0]) if cb1_rule is not None and t >= delays[1] else None
        if allowed is not None and allowed.dtype != torch.bool:
            acoustic[:, 0] += allowed.to(acoustic.device)  # a bias (the letter schedule's)
        elif allowed is not None and bool(allowed.any()):
            acoustic[:, 0].masked_fill_(~allowed.to(acoustic.device), float("-inf"))
        a = sample_top_k(acoustic, [top_k], u[:, 1:])
        for k in range(1, 1 + n_ac):  # codebook k at step t carries frame t - delay_k
            if 0 <= t - delays[k] < T:
                a[:, k - 1] = int(gt[k, t - delays[k]])
        res = st.commit(view, torch.cat((g.unsqueeze(1), a), dim=1))
        if bool(res.has_frame[0]):
            frames.append(res.frames[0].tolist())
        if bool(res.done[0]):
            break
    k = model.cfg.n_codebooks
    return Synth(np.array(frames, np.int64).reshape(-1, k), t + 1)


def true_phone_rule(allowed: torch.Tensor) -> Cb1Rule:
    """The codes of the phone the corpus's timeline has at the frame (allowed [T, V])."""
    return lambda f, row, logits: allowed[f] if f < len(allowed) else None


def phone_argmax_rule(code_phones: torch.Tensor) -> Cb1Rule:
    """The codes of the phone codebook 1's own distribution gives the most mass."""
    def rule(f, row, logits):
        mass = torch.zeros(logits.shape[0], int(code_phones.max()) + 2)
        mass.scatter_add_(1, (code_phones + 1).expand(logits.shape[0], -1), logits.softmax(-1).cpu())
        mass[:, 0] = 0  # codes that name no phone never win
        return code_phones == mass.argmax(1) - 1
    return rule


def letter_phone_rule(front_end, letters: list[int], engine: int, positions: Optional[list[int]] = None) -> Cb1Rule:
    """The codes of the phone `front_end` (livespeech.models.front_end.FrontEnd) gives the
    letter at the frame: at its true position (`positions`), or where the emitted
    grapheme row has got to in the text (`follow_text`)."""
    def rule(f, row, logits):
        pos = positions[:f + 1] if positions is not None else follow_text(letters, row[:f + 1])
        if not pos or pos[-1] < 0:
            return None
        n = 0
        while n + 1 < len(pos) and pos[-2 - n] == pos[-1]:
            n += 1
        return front_end.code_phones == front_end.phones_of(letters, pos[-1:], [n], engine)[0]
    return rule


def schedule_rule(front_end, schedule) -> Cb1Rule:
    """Codebook 1 given the phone a `LetterSchedule` gives the frame, as the server draws it
    (the front end's `first_code_bias`)."""
    bias = front_end.first_code_bias()
    return lambda f, row, logits: bias[schedule.bias_row(f)] if schedule.bias_row(f) >= 0 else None


def cb1_rule(mode: str, phones: Optional[PhoneTable], rec: dict, prep: Prepared, codebook_size: int,
             front_end=None, schedule=None) -> Optional[Cb1Rule]:
    """The codebook-1 rule of a phone mode (None for the others)."""
    if "phone" not in mode:
        return None
    if mode == "oracle-g+phone":
        return true_phone_rule(phones.allowed_codes(rec, prep.n_frames, codebook_size))
    if mode.endswith("phone-argmax"):
        return phone_argmax_rule(phones.code_phones(codebook_size))
    if mode.startswith("timed"):
        return schedule_rule(front_end, schedule)
    from livespeech.training.dataset import phone_letter_positions

    letters, positions = phone_letter_positions(rec)
    return letter_phone_rule(front_end, letters, front_end.engines.index(rec.get("engine", "espeak")),
                             positions if mode.startswith("oracle-g") else None)


def letter_schedule(front_end, rec: dict, engine: int):
    """The record's words on a `LetterSchedule` laid whole, as the server lays a complete text."""
    from livespeech.models.front_end import LetterSchedule

    schedule = LetterSchedule(front_end, engine)
    for w, _, _ in rec["words"]:
        schedule.add_word(G.word_graphemes(w))
    schedule.lay(0, final=True)
    return schedule


def follow_text(letters: list[int], row: list[int], ahead: int = 3) -> list[int]:
    """Per frame of an emitted grapheme row, the position in `letters` it has reached:
    a frame's letter moves the position to the first of the next `ahead` letters it
    equals, else the position stays (-1 before the first letter and on BLANK/EOS)."""
    out, p = [], -1
    for g in row:
        if g > G.EOS:
            for j in range(max(p, 0), min(len(letters), max(p, 0) + ahead + 1)):
                if letters[j] == g:
                    p = j
                    break
        out.append(p if g > G.EOS else -1)
    return out


def decode_audio(bundle, frames: np.ndarray) -> np.ndarray:
    if len(frames) == 0:
        return np.zeros(0, np.float32)
    codes = torch.from_numpy(np.ascontiguousarray(frames[:, 1:].T)).to(bundle.device)
    with torch.no_grad():
        return bundle.codec.decode(codes.unsqueeze(0))[0, 0].float().cpu().numpy()


def stream_metrics(prep: Prepared, frames: np.ndarray, rec: dict, phones: Optional[PhoneTable]) -> dict:
    """How the emitted frames compare with the ground truth frame by frame (frames past
    either end count as mismatches), the CTC-collapsed grapheme stream's error rate
    against the ground-truth stream's, and (with a phone table) on how many frames the
    emitted codebook-1 code names the phone the ground truth has there."""
    T = prep.n_frames
    gt = prep.example.codes[:, :T]
    n = min(T, len(frames))
    match = (frames[:n].T == gt[:, :n]).sum(1) / max(T, len(frames), 1)
    ref = G.ctc_collapse(gt[0].tolist())
    hyp = G.ctc_collapse(frames[:, 0].tolist()) if len(frames) else []
    out = {"frames": int(len(frames)), "gt_frames": T, "frame_match": [round(float(x), 4) for x in match],
           "graph_stream_errors": edit_distance(ref, hyp), "graph_stream_ref": len(ref)}
    return {**out, **phone_hits(phones, rec, frames[:, 1] if len(frames) else np.zeros(0, np.int64))}


def phone_hits(phones: Optional[PhoneTable], rec: dict, codes: np.ndarray) -> dict:
    if phones is None or not rec.get("phones"):
        return {}
    hit, n = phones.hits(rec, codes)
    return {"cb1_phone_hits": hit, "cb1_phone_frames": n}


# --- report --------------------------------------------------------------------------------------
def summarize(records: list[dict], utterances: list[dict]) -> tuple[list[dict], dict]:
    """Rows of the synthesis table (corpus-level rates, frame matches pooled over frames)
    and the teacher-forced CE / accuracy per codebook pooled over scored positions."""
    rows = []
    for label in [report.GT, report.CODEC] + [MODE_LABELS[m] for m in SYNTH_MODES]:
        recs = [r for r in records if r["system"] == label]
        if not recs:
            continue
        st = report.aggregate(label, recs)
        row = {"label": label, "wer": st.wer, "cer": st.cer, "dur_ratio": st.dur_ratio, "n": st.n}
        sm = [r for r in recs if "frame_match" in r]
        if sm:
            span = np.array([[max(r["frames"], r["gt_frames"])] for r in sm], float)  # frame_match's denominator
            row["frame_match"] = ((np.array([r["frame_match"] for r in sm]) * span).sum(0) / span.sum()).tolist()
            errors, ref = sum(r["graph_stream_errors"] for r in sm), sum(r["graph_stream_ref"] for r in sm)
            row["graph_stream_cer"] = errors / max(1, ref)
        ph = [r for r in recs if "cb1_phone_frames" in r]
        if ph:
            row["cb1_phone"] = sum(r["cb1_phone_hits"] for r in ph) / max(1, sum(r["cb1_phone_frames"] for r in ph))
        rows.append(row)
    tf: dict = {}
    for name in ("full", "window"):
        ce = np.array([u["teacher_forced"][name]["ce"] for u in utterances])
        acc = np.array([u["teacher_forced"][name]["acc"] for u in utterances])
        n = np.array([u["teacher_forced"][name]["n"] for u in utterances], float)
        if len(n):
            tf[name] = {"ce": ((ce * n).sum(0) / n.sum(0)).tolist(), "acc": ((acc * n).sum(0) / n.sum(0)).tolist()}
    hist = {}
    for name, *_ in HISTORIES:
        hs = [u["history"][name] for u in utterances if "history" in u]
        if not hs:
            continue
        total = lambda key: sum(h.get(key, 0) for h in hs)  # noqa: E731
        hist[name] = {"cb1_acc": total("cb1_hits") / max(1, total("cb1_n")),
                      "cb1_phone": total("phone_hits") / total("phone_n") if total("phone_n") else None}
    if hist:
        tf["history"] = hist
    return rows, tf


def render(meta: dict, rows: list[dict], tf: dict, json_path: Path) -> str:
    pct = lambda x: "–" if x is None else f"{100 * x:.1f}"  # noqa: E731
    synth = report.markdown_table(
        ["System", "WER %", "CER %", "grapheme stream CER %", "grapheme frames = GT %", "codebook 1 frames = GT %",
         "codebook 1 names the GT phone %", "dur/GT", "n"],
        [[r["label"], pct(r["wer"]), pct(r["cer"]), pct(r.get("graph_stream_cer")),
          pct(r["frame_match"][0]) if "frame_match" in r else "–",
          pct(r["frame_match"][1]) if "frame_match" in r else "–", pct(r.get("cb1_phone")),
          "–" if r["dur_ratio"] is None or r["label"] == report.GT else f"{r['dur_ratio']:.2f}", str(r["n"])]
         for r in rows])
    k = len(tf.get("full", {}).get("ce", []))
    heads = ["text", "metric", "graphemes"] + [f"cb{i}" for i in range(1, k)] + ["acoustic mean"]
    tf_rows = []
    for name, label in (("full", "fully visible"), ("window", f"np={meta['n_past']}, nf={meta['n_future']} window")):
        if name not in tf:
            continue
        ce, acc = tf[name]["ce"], tf[name]["acc"]
        tf_rows.append([label, "accuracy %"] + [f"{100 * x:.1f}" for x in acc] + [f"{100 * np.mean(acc[1:]):.1f}"])
        tf_rows.append([label, "cross-entropy"] + [f"{x:.3f}" for x in ce] + [f"{np.mean(ce[1:]):.3f}"])
    return "\n".join([
        "# Diagnostic: oracle graphemes",
        "",
        f"Generated by `{meta['command']}` on {meta['date']} ({meta['wall_s']} s; {meta['threads']} thread; "
        f"torch {meta['torch']}; load average {meta['loadavg_start']:.2f} at start, {meta['loadavg_end']:.2f} at end).",
        "",
        f"- Model: `{meta['model']}`",
        f"- Corpus: `{meta['corpus']}` split `{meta['split']}`: {meta['n_utterances']} utterances "
        f"({meta['n_heldout']} of held-out voices), selected and enrolled as `livespeech.training.eval.evaluate` does "
        f"(seed {meta['seed']}); per-utterance sampling seed as there.",
        f"- Text: the manifest's chunks at their ground-truth times, the end-of-text key at the last frame "
        f"(training's layout); np={meta['n_past']}, nf={meta['n_future']} chunk window; top-k {meta['top_k']} for "
        "every codebook, no guidance; EOS forced 3 s past the end key (the engine's runaway guard).",
        f"- WER/CER: {meta['asr']}; normaliser: {meta['normalizer']}; corpus-level.",
        "- grapheme stream CER: edit distance of the CTC-collapsed emitted grapheme stream to the collapsed "
        "ground-truth stream; `= GT %`: emitted frames equal to the ground truth's frame by frame "
        "(frames past either end count as mismatches).",
        "- codebook 1 names the GT phone: frames whose codebook-1 code stands for (majority over 300 train "
        "utterances, livespeech.training.phones.PhoneTable) the phone the corpus's timeline has at that frame; the ground "
        "truth's row is its own codec codes, the most a decoder can reach with this table.",
        f"- Per-utterance numbers: `{json_path}`.",
        "",
        "## Synthesis",
        "",
        synth,
        "",
        "## Teacher forcing (model.forward, training's inputs and targets)",
        "",
        "Per codebook, averaged over every scored position of the utterances.",
        "",
        report.markdown_table(heads, tf_rows),
        "",
        "## Codebook 1 and the acoustic history it reads back (teacher forcing, text fully visible)",
        "",
        "The acoustic codes of the previous frames as the input: true, 30 % of the steps random "
        "(livespeech.training.train `corrupt_history`), 30 % or all of the steps the model's own samples "
        "from a teacher-forced pass (`own_history`), all of them its own samples after 4 or 16 passes (each "
        "pass reads back the one before: errors compounded over that many steps), or none (every acoustic "
        "input the empty id).",
        "",
        report.markdown_table(["acoustic history", "codebook 1 accuracy %", "codebook 1 names the GT phone %"],
                              [[name, pct(h["cb1_acc"]), pct(h["cb1_phone"])]
                               for name, h in tf.get("history", {}).items()]),
        "",
    ])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m livespeech.training.eval.diagnose", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default="data/corpus")
    p.add_argument("--model", default="default", help="model directory, 'default' or 'random:<preset>'")
    p.add_argument("--out", default="docs/eval-runs/oracle-graphemes.md")
    p.add_argument("--limit", type=int, default=20, help="test utterances (livespeech.training.eval.evaluate's selection)")
    p.add_argument("--split", default="test")
    p.add_argument("--seed", type=int, default=0, help="as livespeech.training.eval.evaluate --seed")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma list of {','.join(SYNTH_MODES)}")
    p.add_argument("--top-k", type=int, default=SessionConfig.top_k, help="the server's default (SessionConfig.top_k)")
    p.add_argument("--n-past", type=int, default=4)
    p.add_argument("--n-future", type=int, default=2)
    p.add_argument("--asr", choices=("tiny.en", "base", "none"), default="base")
    p.add_argument("--threads", type=int, default=1, help="torch and ASR threads")
    p.add_argument("--save-audio", default=None, help="folder for the WAVs")
    p.add_argument("--front-end", default=None,
                   help="a front_end.pt (livespeech.models.front_end; the letter-phone and timed modes)")
    p.add_argument("--letters", choices=("even", "phones"), default="even",
                   help="the grapheme row the model was trained on (livespeech.training.train --letters): the "
                        "teacher-forced targets and the oracle graphemes")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    torch.set_num_threads(max(1, a.threads))
    t_start, load_start = time.time(), os.getloadavg()[0]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in modes:
        if m not in SYNTH_MODES:
            print(f"unknown mode {m!r}", file=sys.stderr)
            return 2
    log = lambda *x: print(*x, file=sys.stderr, flush=True)  # noqa: E731

    from livespeech.models.loading import load_bundle, write_wav
    from livespeech.server.runner import ModelRunner

    corpus = Path(a.corpus)
    rows = read_manifest(str(corpus))
    utts = select_utterances(rows, corpus, a.limit or None, a.split, a.seed)
    info = model_info(a.model)
    bundle = load_bundle(None if a.model == "default" else a.model)
    model = bundle.model.eval()
    backends = make_backends({"sim", "mos"} | ({"asr"} if a.asr == "none" else set()),
                             asr_model="base" if a.asr == "none" else a.asr, threads=a.threads)
    normalizer = get_normalizer()
    scorer = Scorer(backends, normalizer, {})
    runner = ModelRunner(bundle, capacity=1)
    save = Path(a.save_audio) if a.save_audio else None
    if save:
        save.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory() as tmp:
        preps = prepare(bundle, rows, utts, tmp, a.letters)
    by_id = {r["id"]: r for r in rows}
    front_end = None
    if any("letter-phone" in m or m == "timed" for m in modes):
        from livespeech.models.front_end import FrontEnd

        front_end = FrontEnd.load(a.front_end)
    # with a front end, the corpus's frames are named with its phones, so that both read
    # one inventory however few voices the corpus has
    phones = (PhoneTable.fit(bundle.codec, str(corpus), rows, device=bundle.device,
                             vocab=PhoneVocab(front_end.phone_names) if front_end is not None else None)
              if any(r.get("phones") for r in rows) else None)
    if phones is None and any("phone" in m for m in modes):
        log("the phone modes need a corpus with phone timelines (manifest 'phones')")
        return 2
    log(f"diagnose: {len(preps)} of {len(utts)} utterances, modes {modes}")
    records: list[dict] = []
    utt_out: list[dict] = []
    for i, p in enumerate(preps):
        t0 = time.time()
        u = p.utt
        tf = teacher_forced(model, p, a.n_past, a.n_future)
        seed = (zlib.crc32(u.id.encode()) + a.seed) % (2**31)
        utt_out.append({"utt": u.id, "voice": u.voice, "heldout_voice": u.heldout, "enrollment": u.enroll_id,
                        "text": u.text, "frames": p.n_frames, "teacher_forced": tf,
                        "history": history_reliance(model, p, phones, by_id[u.id], seed)})
        base = dict(utt=u.id, heldout_voice=u.heldout)
        gt = read_audio(u.audio)
        base["ref_duration_s"] = len(gt) / SR
        rec_u = by_id[u.id]
        audios = [(report.GT, gt, phone_hits(phones, rec_u, p.example.codes[1, :p.n_frames])),
                  (report.CODEC, codec_resynthesis(bundle, gt)[0], {})]
        enroll_audio = read_audio(u.enroll_audio)
        voice = runner.make_voice(u.enroll_id, enroll_audio, SR)
        # the engine the server gives this voice (`FrontEnd.voice_engine`), from --front-end's table
        engine = (front_end.voice_engine(bundle.encode_audio(enroll_audio, SR)[0])
                  if any(m.startswith("timed") for m in modes) else None)
        for m in modes:
            t1 = time.perf_counter()
            schedule = letter_schedule(front_end, rec_u, engine) if m.startswith("timed") else None
            s = synthesize(runner, voice, p, m, seed, a.top_k, a.n_past, a.n_future,
                           cb1_rule=cb1_rule(m, phones, rec_u, p, model.cfg.codebook_size, front_end, schedule),
                           row_forced=None if schedule is None else schedule.graphemes)
            dt = time.perf_counter() - t1
            audios.append((MODE_LABELS[m], decode_audio(bundle, s.frames),
                           {**stream_metrics(p, s.frames, rec_u, phones), "steps": s.steps, "compute_s": round(dt, 3),
                            "seed": seed}))
        for label, audio, extra in audios:
            rec = {**base, "system": label, "audio_s": len(audio) / SR, **extra}
            if audio.size:
                rec.update(scorer.score(audio, u))
            elif backends["asr"].available():
                c = error_counts(u.text, "", normalizer)
                rec.update(hyp="", word_errors=c.word_errors, ref_words=c.ref_words, char_errors=c.char_errors,
                           ref_chars=c.ref_chars, wer=round(c.wer, 4))
            records.append(rec)
            if save and audio.size:
                write_wav(save / f"{u.id}_{label.replace(' ', '_')}.wav", audio, SR)
        log(f"[{i + 1}/{len(preps)}] {u.id} ({time.time() - t0:.0f} s): "
            + ", ".join(f"{r['system']} wer {100 * r['wer']:.0f}" for r in records if r["utt"] == u.id and "wer" in r)
            + f"; teacher-forced acc g {tf['full']['acc'][0]:.2f} cb1 {tf['full']['acc'][1]:.2f}")

    summary, tf_summary = summarize(records, utt_out)
    meta = dict(
        command="python -m livespeech.training.eval.diagnose " + " ".join(shlex.quote(x) for x in argv),
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        model=bundle.source + ("" if not info else " (" + ", ".join(f"{k} {v}" for k, v in info.items()) + ")"),
        corpus=str(corpus), split=a.split, seed=a.seed, n_utterances=len(preps),
        n_heldout=sum(p.utt.heldout for p in preps), modes=modes, top_k=a.top_k, n_past=a.n_past,
        n_future=a.n_future, asr=backends["asr"].description if backends["asr"].available() else backends["asr"].reason,
        normalizer=normalizer.name, threads=a.threads, torch=torch.__version__,
        loadavg_start=load_start, loadavg_end=os.getloadavg()[0], wall_s=round(time.time() - t_start, 1),
    )
    out = Path(a.out)
    json_path = out.with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(meta, summary, tf_summary, json_path))
    with open(json_path, "w") as f:
        json.dump({"meta": meta, "summary": summary, "teacher_forced": tf_summary,
                   "utterances": utt_out, "records": records}, f, indent=1, default=_json_default)
    log(f"wrote {out} and {json_path} in {meta['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
