"""An engine step reads the device back once (the new frame's tokens of all sessions),
whatever the batch: on a GPU each read waits for the queued kernels
(livespeech.loadtest.host_reads counts them; issue: capacity on GPUs)."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import random_bundle
from livespeech.loadtest.host_reads import HostReads, engine_step_reads


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


@pytest.mark.parametrize("batch, guidance_lambda, device_guidance",
                         [(1, 1.0, False), (32, 1.0, False), (32, math.inf, False), (1, 1.0, True), (32, 1.0, True)])
def test_an_engine_step_reads_the_device_once(batch: int, guidance_lambda: float, device_guidance: bool) -> None:
    r = engine_step_reads(random_bundle(), batch, steps=25, warmup=5, guidance_lambda=guidance_lambda,
                          device_guidance=device_guidance)
    assert r["steps"] == 25
    assert r["step"] == [1] * 25, r["sites_per_step"]
