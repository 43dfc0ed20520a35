"""Parity with the official `encodec` package (0.1.1), where it can be imported.

encodec imports torchaudio at module level (only its file I/O uses it) and no
torchaudio loads next to this CPU torch, so a dummy module stands in for the import.
Install for this test: pip install --no-deps encodec==0.1.1 einops
"""
from __future__ import annotations

import sys
import types
import warnings
from unittest import mock

import pytest
import torch

from livespeech.models.codec import CodecConfig, CodecModel


def _import_encodec():
    pytest.importorskip("einops")
    with mock.patch.dict(sys.modules):
        sys.modules.setdefault("torchaudio", types.ModuleType("torchaudio"))
        return pytest.importorskip("encodec", exc_type=ImportError)


@pytest.fixture(scope="module")
def pair():
    encodec = _import_encodec()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # encodec uses the deprecated weight_norm
        ref = encodec.EncodecModel.encodec_model_24khz(pretrained=False)
    # Its codebooks stay zero until a training forward runs k-means: fill them instead.
    for layer in ref.quantizer.vq.layers:
        cb = layer._codebook
        cb.inited.fill_(1.0)
        cb.embed.normal_()
        cb.embed_avg.copy_(cb.embed)
    ours = CodecModel(CodecConfig.encodec_24khz()).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    yield ref.eval(), ours
    torch.set_num_threads(threads)


def test_checkpoint_loads_both_ways(pair):
    ref, ours = pair
    ref.load_state_dict(ours.state_dict(), strict=True)  # our checkpoints export too


@pytest.mark.parametrize("n_q, bandwidth", [(32, None), (8, 6.0)])
def test_encode_and_decode_match(pair, n_q, bandwidth):
    ref, ours = pair
    ref.bandwidth = bandwidth
    wav = 0.1 * torch.randn(2, 1, 12_345)  # not a multiple of the hop: exercises end padding
    with torch.no_grad():
        (ref_codes, scale), = ref.encode(wav)
        ref_wav = ref.decode([(ref_codes, scale)])
    codes = ours.encode(wav, n_q=n_q)
    assert scale is None and codes.shape == ref_codes.shape == (2, n_q, 39)
    assert torch.equal(codes, ref_codes)
    out = ours.decode(codes)
    assert out.shape == ref_wav.shape
    assert (out - ref_wav).abs().max().item() < 1e-5
    assert ref_wav.abs().max() > 1e-2

    state = ours.streaming_state(2)
    packets = [ours.decode_step(codes[..., i: i + 8], state) for i in range(0, codes.shape[-1], 8)]
    assert (torch.cat(packets, -1) - ref_wav).abs().max().item() < 1e-4
