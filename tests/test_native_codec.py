"""The codec decoder's step as one native call (models/native/codec.cpp, `NativeCodecStep`).

Decoding in pieces equals decoding whole, for both presets and an odd layout (other
widths, dilation 3, identity shortcuts, no LSTM, reflect padding, whose first packets
torch decodes) at any packet sizes; sessions joining and leaving a batch each get their
own whole decode, and so does every session of a batch of several of the LSTM's row
blocks; a code outside its codebook fails the call and leaves the streams' state as it
was; a decoder of another layout is refused when the step is built.
"""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from livespeech.models.codec import StreamState
from livespeech.models.native_step import native_module
from livespeech.models.step_graph import NativeCodecStep
from tests.test_codec import _one_thread  # noqa: F401 - autouse: one torch thread, as there
from tests.test_codec import N_FRAMES, PRESET_NAMES, TOL, model_for, random_codes, schedule

pytestmark = pytest.mark.skipif(native_module() is None, reason="the native CPU code cannot be built here")

NAMES = [*PRESET_NAMES, "odd"]


def _native(name: str) -> tuple:
    model = model_for(name)
    return model, NativeCodecStep(model, n_codebooks=model.config.n_q)


@pytest.mark.parametrize("name", NAMES)
def test_native_pieces_equal_the_whole_decode(name):
    model, step = _native(name)
    codes = random_codes(model, 2, N_FRAMES)
    with torch.inference_mode():
        whole = model.decode(codes)
        assert whole.abs().max() > 1e-2  # a real signal, so the tolerance means something
        rng = random.Random(0)
        schedules = [schedule(model, size) for size in (1, 2, 3, 6, 9, 15)]
        sizes = [max(rng.randint(1, 15), model.min_first_frames)]
        while sum(sizes) < N_FRAMES:
            sizes.append(rng.randint(1, 15))
        schedules.append(sizes)
        for sizes in schedules:
            state, out, pos = model.streaming_state(2), [], 0
            for size in sizes:
                out.append(step(codes[..., pos: pos + size], state))
                pos += out[-1].shape[-1] // model.hop_length
            err = (torch.cat(out, -1) - whole).abs().max().item()
            assert err < TOL, (sizes[:4], err)
            assert int(state.frames[0]) == N_FRAMES


@pytest.mark.parametrize("name", NAMES)
def test_native_sessions_join_and_leave_with_their_own_audio(name):
    """A and B start together; C joins (its first packet in a batch of its own, then its
    state joins theirs); A leaves; every session's audio equals its own whole decode."""
    model, step = _native(name)
    first = model.min_first_frames
    streams = {s: random_codes(model, 1, 40, seed=i + 10) for i, s in enumerate("ABC")}
    pos, audio = dict.fromkeys("ABC", 0), {s: [] for s in "ABC"}

    def run(state: StreamState, sessions: str, frames: int) -> None:
        codes = torch.cat([streams[s][..., pos[s]: pos[s] + frames] for s in sessions])
        wav = step(codes, state)
        for i, s in enumerate(sessions):
            audio[s].append(wav[i: i + 1])
            pos[s] += frames

    with torch.inference_mode():
        ab = model.streaming_state(2)
        run(ab, "AB", first)
        c = model.streaming_state(1)
        run(c, "C", first)
        abc = StreamState.cat([ab, c])
        run(abc, "ABC", 4)
        bc = abc.select([1, 2])
        run(bc, "BC", 5)
        run(abc.select([0]), "A", 3)
        for s in "ABC":
            got = torch.cat(audio[s], -1)
            want = model.decode(streams[s][..., : pos[s]])
            assert (got - want).abs().max().item() < TOL, s


@pytest.mark.parametrize("batch", [7, 13])
def test_native_batches_of_several_row_blocks_decode_each_session_as_whole(batch):
    """The LSTM's recurrent product takes sessions in blocks of 6 rows: a batch of two
    blocks and one over (and of one and one over) decodes every session as its whole
    decode does."""
    model, step = _native("small")
    codes = random_codes(model, batch, 24, seed=batch)
    with torch.inference_mode():
        state, out, pos = model.streaming_state(batch), [], 0
        for size in schedule(model, 5, total=24):
            out.append(step(codes[..., pos: pos + size], state))
            pos += size
        got = torch.cat(out, -1)
        for s in range(batch):
            want = model.decode(codes[s: s + 1, :, :pos])
            # a tenth of TOL: the random LSTM's recurrent part moves this output by ~6e-5
            assert (got[s: s + 1] - want).abs().max().item() < TOL / 10, s


def test_native_refuses_a_code_outside_its_codebook_and_keeps_the_state():
    model, step = _native("small")
    state = model.streaming_state(2)
    with torch.inference_mode():
        step(random_codes(model, 2, 3), state)
        before = [t.clone() for t in state.tensors]
        bad = random_codes(model, 2, 2)
        bad[1, 3, 1] = model.config.codebook_size
        with pytest.raises(RuntimeError, match="a code outside its codebook"):
            step(bad, state)
    assert all(torch.equal(a, b) for a, b in zip(before, state.tensors))
    assert int(state.frames[0]) == 3


def test_native_step_refuses_a_decoder_of_another_layout():
    model = model_for("small")
    layers = list(model.decoder.model)
    odd = type(model.decoder)(model.config)
    odd.model = nn.Sequential(*layers[:2], nn.Tanh(), *layers[2:])
    model_copy = type(model)(model.config)
    model_copy.decoder = odd
    with pytest.raises(NotImplementedError, match="Tanh"):
        NativeCodecStep(model_copy, n_codebooks=8)
