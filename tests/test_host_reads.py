"""An engine step reads the device back once (the new frame's tokens of all sessions),
and copies its host-side inputs to it once, whatever the batch: on a GPU each read, and
each copy from pageable host memory, waits for the queued kernels
(livespeech.loadtest.host_reads counts them; issue: capacity on GPUs)."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import random_bundle
from livespeech.loadtest.host_reads import HostReads, engine_step_reads
from livespeech.models import cpu_sampler, inference


@pytest.fixture(autouse=True)
def tensor_sampling_and_commit(monkeypatch):
    """The sampling and commit as the tensor work a GPU runs, whose reads are counted:
    on the CPU each is otherwise one native call, with no device to read."""
    monkeypatch.setattr(cpu_sampler, "native_module", lambda: None)
    monkeypatch.setattr(inference, "native_module", lambda: None)


def test_the_counter_counts_what_hands_data_to_python() -> None:
    x = torch.arange(6)
    with HostReads() as reads:
        y = x * 2  # device work only
        z = torch.where(y > 3, y, 0)
        assert reads.total == 0
        z.sum().item()
        z.tolist()
        bool(z.any())
        z.nonzero()
        with reads.paused():
            z[0].item()
    assert reads.total == 4 and sum(reads.sites.values()) == 4
    assert reads.uploads == 0
    with HostReads() as reads:
        torch.tensor([1, 2], device=x.device)
        x.to(x.device)
        x.to(torch.float32)  # a cast, not a copy from the host
        torch.tensor([1, 2])  # stays on the host
    assert reads.uploads == 2 and reads.total == 0


@pytest.mark.parametrize("batch, guidance_lambda, device_guidance, cuda_graphs",
                         [(1, 1.0, False, False), (32, 1.0, False, False), (32, math.inf, False, False),
                          (1, 1.0, True, False), (32, 1.0, True, False), (1, 1.0, True, True), (32, 1.0, True, True),
                          (32, 1.0, False, True)])
def test_an_engine_step_reads_the_device_once(batch: int, guidance_lambda: float, device_guidance: bool,
                                              cuda_graphs: bool) -> None:
    """`cuda_graphs`: the step recorded with its sampling and commit (eagerly here)."""
    r = engine_step_reads(random_bundle(), batch, steps=25, warmup=5, guidance_lambda=guidance_lambda,
                          device_guidance=device_guidance, cuda_graphs=cuda_graphs)
    assert r["steps"] == 25
    assert r["step"] == [1] * 25, r["sites_per_step"]
    # and its host-side inputs go to the device in one copy (on a GPU a copy from pageable
    # host memory waits for the queued kernels as a read does)
    assert r["uploads"] == [1] * 25, r["upload_sites_per_step"]


def test_an_upload_hands_back_each_part_as_staged() -> None:
    """Flags, ids and float32 values come back exact, in their dtype and shape, from one copy."""
    from livespeech.models.upload import Upload

    up = Upload()
    ids = up.add([0, 51865, 3], torch.long)
    flags = up.add([True, False, True, True], torch.bool, (2, 2))
    temps = up.add([1 / 3, 0.7], torch.float32)
    empty = up.add([], torch.long)
    with HostReads() as reads:
        sent = up.send(torch.device("cpu"))
    assert reads.uploads == 1
    assert sent[ids].dtype == torch.long and sent[ids].tolist() == [0, 51865, 3]
    assert sent[flags].dtype == torch.bool and sent[flags].tolist() == [[True, False], [True, True]]
    assert torch.equal(sent[temps], torch.tensor([1 / 3, 0.7], dtype=torch.float32))
    assert sent[empty].shape == (0,)
    with pytest.raises(ValueError):
        up.add([1, 2, 3], torch.long, (2, 2))


def test_a_step_with_the_letter_schedule_copies_once_too() -> None:
    """With a front end the step also sends forced graphemes and codebook 1's phones."""
    import dataclasses

    from test_front_end import toy_front_end

    bundle = dataclasses.replace(random_bundle(), front_end=toy_front_end())
    r = engine_step_reads(bundle, 8, steps=20, warmup=5)
    assert r["step"] == [1] * 20, r["sites_per_step"]
    assert r["uploads"] == [1] * 20, r["upload_sites_per_step"]
