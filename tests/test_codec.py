"""Codec runtime: shapes, exact streaming decode, session batching, official key names,
checkpoints and the training hooks. Random weights throughout (no downloads)."""
from __future__ import annotations

import random
import sys
import types
import warnings
from unittest import mock

import pytest
import torch

from livespeech.models.codec import CodecConfig, CodecModel, StreamState, preset
from livespeech.models.codec.quantization import kmeans

PRESET_NAMES = ("small", "encodec_24khz")
# the other options the streaming decoder must handle: odd ratios, no LSTM, no weight
# norm, identity shortcuts, two residual layers with dilation 3, reflect padding
ODD = dict(ratios=(4, 3), n_filters=8, n_residual_layers=2, dilation_base=3, true_skip=True,
           norm="none", lstm_layers=0, pad_mode="reflect", n_codebooks=2, n_q=2)
N_FRAMES = 60
TOL = 1e-4


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_model(name: str, seed: int = 0, **overrides) -> CodecModel:
    """Random weights and random (initialised) codebooks: zero codebooks, the state
    before k-means, would decode every code to the same latent."""
    torch.manual_seed(seed)
    model = CodecModel(preset(name, **overrides)).eval()
    for layer in model.quantizer.vq.layers:
        cb = layer._codebook
        cb.inited.fill_(1.0)
        cb.embed.normal_()
        cb.embed_avg.copy_(cb.embed)
    return model


_MODELS: dict[str, CodecModel] = {}


def model_for(name: str) -> CodecModel:
    if name not in _MODELS:
        _MODELS[name] = random_model("small", **ODD) if name == "odd" else random_model(name)
    return _MODELS[name]


def random_codes(model: CodecModel, batch: int, frames: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.codebook_size, (batch, model.config.n_q, frames), generator=g)


def stream(model: CodecModel, codes: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    state = model.streaming_state(codes.shape[0])
    out, pos = [], 0
    for size in sizes:
        chunk = codes[..., pos: pos + size]
        pos += chunk.shape[-1]
        wav = model.decode_step(chunk, state)
        assert wav.shape == (codes.shape[0], 1, chunk.shape[-1] * model.hop_length)
        out.append(wav)
    assert pos == codes.shape[-1] and int(state.frames[0]) == pos
    return torch.cat(out, dim=-1)


def schedule(model: CodecModel, size: int, total: int = N_FRAMES) -> list[int]:
    first = max(size, model.min_first_frames)
    return [first] + [size] * -(-(total - first) // size)


# ---------------------------------------------------------------- config and shapes

@pytest.mark.parametrize("name", PRESET_NAMES)
def test_shapes_and_frame_rate(name):
    model = model_for(name)
    cfg = model.config
    assert (cfg.hop_length, cfg.frame_rate, cfg.sample_rate) == (320, 75.0, 24_000)
    wav = 0.1 * torch.randn(2, 1, 24_000 // 4 + 17)
    codes = model.encode(wav)
    assert codes.shape == (2, cfg.n_q, -(-wav.shape[-1] // 320)) and codes.dtype == torch.long
    assert 0 <= int(codes.min()) and int(codes.max()) < cfg.codebook_size
    out = model.decode(codes)
    assert out.shape == (2, 1, codes.shape[-1] * 320) and torch.isfinite(out).all()
    assert model.encode(wav, n_q=2).shape[1] == 2
    assert model.decode(codes[:, :3]).shape == out.shape  # fewer codebooks decode too


def test_presets_and_validation():
    official, small = CodecConfig.encodec_24khz(), CodecConfig.small()
    assert (official.n_filters, official.n_codebooks, official.pad_mode, official.norm) == (
        32, 32, "reflect", "weight_norm")
    assert (small.n_filters, small.n_q, small.pad_mode, small.causal) == (16, 8, "constant", True)
    assert CodecConfig.encodec_24khz(n_q=8).n_q == 8
    assert CodecConfig.from_dict(small.to_dict()) == small
    for bad in ({"n_q": 33}, {"pad_mode": "zeros"}, {"norm": "time_group_norm"}, {"channels": 2},
                {"codebook_size": 1000}, {"ratios": ()}):
        with pytest.raises(ValueError):
            CodecConfig.encodec_24khz(**bad)
    with pytest.raises(ValueError):
        CodecConfig.from_dict({"n_filters": 8, "bogus": 1})
    assert model_for("encodec_24khz").min_first_frames == 7
    assert model_for("small").min_first_frames == 1
    assert model_for("odd").min_first_frames == 7


# ---------------------------------------------------------------- streaming decoder

@pytest.mark.parametrize("name", [*PRESET_NAMES, "odd"])
def test_streaming_equals_whole_decode(name):
    model = model_for(name)
    codes = random_codes(model, 2, N_FRAMES)
    whole = model.decode(codes)
    assert whole.abs().max() > 1e-2  # a real signal, so the tolerance means something
    rng = random.Random(0)
    schedules = [schedule(model, size) for size in range(1, 16)]
    for _ in range(3):
        sizes = [max(rng.randint(1, 15), model.min_first_frames)]
        while sum(sizes) < N_FRAMES:
            sizes.append(rng.randint(1, 15))
        schedules.append(sizes)
    for sizes in schedules:
        err = (stream(model, codes, sizes) - whole).abs().max().item()
        assert err < TOL, (sizes[:4], err)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_stateless_packets_would_differ(name):
    """Control: decoding packets independently (no carried state) is audibly wrong, so
    the equality above really tests the state."""
    model = model_for(name)
    codes = random_codes(model, 1, 28)
    pieces = [model.decode(codes[..., i: i + 7]) for i in range(0, 28, 7)]
    assert (torch.cat(pieces, -1) - model.decode(codes)).abs().max() > 1e-3


def test_reflect_first_packet_minimum():
    model = model_for("encodec_24khz")
    codes = random_codes(model, 2, 10)
    with pytest.raises(ValueError, match=">= 7 frames"):
        model.decode_step(codes[..., :6], model.streaming_state(2))
    state = model.streaming_state(2)
    model.decode_step(codes[..., :7], state)
    assert model.decode_step(codes[..., 7:8], state).shape[-1] == 320  # later packets: any size
    joined = StreamState.cat([state, model.streaming_state(1)])
    with pytest.raises(ValueError):  # a new session in the batch needs the minimum again
        model.decode_step(random_codes(model, 3, 2), joined)


@pytest.mark.parametrize("name", [*PRESET_NAMES, "odd"])
def test_batched_sessions_join_and_leave(name):
    """Sessions A-D with their own code streams: C joins after its first packet, D
    joins fresh inside a batch step, a sub-batch steps alone, A leaves. Every session's
    audio must equal its own whole decode."""
    model = model_for(name)
    first = model.min_first_frames
    streams = {s: random_codes(model, 1, 40, seed=i + 10) for i, s in enumerate("ABCD")}
    pos = {s: 0 for s in "ABCD"}
    audio = {s: [] for s in "ABCD"}

    def step(state: StreamState, sessions: str, frames: int) -> None:
        codes = torch.cat([streams[s][..., pos[s]: pos[s] + frames] for s in sessions])
        wav = model.decode_step(codes, state)
        for i, s in enumerate(sessions):
            audio[s].append(wav[i: i + 1])
            pos[s] += frames

    state = model.streaming_state(2)
    step(state, "AB", first)
    joining = model.streaming_state(1)
    step(joining, "C", max(first, 3))  # C's first packet, decoded alone
    state = StreamState.cat([state, joining])
    step(state, "ABC", 4)
    state = StreamState.cat([state, model.streaming_state(1)])  # D: first packet in the batch
    step(state, "ABCD", max(first, 2))
    sub = state.select([0, 2])  # A and C step without B and D
    step(sub, "AC", 5)
    state.update([0, 2], sub)
    state = state.select([1, 2, 3])  # A leaves
    step(state, "BCD", 2)
    step(state, "BCD", 11)
    assert state.frames.tolist() == [pos["B"], pos["C"], pos["D"]]
    for s in "ABCD":
        got = torch.cat(audio[s], -1)
        want = model.decode(streams[s][..., : pos[s]])
        assert got.shape == want.shape and (got - want).abs().max().item() < TOL, s


# ---------------------------------------------------------------- official key names

# encodec 0.1.1, EncodecModel.encodec_model_24khz(): conv prefix -> weight_v shape.
# Each also has weight_g (out/in-channel norms, [dim0, 1, 1]) and a bias.
OFFICIAL_CONVS = {
    "encoder.model.0.conv.conv": (32, 1, 7),
    "encoder.model.1.block.1.conv.conv": (16, 32, 3),
    "encoder.model.1.block.3.conv.conv": (32, 16, 1),
    "encoder.model.1.shortcut.conv.conv": (32, 32, 1),
    "encoder.model.3.conv.conv": (64, 32, 4),
    "encoder.model.4.block.1.conv.conv": (32, 64, 3),
    "encoder.model.4.block.3.conv.conv": (64, 32, 1),
    "encoder.model.4.shortcut.conv.conv": (64, 64, 1),
    "encoder.model.6.conv.conv": (128, 64, 8),
    "encoder.model.7.block.1.conv.conv": (64, 128, 3),
    "encoder.model.7.block.3.conv.conv": (128, 64, 1),
    "encoder.model.7.shortcut.conv.conv": (128, 128, 1),
    "encoder.model.9.conv.conv": (256, 128, 10),
    "encoder.model.10.block.1.conv.conv": (128, 256, 3),
    "encoder.model.10.block.3.conv.conv": (256, 128, 1),
    "encoder.model.10.shortcut.conv.conv": (256, 256, 1),
    "encoder.model.12.conv.conv": (512, 256, 16),
    "encoder.model.15.conv.conv": (128, 512, 7),
    "decoder.model.0.conv.conv": (512, 128, 7),
    "decoder.model.3.convtr.convtr": (512, 256, 16),
    "decoder.model.4.block.1.conv.conv": (128, 256, 3),
    "decoder.model.4.block.3.conv.conv": (256, 128, 1),
    "decoder.model.4.shortcut.conv.conv": (256, 256, 1),
    "decoder.model.6.convtr.convtr": (256, 128, 10),
    "decoder.model.7.block.1.conv.conv": (64, 128, 3),
    "decoder.model.7.block.3.conv.conv": (128, 64, 1),
    "decoder.model.7.shortcut.conv.conv": (128, 128, 1),
    "decoder.model.9.convtr.convtr": (128, 64, 8),
    "decoder.model.10.block.1.conv.conv": (32, 64, 3),
    "decoder.model.10.block.3.conv.conv": (64, 32, 1),
    "decoder.model.10.shortcut.conv.conv": (64, 64, 1),
    "decoder.model.12.convtr.convtr": (64, 32, 4),
    "decoder.model.13.block.1.conv.conv": (16, 32, 3),
    "decoder.model.13.block.3.conv.conv": (32, 16, 1),
    "decoder.model.13.shortcut.conv.conv": (32, 32, 1),
    "decoder.model.15.conv.conv": (1, 32, 7),
}
OFFICIAL_LSTMS = ("encoder.model.13.lstm", "decoder.model.1.lstm")  # 2 layers, width 512


def stored_official_shapes() -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for prefix, v in OFFICIAL_CONVS.items():
        out_channels = v[1] if prefix.endswith("convtr") else v[0]
        shapes.update({f"{prefix}.weight_v": v, f"{prefix}.weight_g": (v[0], 1, 1),
                       f"{prefix}.bias": (out_channels,)})
    for prefix in OFFICIAL_LSTMS:
        for layer in range(2):
            shapes.update({f"{prefix}.weight_ih_l{layer}": (2048, 512),
                           f"{prefix}.weight_hh_l{layer}": (2048, 512),
                           f"{prefix}.bias_ih_l{layer}": (2048,), f"{prefix}.bias_hh_l{layer}": (2048,)})
    for q in range(32):
        p = f"quantizer.vq.layers.{q}._codebook"
        shapes.update({f"{p}.inited": (1,), f"{p}.cluster_size": (1024,),
                       f"{p}.embed": (1024, 128), f"{p}.embed_avg": (1024, 128)})
    return shapes


def encodec_official_shapes() -> dict[str, tuple[int, ...]] | None:
    """From the encodec package when it imports (torchaudio, used only for file I/O,
    is stubbed for the import), else None."""
    with mock.patch.dict(sys.modules):
        sys.modules.setdefault("torchaudio", types.ModuleType("torchaudio"))
        try:
            from encodec import EncodecModel
        except ImportError:
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # its deprecated torch weight_norm
            ref = EncodecModel.encodec_model_24khz(pretrained=False)
    return {k: tuple(v.shape) for k, v in ref.state_dict().items()}


def test_state_dict_keys_match_official():
    ours = {k: tuple(v.shape) for k, v in model_for("encodec_24khz").state_dict().items()}
    stored = stored_official_shapes()
    assert ours == stored
    from_package = encodec_official_shapes()
    if from_package is not None:
        assert from_package == stored


# ---------------------------------------------------------------- checkpoints

def test_save_load_round_trip(tmp_path):
    model = random_model("small", seed=3)
    codes = random_codes(model, 1, 12)
    path = tmp_path / "codec.pt"
    model.save(path)
    loaded = CodecModel.from_checkpoint(path)
    assert loaded.config == model.config and not loaded.training
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert torch.equal(loaded.decode(codes), model.decode(codes))
    fewer = CodecModel.from_checkpoint(path, config=CodecConfig.small(n_q=4))
    assert fewer.encode(torch.zeros(1, 1, 640)).shape[1] == 4

    bare = tmp_path / "bare.th"  # like the official encodec_24khz-d7cc33bc.th
    torch.save(model.state_dict(), bare)
    with pytest.raises(ValueError, match="config"):
        CodecModel.from_checkpoint(bare)
    assert torch.equal(CodecModel.from_checkpoint(bare, config="small").decode(codes), model.decode(codes))


# ---------------------------------------------------------------- training hooks

def test_train_losses_and_codebook_learning():
    torch.manual_seed(0)
    model = CodecModel(preset("small", kmeans_iters=2)).train()
    cb = model.quantizer.vq.layers[0]._codebook
    assert float(cb.inited) == 0.0 and cb.embed.abs().sum() == 0
    wav = 0.1 * torch.randn(2, 1, 2400)
    losses = model.train_losses(wav)
    assert set(losses) == {"total", "l1", "stft", "mel", "commit"}
    assert all(torch.isfinite(v) and v.dim() == 0 for v in losses.values())
    assert float(cb.inited) == 1.0 and cb.embed.abs().sum() > 0  # k-means initialised
    losses["total"].backward()
    # the straight-through estimator carries gradients past the quantizer to the encoder
    assert model.encoder.model[0].conv.conv.weight_v.grad.abs().sum() > 0
    assert model.decoder.model[0].conv.conv.weight_g.grad.abs().sum() > 0
    before = cb.embed.clone()
    model.train_losses(wav)
    assert not torch.equal(before, cb.embed)  # EMA update
    model.eval()
    assert model.train_losses(wav)["commit"] == 0  # no codebook updates, no commitment in eval


def test_kmeans_recovers_separated_clusters():
    torch.manual_seed(0)
    centers = torch.tensor([[5.0, 0.0], [-5.0, 0.0], [0.0, 5.0]])
    samples = (centers[:, None] + 0.1 * torch.randn(3, 50, 2)).reshape(-1, 2)
    found = None
    for _ in range(5):  # a random start can put two means in one cluster; retry
        means, counts = kmeans(samples, 3, num_iters=10)
        if sorted(counts.tolist()) == [50, 50, 50]:
            found = means
            break
    assert found is not None
    assert torch.cdist(found, centers).min(dim=0).values.max() < 0.1


def test_quantizer_forward_matches_encode_decode():
    quantizer = model_for("small").quantizer
    z = torch.randn(2, 128, 9)
    quantized, codes, commit = quantizer(z)
    assert torch.equal(codes, quantizer.encode(z)) and commit == 0
    assert torch.allclose(quantized, quantizer.decode(codes), atol=1e-6)


def test_streaming_elu_equals_elu_across_its_pieces():
    """The streaming decoder's ELU (cheap passes over cache-sized pieces) equals F.elu,
    below its size threshold, across piece boundaries and in a partial last piece."""
    from livespeech.models.codec.modules import _ELU_PIECE, _elu

    g = torch.Generator().manual_seed(0)
    for n in (1000, 40_000, 2 * _ELU_PIECE + 12_345):
        x = torch.randn(n, generator=g) * 3
        torch.testing.assert_close(_elu(x), torch.nn.functional.elu(x), atol=1e-6, rtol=1e-6)
    x = torch.randn(4, 16, 1920, generator=g)
    assert torch.equal(_elu(x.transpose(1, 2)), torch.nn.functional.elu(x.transpose(1, 2)))  # strided: F.elu itself
