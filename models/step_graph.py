"""The decode step over every slot of a DecodeState, recorded once as a CUDA graph.

On a GPU the eager step is bound by kernel launches, not by math: the paper preset's
step costs about the same at batch 1 and at batch 128 (docs/loadtest.md), hundreds of
small kernels each. A CUDA graph replays all of them as one launch, but only for fixed
shapes and fixed memory: so the captured step runs every slot of the caller's
`DecodeState` (its tensors stay where they are) with the whole text memory under the
mask, reading its inputs from buffers of its own. Stepping a batch of slots copies
their inputs in, replays, and puts back the recurrent state of the slots outside the
batch, which the replay advanced too: the result equals `LiveSpeech2.step` on those
slots alone. With `capture=False` (any device) the same calls run eagerly, which is how
the CPU tests check everything but the recording itself.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .inference import DecodeState
from .livespeech import LiveSpeech2, StepLogits


class CapturedStep:
    def __init__(self, model: LiveSpeech2, state: DecodeState, capture: bool = True, warmup: int = 3):
        self.model, self.state = model, state
        capacity, dev = state.capacity, state.step.device
        self.inputs = state.inputs.clone()
        self.frame = state.step.clone()
        self.mask = torch.zeros(capacity, state.txt_chunk.shape[1], dtype=torch.bool, device=dev)
        self.graph = None
        if capture:
            saved = state.conv.clone(), state.ssm.clone()  # warm-up steps advance them
            # warm up on a side stream (lazy initialisations, derived weights, library
            # workspaces must not happen during the recording), then record
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side), torch.inference_mode():
                for _ in range(warmup):
                    self._eager()
            torch.cuda.current_stream(dev).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), torch.inference_mode():
                self.out = self._eager()
            state.conv.copy_(saved[0])
            state.ssm.copy_(saved[1])

    def _eager(self) -> StepLogits:
        return self.model.step(self.inputs, self.frame, self.state, self.mask)

    @torch.inference_mode()
    def __call__(self, slots: Sequence[int], inputs: torch.Tensor, frame: torch.Tensor,
                 text_mask: torch.Tensor) -> StepLogits:
        """`LiveSpeech2.step` for `slots` (inputs [B, K], frame [B], text_mask [B, l] over
        the first l <= L text slots): the state's rows of those slots are updated in
        place, every other row is as it was; returns the batch's logits (a copy)."""
        dev = self.frame.device
        idx = torch.tensor(list(slots), device=dev)
        self.inputs.index_copy_(0, idx, inputs)
        self.frame.index_copy_(0, idx, frame)
        self.mask.zero_()
        self.mask[:, : text_mask.shape[1]].index_copy_(0, idx, text_mask)
        others = sorted(set(range(self.state.capacity)) - set(slots))
        if others:
            keep = torch.tensor(others, device=dev)
            saved = self.state.conv.index_select(1, keep), self.state.ssm.index_select(1, keep)
        out = self._eager() if self.graph is None else (self.graph.replay(), self.out)[1]
        if others:
            self.state.conv.index_copy_(1, keep, saved[0])
            self.state.ssm.index_copy_(1, keep, saved[1])
        return StepLogits(graphemes=out.graphemes.index_select(0, idx), acoustic=out.acoustic.index_select(0, idx))
