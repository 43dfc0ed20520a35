"""The decode step recorded once and replayed: as a CUDA graph on a GPU
(`CapturedStep`, and `CapturedCodecStep` for the streaming codec's steady packets), as
frozen TorchScript graphs on the CPU (`FrozenStep` for the model, `FrozenCodecStep` for
the streaming codec), and the streaming codec on the CPU as one native call
(`NativeCodecStep`, the server's default there) or an ONNX Runtime session
(`OnnxCodecStep`).

CUDA graph: the decode step over the first slots of a DecodeState, one graph per
batch-size bucket, with what the caller runs after the model step recorded too (`after`:
the server's sampling and commit, server/runner.py).

On a GPU the eager step is bound by kernel launches, not by math: the paper preset's
step costs about the same at batch 1 and at batch 128 (docs/loadtest.md), hundreds of
small kernels each. A CUDA graph replays all of them as one launch, but only for fixed
shapes and fixed memory. So a graph is recorded for each bucket b (powers of two, and
the capacity): it steps slots 0..b-1 of the caller's `DecodeState` (its tensors stay
where they are) with the whole text memory under the mask, reading its inputs from
buffers of its own. The engine gives a session the lowest free slot, so the sessions
sit in a prefix of the slots and a step replays the smallest bucket that holds the
highest slot stepped: its cost follows the sessions, not the capacity. Stepping a batch
of slots copies their inputs in, replays, and puts back the recurrent state of the
bucket's slots outside the batch, which the replay advanced too: the result equals
`LiveSpeech2.step` on those slots alone. With `capture=False` (any device) the same
calls run eagerly, which is how the CPU tests check everything but the recording itself.
"""
from __future__ import annotations

import io
import logging
import warnings
from typing import Callable, Optional, Sequence, TypeVar, Union

import torch
from torch import nn

from .codec.model import CodecModel, StreamState
from .inference import DecodeState, DecodeStateView
from .livespeech import LiveSpeech2, StepLogits

log = logging.getLogger(__name__)
T = TypeVar("T")


def buckets(capacity: int) -> list[int]:
    """Batch-size buckets of a state of `capacity` slots: 1, 2, 4, ... below it, and it."""
    out = [1 << i for i in range(capacity.bit_length()) if 1 << i < capacity]
    return out + [capacity]


def record_cuda_graph(fn: Callable[[], T], device: torch.device, warmup: int, pool=None,
                      stream: Optional[torch.cuda.Stream] = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """`fn`'s kernels recorded as a CUDA graph, and what its recorded call returned (the
    tensors each replay rewrites). `warmup` calls first, on a side stream: lazy
    initialisations, derived weights and library workspaces must not happen during the
    recording. `pool`: a memory pool shared with graphs that never replay at the same
    time; `stream`: where to record (None: torch's default capture stream)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream), torch.inference_mode():
        out = fn()
    return graph, out


class CapturedStep:
    def __init__(self, model: LiveSpeech2, state: DecodeState, capture: bool = True, warmup: int = 3,
                 matmul_dtype: Optional[torch.dtype] = None, compiled: bool = False,
                 after: Optional[Callable[[StepLogits, int], torch.Tensor]] = None):
        self.model, self.state, self.matmul_dtype = model, state, matmul_dtype
        # `after(logits, b)`: what the graphs record after the model step over a bucket of
        # b slots (the caller's sampling and commit of every row of it, from buffers of its
        # own), its result [b, X] a row each: a whole decode step is one replay
        self.after = after
        capacity, dev = state.capacity, state.step.device
        self.inputs = state.inputs.clone()
        self.frame = state.step.clone()
        self.mask = torch.zeros(capacity, state.txt_chunk.shape[1], dtype=torch.bool, device=dev)
        self.buckets = buckets(capacity)
        # `compiled`: the step the graphs record is torch.compile's (`compiled_step`); a
        # batch of one steps the bucket of two, as a size of 1 would be compiled apart
        self._compiled = compiled_step(model, state, matmul_dtype) if compiled else None
        if compiled and capacity > 1:
            self.buckets = self.buckets[1:]
        # bucket -> (its CUDA graph, its output); empty when not captured
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Union[StepLogits, torch.Tensor]]] = {}
        if capture:
            pool = torch.cuda.graph_pool_handle()  # one memory pool: a step replays one graph
            with state.recurrent_state_kept():  # warm-up steps advance it
                for b in reversed(self.buckets):  # the largest first: the pool's blocks fit the rest
                    self.graphs[b] = record_cuda_graph(lambda: self._eager(b), dev, warmup, pool)

    @property
    def compiled(self) -> bool:
        """Whether the step recorded is torch.compile's."""
        return self._compiled is not None

    def _eager(self, b: int) -> Union[StepLogits, torch.Tensor]:
        """The step of the bucket of `b` slots, not replayed: what a graph records."""
        view = self.state.view(range(b))
        if self._compiled is not None:
            logits = self._compiled(self.inputs[:b], self.frame[:b], view, self.mask[:b])
        else:
            logits = self.model.step(self.inputs[:b], self.frame[:b], view, self.mask[:b], self.matmul_dtype)
        return logits if self.after is None else self.after(logits, b)

    @torch.inference_mode()
    def __call__(self, slots: Sequence[int], inputs: torch.Tensor, frame: torch.Tensor,
                 text_mask: torch.Tensor, replay: bool = True) -> Union[StepLogits, torch.Tensor]:
        """`LiveSpeech2.step` for `slots` (inputs [B, K], frame [B], text_mask [B, l] over
        the first l <= L text slots): the state's rows of those slots are updated in
        place, every other row is as it was; returns the batch's logits (a copy), or with
        `after` its rows of what that returned. `replay` False: the step runs eagerly
        (`after` reads settings its recording did not cover)."""
        b = next(b for b in self.buckets if b > max(slots))
        idx = self.state.slot_index(slots)
        self.inputs.index_copy_(0, idx, inputs)
        self.frame.index_copy_(0, idx, frame)
        self.mask[:b].zero_()
        self.mask[:, : text_mask.shape[1]].index_copy_(0, idx, text_mask)
        with self.state.recurrent_state_kept(sorted(set(range(b)) - set(slots))):
            if replay and b in self.graphs:
                graph, out = self.graphs[b]
                graph.replay()
            else:
                out = self._eager(b)
        if self.after is not None:
            return out.index_select(0, idx)
        return StepLogits(graphemes=out.graphemes.index_select(0, idx), acoustic=out.acoustic.index_select(0, idx))


class _StepOverTensors(nn.Module):
    """`LiveSpeech2.step` with the state's tensors as arguments, which tracing needs."""

    def __init__(self, model: LiveSpeech2, matmul_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.model, self.matmul_dtype = model, matmul_dtype

    def forward(self, inputs, frame, conv, ssm, mem_k, mem_v, text_mask, phones=None):
        view = DecodeStateView(conv=conv, ssm=ssm, mem_k=mem_k, mem_v=mem_v, txt_chunk=None, inputs=None,
                               step=None, eos_frame=None, ring=None)
        out = self.model.step(inputs, frame, view, text_mask, self.matmul_dtype, phones=phones)
        return out.graphemes, out.acoustic


def compiled_step(model: LiveSpeech2, state: DecodeState, matmul_dtype: Optional[torch.dtype] = None
                  ) -> Callable[[torch.Tensor, torch.Tensor, DecodeStateView, torch.Tensor], StepLogits]:
    """`LiveSpeech2.step` compiled by torch.compile (Inductor), called like it: its
    elementwise ops fused, so a step is far fewer kernels. On a GPU the step is bound by
    its kernels (~1,150 at the paper preset's 30 layers), which a CUDA graph replays
    without launching but not fewer; fused, the same work is fewer and larger kernels.
    The batch size stays symbolic (the batch's tensors marked dynamic), so one graph serves
    every batch size from 2, and a second the state's full capacity (its views are
    contiguous there, which the compiled in-place state update is specialised on).
    Weights are constants of the graph: the derived step tensors are built by one eager
    step over `state`'s first slots (its recurrent state put back after it)."""
    module = _StepOverTensors(model, matmul_dtype)
    b = min(2, state.capacity)
    with state.recurrent_state_kept(), torch.inference_mode():
        view = state.view(range(b))
        mask = torch.zeros(b, 1, dtype=torch.bool, device=state.step.device)
        model.step(state.inputs[:b], state.step[:b], view, mask, matmul_dtype)
    compiled = torch.compile(module, fullgraph=True)

    def step(inputs: torch.Tensor, frame: torch.Tensor, view: DecodeStateView, text_mask: torch.Tensor) -> StepLogits:
        args = (inputs, frame, view.conv, view.ssm, view.mem_k, view.mem_v, text_mask)
        if inputs.shape[0] > 1:
            for t, dim in zip(args, (0, 0, 1, 1, 1, 1, 0)):
                torch._dynamo.mark_dynamic(t, dim)
        g, a = compiled(*args)
        return StepLogits(graphemes=g, acoustic=a)

    return step


class FrozenStep:
    """`LiveSpeech2.step` as a frozen TorchScript graph, called like it.

    On the CPU the eager step is bound by Python and op dispatch, not by math: ~350 ops,
    each a Python call (docs/loadtest.md). Traced once and frozen, with the weights and
    the derived step tensors as constants, the same ops run from TorchScript's
    interpreter with no Python between them: 1.8x faster at batch 1, 1.3x at batch 16
    (default model, one thread). The trace keeps batch size and text length symbolic;
    the model's own branches (device, biases) are fixed when it is made, and so are its
    weights: a model that changes needs a new FrozenStep.

    `matmul_dtype` (bfloat16) traces a second graph with the widest matmuls in that
    dtype (`LiveSpeech2.step`), which a call with `matmul_dtype` runs.
    """

    def __init__(self, model: LiveSpeech2, warmup: int = 3, matmul_dtype: Optional[torch.dtype] = None):
        example = DecodeState.allocate(model, capacity=2, device=next(model.parameters()).device)
        mask = torch.zeros(2, 4, dtype=torch.bool, device=example.step.device)
        mask[:, :2] = True
        args = (example.inputs, torch.arange(2, device=mask.device), example.conv, example.ssm,
                example.mem_k, example.mem_v, mask)
        # a decoder with a phone input takes the phones as one more argument
        self.phones = bool(model.cfg.n_phones)
        if self.phones:
            args += (torch.tensor([0, -1], device=mask.device),)
        self.graphs = {dtype: _frozen(_StepOverTensors(model, dtype), args, warmup)
                       for dtype in dict.fromkeys((None, matmul_dtype))}

    def __call__(self, inputs: torch.Tensor, frame: torch.Tensor, state: DecodeStateView,
                 text_mask: torch.Tensor, matmul_dtype: Optional[torch.dtype] = None,
                 phones: Optional[torch.Tensor] = None) -> StepLogits:
        args = (inputs, frame, state.conv, state.ssm, state.mem_k, state.mem_v, text_mask)
        g, a = self.graphs[matmul_dtype](*args, *((phones,) if self.phones else ()))
        return StepLogits(graphemes=g, acoustic=a)


class _CodecStepGraph:
    """`CodecModel.decode_step` through a graph over plain tensors, called like it: the
    graph (`_run`) decodes started streams; a batch with a stream's first packet on a
    reflect-padded codec (its padding reads the packet itself) decodes eagerly, and so
    do codes with another number of codebooks than `n_codebooks`."""

    def __init__(self, codec: CodecModel, n_codebooks: int):
        self.codec, self.n_codebooks = codec, n_codebooks
        self.reflect = codec.config.pad_mode == "reflect"

    def _example_args(self) -> tuple[torch.Tensor, ...]:
        """(codes, *state tensors) of 2 streams x 2 frames, to trace or export the graph on."""
        state = self.codec.streaming_state(2)
        return (torch.zeros(2, self.n_codebooks, 2, dtype=torch.long, device=state.frames.device), *state.tensors)

    def _run(self, codes: torch.Tensor, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        raise NotImplementedError

    def __call__(self, codes: torch.Tensor, state: StreamState) -> torch.Tensor:
        started = self.codec.check_step(codes, state)
        if (started is not None and self.reflect) or codes.shape[1] != self.n_codebooks:
            return self.codec.decode_step(codes, state)
        wav, state.tensors = self._run(codes, state.tensors)
        state.frames = state.frames + codes.shape[-1]
        return wav


class FrozenCodecStep(_CodecStepGraph):
    """`CodecModel.decode_step` as a frozen TorchScript graph, called like it.

    The streaming codec is dispatch-bound too at a packet's size: on the default codec
    the graph saves 2.5-4 ms a call up to 8 sessions (one session: 2 frames 6.0 -> 3.4
    ms, 6 frames 9.5 -> 6.6 ms), and 3-6 ms at 16 sessions x 6 frames, a tenth of
    such a call (docs/loadtest.md). Batch size and frame count stay symbolic (the LSTM's loop
    over frames is scripted, ELU runs in one piece); the number of codebooks is fixed
    (`n_codebooks`).
    """

    def __init__(self, codec: CodecModel, n_codebooks: int, warmup: int = 3):
        super().__init__(codec, n_codebooks)
        self.graph = _frozen(codec.stream_step_module(), self._example_args(), warmup)

    def _run(self, codes, tensors):
        with torch.inference_mode():
            wav, *new = self.graph(codes, *tensors)
        return wav, new


class CapturedCodecStep(_CodecStepGraph):
    """`CodecModel.decode_step` with its steady packets replayed from CUDA graphs, called
    like it.

    On a GPU the eager codec is bound by its kernel launches: the paper's codec took
    ~8.4 ms a 7-frame packet at batch 1, 16 and 64 alike on an H100 (docs/loadtest.md),
    host time the codec thread takes from the engine thread (one interpreter). Packets
    of `frames` frames (the steady packet: most calls) replay a graph per batch-size
    bucket (`buckets`), recorded at start-up over buffers of its own: a call copies its
    codes and streams' state into the bucket's first rows, replays, and copies those rows
    out (the other rows decode stale inputs, unread). Packets of other sizes (the ramp's)
    decode eagerly. With capture=False (any device) the same buffers run eagerly, which
    is how the CPU tests check all but the recording.
    """

    def __init__(self, codec: CodecModel, n_codebooks: int, capacity: int, frames: int, capture: bool = True,
                 warmup: int = 3):
        super().__init__(codec, n_codebooks)
        self.module, self.frames = codec.stream_step_module().eval(), frames
        self.buckets = buckets(capacity)
        # bucket -> (its graph or None, codes buffer, state buffers, outputs or None)
        self.graphs: dict[int, tuple] = {}
        pool = torch.cuda.graph_pool_handle() if capture else None  # one call replays one graph
        # recorded on a stream of its own: library workspaces (cuBLAS's) are kept per stream
        # and recorded into the graph, and these graphs replay on the codec's stream while
        # the model's, recorded on torch's default capture stream, replay beside them
        recording = torch.cuda.Stream(next(codec.parameters()).device) if capture else None
        for b in reversed(self.buckets):  # the largest first: the pool's blocks fit the rest
            state = codec.streaming_state(b)
            codes = torch.zeros(b, n_codebooks, frames, dtype=torch.long, device=state.frames.device)
            tensors = [t.clone() for t in state.tensors]
            graph = out = None
            if capture:
                graph, out = record_cuda_graph(lambda: self.module(codes, *tensors), codes.device, warmup, pool,
                                               recording)
            self.graphs[b] = graph, codes, tensors, out

    def _run(self, codes, tensors):
        n = codes.shape[0]
        if codes.shape[-1] != self.frames:
            wav, *new = self.module(codes, *tensors)
            return wav, new
        graph, buf, state, out = self.graphs[next(b for b in self.buckets if b >= n)]
        buf[:n].copy_(codes)
        for dst, src in zip(state, tensors):
            dst[:n].copy_(src)
        if graph is None:
            out = self.module(buf, *state)
        else:
            graph.replay()
        wav, *new = out
        return wav[:n].clone(), [t[:n].clone() for t in new]


class OnnxCodecStep(_CodecStepGraph):
    """`CodecModel.decode_step` run by ONNX Runtime, called like it (`FrozenCodecStep`).

    The streaming codec's packet is many small convolutions, LSTM cells and ELUs; ONNX
    Runtime's CPU kernels and executor run them with less overhead an op than
    TorchScript's: 6 frames of one session 3.3 -> 1.5 ms, of 16 sessions 21.7 -> 16.6 ms
    (default codec, one thread; docs/loadtest.md, "Measured choices"). The codec's
    streaming step is exported once, in memory, from the weights loaded (nothing is
    stored beside them), with batch size and frame count symbolic; its outputs equal the
    torch step's to float rounding (tests/test_step_graph.py).
    """

    def __init__(self, codec: CodecModel, n_codebooks: int, threads: int = 1):
        import onnxruntime  # a dependency; where it fails to load the runner uses torch

        super().__init__(codec, n_codebooks)
        example = self._example_args()
        self._names = [f"state{i}" for i in range(len(example) - 1)]
        dims = {name: {0: "batch"} for name in self._names}
        dims.update(codes={0: "batch", 2: "frames"}, wav={0: "batch", 2: "samples"})
        dims.update({f"new_{name}": {0: "batch"} for name in self._names})
        buf = io.BytesIO()
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")  # the tracer's, as in `_frozen`
            torch.onnx.export(codec.stream_step_module().eval(), example, buf, dynamo=False,
                              input_names=["codes", *self._names], opset_version=17, dynamic_axes=dims,
                              output_names=["wav", *(f"new_{name}" for name in self._names)])
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        # a worker thread that spins while it waits takes a core the engine needs
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = onnxruntime.InferenceSession(buf.getvalue(), options, providers=["CPUExecutionProvider"])

    def _run(self, codes, tensors):
        feeds = {"codes": codes.contiguous().numpy()}
        feeds.update((name, t.contiguous().numpy()) for name, t in zip(self._names, tensors))
        wav, *new = (torch.from_numpy(a) for a in self.session.run(None, feeds))
        return wav, new


class NativeCodecStep(_CodecStepGraph):
    """`CodecModel.decode_step` as one native call (models/native/codec.cpp), called like
    it (`FrozenCodecStep`): the activations channels-last, each convolution one sgemm
    over every session's samples with the ELU before it applied as its windows are
    built, the LSTM's gate maths one loop after each frame's sgemm. Its weights are
    taken once (a codec that changes needs a new one); its outputs equal the torch
    step's to float rounding (tests/test_native_codec.py). Decoders of other layers
    than SEANet's raise NotImplementedError."""

    def __init__(self, codec: CodecModel, n_codebooks: int):
        from .codec.modules import SConv1d, SConvTranspose1d, SEANetResnetBlock, SLSTM, is_unit_elu
        from .native_step import native_module

        super().__init__(codec, n_codebooks)
        module = native_module()
        if module is None:
            raise RuntimeError("the native CPU code could not be built here")
        if next(codec.parameters()).device.type != "cpu":
            raise ValueError("the native codec step runs on the CPU")

        def conv(layer, elu: bool) -> tuple:
            if not isinstance(layer, SConv1d):
                raise NotImplementedError(f"a native codec step of a decoder with {type(layer).__name__}")
            c = layer.conv.conv
            return layer.window_weight(), _bias(c), layer.kernel_size, c.dilation[0], elu

        with torch.no_grad():
            self.decoder = module.CodecDecoder(codec.quantizer.codeword_tables().float())
            elu = False
            for layer in codec.decoder.model:
                if is_unit_elu(layer) and not elu:
                    elu = True
                    continue
                if isinstance(layer, SConv1d):
                    self.decoder.add_conv(*conv(layer, elu))
                elif isinstance(layer, SConvTranspose1d):
                    w = layer.window_weight()
                    m = w.shape[0] // layer.convtr.convtr.in_channels
                    self.decoder.add_conv_transpose(w, _bias(layer.convtr.convtr).repeat(layer.stride), m,
                                                    layer.stride, elu)
                elif isinstance(layer, SLSTM) and not elu:
                    w_ih, w_hh, bias = zip(*layer.loop_weights())
                    self.decoder.add_lstm(list(w_ih), list(w_hh), list(bias))
                elif isinstance(layer, SEANetResnetBlock) and not elu:
                    block = list(layer.block)
                    if not (len(block) == 4 and is_unit_elu(block[0]) and is_unit_elu(block[2])
                            and block[3].kernel_size == 1):
                        raise NotImplementedError("a native codec step of another residual block")
                    a, b = conv(block[1], True), conv(block[3], True)
                    short = layer.shortcut
                    if isinstance(short, SConv1d) and short.kernel_size == 1:
                        shortcut = (short.window_weight(), _bias(short.conv.conv))
                    elif isinstance(short, nn.Identity):
                        shortcut = (None, None)
                    else:
                        raise NotImplementedError("a native codec step of another residual shortcut")
                    self.decoder.add_residual(a[0], a[1], a[2], a[3], b[0], b[1], *shortcut)
                else:
                    raise NotImplementedError(f"a native codec step of a decoder with {type(layer).__name__}")
                elu = False
            if elu:
                raise NotImplementedError("a native codec step of a decoder ending in an ELU")

    def _run(self, codes, tensors):
        wav, new = self.decoder.decode(codes, list(tensors))
        return wav, list(new)


def _bias(conv: nn.Module) -> torch.Tensor:
    return conv.bias.detach().float() if conv.bias is not None else torch.zeros(conv.out_channels)


def _frozen(module: nn.Module, args: tuple, warmup: int):
    """`module` traced on `args` and frozen (its weights become constants), after
    `warmup` calls: the executor profiles its first calls, then optimises."""
    with warnings.catch_warnings(), torch.inference_mode():
        # torch.jit is deprecated in favour of torch.compile, which on the CPU needs a C++
        # compiler at run time and was slower than eager from batch 8 here
        # (docs/loadtest.md); the tracer's warnings are about constants, which is what
        # freezing makes of the weights
        warnings.simplefilter("ignore")
        module(*args)  # builds the derived step tensors: the tracer takes packed int8 weights only as attributes
        graph = torch.jit.freeze(torch.jit.trace(module.eval(), args, check_trace=False))
        for _ in range(warmup):
            graph(*args)
    return graph


def frozen_or_eager(make, eager):
    """`make()` (a frozen step), or `eager` where tracing fails (a torch without
    torch.jit): slower, the same results."""
    try:
        return make()
    except Exception as e:  # noqa: BLE001 - any failure here only costs speed
        log.warning("%s runs eagerly: tracing it failed (%s: %s)", getattr(eager, "__qualname__", eager),
                    type(e).__name__, e)
        return eager
