"""The recorded decode steps (models/step_graph.py).

The captured step: stepping a batch of slots over the smallest bucket of slots that holds
them equals the eager step of those slots alone, and leaves every other slot as it was. On the CPU it runs eagerly
(capture=False); the recording itself needs CUDA.

The frozen steps (TorchScript, CPU): the model's equals the eager step at every batch
size and text length, on gathered and sliced batches; the codec's equals `decode_step`
at every batch and packet size, and so do ONNX Runtime's (`OnnxCodecStep`), the native
codec step (`NativeCodecStep`) and the codec's CUDA graphs for steady packets
(`CapturedCodecStep`, eagerly here); the runner uses them unless told not to.
"""
import functools
import importlib.util
import logging
import shutil

import numpy as np
import pytest
import torch

from livespeech.models.derived import INT8
from livespeech.models.inference import DecodeState, enrollment_kv
from livespeech.models.livespeech import LiveSpeech2
from livespeech.models.native_step import native_module
from livespeech.models.step_graph import (CapturedCodecStep, CapturedStep, FrozenCodecStep, FrozenStep, NativeCodecStep,
                                          OnnxCodecStep, buckets, frozen_or_eager)
from tests.test_livespeech import small_cfg


def _codec_steps():
    """The codec steps to check: the frozen graph, ONNX Runtime's where it imports, the
    native step where it builds, and the CUDA graphs' buffers for 6-frame packets of up
    to 4 streams (without the recording)."""
    onnx = pytest.mark.skipif(not _onnx_runtime(), reason="onnxruntime or onnx not installed")
    native = pytest.mark.skipif(native_module() is None, reason="the native CPU code cannot be built here")
    captured = functools.partial(CapturedCodecStep, capacity=4, frames=6, capture=False)
    return [FrozenCodecStep, pytest.param(OnnxCodecStep, marks=onnx), pytest.param(NativeCodecStep, marks=native),
            pytest.param(captured, id="CapturedCodecStep")]


def _onnx_runtime() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("onnxruntime", "onnx"))


def _state(model, device="cpu", memory_dtype=None):
    """Four slots: 0, 2 and 3 hold sessions with their own voices and text; 1 is free."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(3)
    st = DecodeState.allocate(model, capacity=4, device=device, memory_dtype=memory_dtype)
    for slot in (0, 2, 3):
        codes = torch.randint(0, cfg.codebook_size, (1, cfg.n_acoustic_codebooks, 12), generator=g).to(device)
        st.reset_slot(slot, enrollment_kv(model, model.encode_enrollment(codes)[0]))
        text = torch.randint(0, 1000, (5 + slot,), generator=g).tolist()
        st.append_text(slot, text, [float(i) for i in range(len(text))], chunk=0)
    return st


def _greedy(out) -> torch.Tensor:
    return torch.cat((out.graphemes.argmax(-1, keepdim=True), out.acoustic.argmax(-1)), 1)


def _run(model, st, step_fn, batches, whole_state=True, tokens=None):
    """Steps `batches` (lists of slots) in turn; each step's greedy tokens are committed,
    or with `tokens` those of another run's outputs (the same history for both).
    `step_fn`: None (the eager step), a step over the whole state (`whole_state`,
    called with the slots) or one called like `LiveSpeech2.step`. Returns the logits of
    every step."""
    outs = []
    for i, slots in enumerate(batches):
        whole = step_fn is not None and whole_state
        view = st.view(slots, skip=("conv", "ssm", "mem_k", "mem_v") if whole else ())
        mask = st.window_mask(view, [0] * len(slots), [0] * len(slots))
        if whole:
            out = step_fn(slots, view.inputs, view.step, mask)
        else:
            out = (step_fn or model.step)(view.inputs, view.step, view, mask)
        st.commit(view, _greedy(out if tokens is None else tokens[i]))
        st.write_back(view)
        outs.append(out)
    return outs


# non-contiguous batches, a slot left out now and then, the free slot never stepped
BATCHES = [[0, 2, 3], [0, 3], [2], [0, 2, 3], [3, 0], [2, 3]]


def _check(device, capture=False, frozen=False, batches=BATCHES, compiled=False):
    torch.manual_seed(0)
    model = LiveSpeech2(small_cfg(), device=device).to(device).eval()
    eager_state, graph_state = _state(model, device), _state(model, device)
    with torch.no_grad():
        want = _run(model, eager_state, None, batches)
        if frozen:
            got = _run(model, graph_state, FrozenStep(model), batches, whole_state=False)
        else:
            step = CapturedStep(model, graph_state, capture=capture, compiled=compiled)
            got = _run(model, graph_state, step, batches)
    for a, b in zip(want, got):
        assert torch.allclose(a.graphemes, b.graphemes, atol=1e-5)
        assert torch.allclose(a.acoustic, b.acoustic, atol=1e-5)
    for name in ("conv", "ssm", "inputs", "step", "eos_frame", "ring"):
        assert torch.allclose(getattr(eager_state, name).float(), getattr(graph_state, name).float(), atol=1e-5), name


def test_batch_over_the_whole_state_equals_the_eager_step():
    _check("cpu", capture=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replay_equals_the_eager_step():
    _check("cuda", capture=True)


def test_a_step_runs_the_smallest_bucket_that_holds_its_slots(monkeypatch):
    """Slot 0 alone steps a batch of 1; a batch reaching slot 2 or 3 the whole 4; the
    slots of the bucket outside the batch stay as they were (`_check`)."""
    assert buckets(1) == [1] and buckets(4) == [1, 2, 4] and buckets(6) == [1, 2, 4, 6]
    stepped, eager = [], CapturedStep._eager
    monkeypatch.setattr(CapturedStep, "_eager", lambda self, b: stepped.append(b) or eager(self, b))
    _check("cpu", batches=[[0], [0, 2], [2, 3], [0], [3]])
    assert stepped == [1, 4, 4, 1, 4]


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(shutil.which("g++") is None,
                                                 reason="torch.compile's CPU kernels need a C++ compiler")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"))])
def test_the_compiled_step_equals_the_eager_step_with_one_graph_for_the_batch_sizes_below_capacity(device):
    """`CapturedStep(compiled=True)` (torch.compile's step, which a GPU's graphs record):
    equal to the eager step along a decode (`_check`; on CUDA its graphs recorded), a
    batch of one stepping the bucket of two; the batch size stays symbolic: one graph for
    the buckets below the capacity, one for the capacity itself (two compiles however
    many buckets)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    stepped, eager = [], CapturedStep._eager
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CapturedStep, "_eager", lambda self, b: stepped.append(b) or eager(self, b))
        _check(device, capture=device == "cuda", compiled=True, batches=[[0], [0, 2, 3], [2, 3], [0], [3], [0]])
    if device == "cpu":  # (recorded graphs replay without calling it)
        assert stepped == [2, 4, 4, 2, 4, 2]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_frozen_step_equals_the_eager_step():
    """Traced at batch 2, it serves batches of 1 to 3, gathered ([0, 2, 3]) and sliced
    ([2, 3]), as the text grows (the window's length is symbolic in the graph)."""
    torch.set_num_threads(1)
    _check("cpu", frozen=True, batches=BATCHES + [[0], [0, 1, 2, 3]])


def test_frozen_step_with_no_visible_text():
    """A window mask cut to zero text slots (the visible length of an all-masked window)."""
    torch.manual_seed(0)
    model = LiveSpeech2(small_cfg()).eval()
    states = _state(model), _state(model)
    frozen = FrozenStep(model)
    with torch.no_grad():
        outs = []
        for st, step in zip(states, (model.step, frozen)):
            view = st.view([0, 2, 3])
            outs.append(step(view.inputs, view.step, view, torch.zeros(3, 0, dtype=torch.bool)))
    assert torch.allclose(outs[0].graphemes, outs[1].graphemes, atol=1e-5)
    assert torch.allclose(outs[0].acoustic, outs[1].acoustic, atol=1e-5)
    assert torch.allclose(states[0].ssm, states[1].ssm, atol=1e-5)


def test_frozen_step_with_a_phone_input_equals_the_eager_step():
    torch.manual_seed(0)
    model = LiveSpeech2(small_cfg(n_phones=5)).eval()
    torch.nn.init.normal_(model.phone_emb.weight)
    states = _state(model), _state(model), _state(model)
    frozen = FrozenStep(model)
    phones = torch.tensor([4, -1, 0])
    with torch.no_grad():
        outs = []
        for st, step, ph in zip(states, (model.step, frozen, frozen), (phones, phones, phones.flip(0))):
            view = st.view([0, 2, 3])
            outs.append(step(view.inputs, view.step, view, torch.ones(3, 2, dtype=torch.bool), phones=ph))
    assert torch.allclose(outs[0].acoustic, outs[1].acoustic, atol=1e-5)
    assert not torch.allclose(outs[1].acoustic[0], outs[2].acoustic[0], atol=1e-3)  # the phone is read
    assert torch.allclose(outs[1].acoustic[1], outs[2].acoustic[1], atol=1e-5)  # the same phone (none)


def test_runner_steps_through_the_frozen_graph_unless_told_not_to():
    """(Without the native step, which tests/test_native_step.py covers.)"""
    from livespeech.models.loading import load_bundle
    from livespeech.server.runner import ModelRunner

    bundle = load_bundle(random_init=True)
    frozen, eager = ModelRunner(bundle, 2, native_step=False), ModelRunner(bundle, 2, frozen_step=False)
    assert isinstance(frozen.model_step, FrozenStep) and isinstance(frozen.codec_step, FrozenCodecStep)
    assert eager.model_step == bundle.model.step and eager.codec_step == bundle.codec.decode_step
    assert (frozen.model_step_runtime, eager.model_step_runtime) == ("frozen graph", "eager")


@pytest.mark.skipif(not _onnx_runtime() or native_module() is None, reason="no ONNX Runtime or no native build")
def test_runner_decodes_with_the_codec_runtime_asked_for_and_falls_back_where_it_fails(monkeypatch, caplog):
    """`codec_runtime`: native (where it fails, ONNX Runtime), onnx (where it fails, the
    frozen graph), torch (the frozen graph); the packets of each equal the frozen graph's,
    and a fallback is logged."""
    from livespeech.models.loading import load_bundle
    from livespeech.server.runner import ModelRunner

    bundle = load_bundle(random_init=True)
    native, onnx = ModelRunner(bundle, 2, codec_runtime="native"), ModelRunner(bundle, 2, codec_runtime="onnx")
    frozen = ModelRunner(bundle, 2, codec_runtime="torch")
    assert isinstance(native.codec_step, NativeCodecStep) and native.codec_runtime == "native"
    assert isinstance(onnx.codec_step, OnnxCodecStep) and isinstance(frozen.codec_step, FrozenCodecStep)
    g = torch.Generator().manual_seed(2)
    for n in (6, 1, 4):
        frames = torch.randint(0, 1024, (2, n, 8), generator=g).tolist()
        want = frozen.decode([0, 1], frames)
        for runner in (native, onnx):
            for a, b in zip(runner.decode([0, 1], frames), want):
                assert np.allclose(a, b, atol=1e-4)

    def broken(name):
        def make(*args, **kwargs):
            raise RuntimeError(f"no {name} here")
        return make

    monkeypatch.setattr("livespeech.server.runner.NativeCodecStep", broken("native build"))
    with caplog.at_level(logging.WARNING, logger="livespeech.server.runner"):
        assert isinstance(ModelRunner(bundle, 2, codec_runtime="native").codec_step, OnnxCodecStep)
        monkeypatch.setattr("livespeech.server.runner.OnnxCodecStep", broken("ONNX Runtime"))
        assert isinstance(ModelRunner(bundle, 2, codec_runtime="onnx").codec_step, FrozenCodecStep)
    assert "no native build here" in caplog.text and "no ONNX Runtime here" in caplog.text


def test_runner_with_cuda_graphs_records_the_codec_steady_packet_or_decodes_eagerly(monkeypatch, caplog):
    """`cuda_graphs`: the codec's graphs for the steady packet (the sessions' default 80 ms:
    6 frames); where they cannot be recorded, the eager codec, with a warning."""
    from livespeech.models.loading import load_bundle
    from livespeech.server.runner import ModelRunner

    bundle = load_bundle(random_init=True)
    runner = ModelRunner(bundle, 2, cuda_graphs=True)
    assert isinstance(runner.codec_step, CapturedCodecStep) and runner.codec_step.frames == 6

    def broken(*args, **kwargs):
        raise RuntimeError("no graphs here")

    monkeypatch.setattr("livespeech.server.runner.CapturedCodecStep", broken)
    with caplog.at_level(logging.WARNING, logger="livespeech.server.runner"):
        assert ModelRunner(bundle, 2, cuda_graphs=True).codec_step == bundle.codec.decode_step
    assert "no graphs here" in caplog.text


def test_a_runner_records_the_uncompiled_step_where_torch_compile_fails(monkeypatch, caplog):
    """`compile_step`: where torch.compile's step cannot be made, the runner records the
    uncompiled one, with a warning; the server goes on."""
    from livespeech.models.loading import load_bundle
    from livespeech.server.runner import ModelRunner

    def broken(*args, **kwargs):
        raise RuntimeError("no Triton here")

    monkeypatch.setattr("livespeech.models.step_graph.compiled_step", broken)
    with caplog.at_level(logging.WARNING, logger="livespeech.server.runner"):
        runner = ModelRunner(load_bundle(random_init=True), 2, cuda_graphs=True, compile_step=True)
    assert runner.captured is not None and not runner.captured.compiled and runner.captured.after is not None
    assert "no Triton here" in caplog.text


def test_a_runner_records_the_model_step_alone_where_recording_its_sampling_fails(monkeypatch, caplog):
    """Where the step cannot be recorded with its sampling and commit, the runner records
    the model step alone and samples and commits call by call, with a warning."""
    from livespeech.models.loading import load_bundle
    from livespeech.server.runner import ModelRunner

    real = CapturedStep.__init__

    def no_after(self, *args, after=None, **kwargs):
        if after is not None:
            raise RuntimeError("operation not permitted when stream is capturing")
        real(self, *args, **kwargs)

    monkeypatch.setattr(CapturedStep, "__init__", no_after)
    with caplog.at_level(logging.WARNING, logger="livespeech.server.runner"):
        runner = ModelRunner(load_bundle(random_init=True), 2, cuda_graphs=True)
    assert runner.captured.after is None and runner._rows is None
    assert "not permitted when stream is capturing" in caplog.text


def test_a_step_that_cannot_be_traced_runs_eagerly(monkeypatch, caplog):
    def no_jit(*args, **kwargs):
        raise RuntimeError("no TorchScript here")

    monkeypatch.setattr(torch.jit, "trace", no_jit)
    model = LiveSpeech2(small_cfg()).eval()
    with caplog.at_level(logging.WARNING, logger="livespeech.models.step_graph"):
        assert frozen_or_eager(lambda: FrozenStep(model), model.step) == model.step
    assert "no TorchScript here" in caplog.text


def _codec(pad_mode: str = "constant"):
    from tests.test_codec import random_model

    return random_model("small", pad_mode=pad_mode)


@pytest.mark.parametrize("step_class", _codec_steps())
@pytest.mark.parametrize("batch", [1, 3])
def test_codec_step_graphs_equal_the_eager_step(batch, step_class):
    """Traced (or exported) at 2 streams x 2 frames, it decodes any batch and packet
    size (here 1 to 9 frames in a row, past the 8-frame GEMM path and the LSTM's own
    switch), with the same audio and the same carried state as `decode_step`."""
    torch.set_num_threads(1)
    codec = _codec()
    _check_codec(codec, step_class(codec, n_codebooks=8), batch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("batch", [1, 3])
def test_codec_cuda_graph_replay_equals_the_eager_step(batch):
    codec = _codec().to("cuda")
    _check_codec(codec, CapturedCodecStep(codec, n_codebooks=8, capacity=4, frames=6), batch)


def _check_codec(codec, step, batch: int) -> None:
    eager_state, step_state = codec.streaming_state(batch), codec.streaming_state(batch)
    dev = eager_state.frames.device
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for frames in (2, 1, 3, 6, 9, 6):
            codes = torch.randint(0, codec.config.codebook_size, (batch, 8, frames), generator=g).to(dev)
            want, got = codec.decode_step(codes, eager_state), step(codes, step_state)
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4)
            assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(eager_state.tensors, step_state.tensors))
            assert torch.equal(eager_state.frames, step_state.frames)


@pytest.mark.parametrize("step_class", _codec_steps())
def test_codec_step_graphs_leave_what_they_cannot_run_to_the_eager_step(monkeypatch, step_class):
    """A reflect-padded codec's first packet (its padding reads the packet) and codes
    with another number of codebooks go to `decode_step`; started streams do not."""
    codec = _codec("reflect")
    frozen = step_class(codec, n_codebooks=8)
    calls = []
    real = codec.decode_step
    monkeypatch.setattr(codec, "decode_step", lambda codes, state: calls.append(codes.shape) or real(codes, state))
    state = codec.streaming_state(1)
    with torch.inference_mode():
        frozen(torch.zeros(1, 8, codec.min_first_frames, dtype=torch.long), state)
        frozen(torch.zeros(1, 8, 2, dtype=torch.long), state)
        frozen(torch.zeros(1, 4, 2, dtype=torch.long), state)
    assert calls == [(1, 8, codec.min_first_frames), (1, 4, 2)]


def test_engine_with_the_recorded_steps_speaks():
    """The engine with the eager step, the frozen step (the CPU default) and the whole-state
    step (`cuda_graphs`, eager here): two concurrent sessions finish with their audio,
    and each session's audio equals the eager engine's for the same seed."""
    from livespeech.server.engine import Engine, EngineConfig
    from livespeech.api.session import AudioPacket, Finished, SessionConfig
    from livespeech.models.loading import load_bundle
    from tests.test_engine import HARD, Collector

    torch.set_num_threads(1)
    audio = {}
    steps = {"eager": dict(frozen_step=False), "frozen": {}, "whole state": dict(cuda_graphs=True)}
    for kind, options in steps.items():
        eng = Engine(load_bundle(random_init=True), EngineConfig(max_sessions=3, low_water_steps=0, **options))
        try:
            v = eng.make_voice("t", (np.random.default_rng(0).standard_normal(24000) * 0.1).astype(np.float32), 24000)
            cs = []
            for text in ("The first of two voices.", "And here is the second one."):
                c = Collector()
                h = eng.open_session(SessionConfig(**{**HARD, "seed": 5}, start_future_chunks=2), v, c)
                h.push_text(text)
                h.end_input()
                cs.append(c)
            # both sessions queued before the loop runs: they start in the same step in every
            # run, so which rows share a step (and the float rounding of a step's matmuls,
            # which depends on its batch size) does not hang on the threads' timing
            eng.start()
            assert all(c.done.wait(120) for c in cs)
        finally:
            eng.stop()
        assert all(c.of(Finished) for c in cs)
        audio[kind] = [np.frombuffer(b"".join(p.data for p in c.of(AudioPacket)), dtype="<i2").astype(int) for c in cs]
    for kind in ("frozen", "whole state"):
        for plain, other in zip(audio["eager"], audio[kind]):
            assert len(plain) == len(other) and np.abs(plain - other).max() <= 2, kind


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 0.03), (INT8, 0.05)])
def test_the_lower_precision_step_frozen_equals_it_eager_and_stays_near_float32(dtype, tolerance):
    """`matmul_dtype` bfloat16 or int8 (the heads and the Mamba in/out projections with
    those weights; int8's packed weights reach the frozen graph as module attributes):
    the frozen graph traced for it equals the eager step in that dtype along a decode,
    and one step's logits differ from float32's by the rounding only, but do differ (the
    dtype is not ignored)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LiveSpeech2(small_cfg()).eval()
    frozen = FrozenStep(model, matmul_dtype=dtype)
    assert set(frozen.graphs) == {None, dtype}
    eager_state, graph_state = _state(model), _state(model)
    with torch.no_grad():
        want = _run(model, eager_state, lambda *a: model.step(*a, matmul_dtype=dtype), BATCHES, whole_state=False)
        got = _run(model, graph_state, lambda *a: frozen(*a, dtype), BATCHES, whole_state=False)
    for a, b in zip(want, got):
        assert torch.allclose(a.acoustic, b.acoustic, atol=1e-5) and torch.allclose(a.graphemes, b.graphemes, atol=1e-5)
    assert torch.allclose(eager_state.ssm, graph_state.ssm, atol=1e-5)
    st = _state(model)
    with torch.no_grad():
        outs = {}
        for d in (None, dtype):
            view = st.view([0, 2, 3])  # a gathered copy: each step starts from the same state
            mask = st.window_mask(view, [0] * 3, [0] * 3)
            outs[d] = frozen(view.inputs, view.step, view, mask, d).acoustic
    error = (outs[None] - outs[dtype]).abs().max() / outs[None].abs().max()
    print(f"{dtype}: largest logit error {error:.4f} of the largest logit")
    assert 0 < error <= tolerance


def test_an_int8_matmul_keeps_each_rows_product_its_own():
    """The int8 path scales each row (a session) on its own before quantising: a row of
    NaN and a row a million times larger beside it leave a row's product as near its
    float32 product as alone (one scale for the call would round it to zeros), and the
    NaN row's product stays non-finite, so that session alone fails."""
    from livespeech.models.derived import matmul_t, packed_int8

    torch.manual_seed(0)
    w = torch.randn(64, 32)
    packed = packed_int8(w)
    x = torch.randn(3, 32)
    want = x[0] @ w.t()
    alone = matmul_t(x[:1], packed)[0]
    x[1] = float("nan")
    x[2] *= 1e6
    got = matmul_t(x, packed)
    for y in (alone, got[0]):
        assert (y - want).abs().max() <= 0.05 * want.abs().max()
    assert not torch.isfinite(got[1]).any() and torch.isfinite(got[2]).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"))])
def test_the_captured_step_runs_a_gpus_bf16_weights_and_memory(device):
    """A GPU's bf16 path: the matmuls' dtype is recorded with the step at every batch-size
    bucket (`CapturedStep(matmul_dtype=...)`), the text memory kept in bfloat16. It
    equals the eager step with the same settings along a decode (recorded on CUDA,
    eagerly elsewhere) and stays near the float32 step, from which it differs."""
    torch.manual_seed(0)
    model = LiveSpeech2(small_cfg(), device=device).to(device).eval()
    bf16 = torch.bfloat16
    states = [_state(model, device, memory_dtype=bf16), _state(model, device, memory_dtype=bf16), _state(model, device)]
    assert states[0].mem_k.dtype == states[0].mem_v.dtype == bf16 and states[0].ssm.dtype == torch.float32
    capture = device == "cuda"
    with torch.no_grad():
        want = _run(model, states[0], lambda *a: model.step(*a, matmul_dtype=bf16), BATCHES, whole_state=False)
        got = _run(model, states[1], CapturedStep(model, states[1], capture=capture, matmul_dtype=bf16), BATCHES)
        f32 = _run(model, states[2], CapturedStep(model, states[2], capture=capture), BATCHES)
    for a, b in zip(want, got):
        assert torch.allclose(a.acoustic, b.acoustic, atol=1e-4) and torch.allclose(a.graphemes, b.graphemes, atol=1e-4)
    assert want[0].acoustic.dtype == torch.float32
    scale = f32[0].acoustic.abs().max()
    assert not torch.allclose(got[0].acoustic, f32[0].acoustic, atol=1e-5)
    assert (got[0].acoustic - f32[0].acoustic).abs().max() <= 0.05 * scale


def test_the_runner_steps_in_bf16_from_two_sessions_and_in_int8_from_one_when_asked():
    """matmul_weights: with bfloat16 a batch of one steps in float32 (bf16 measured slower
    there), two or more in bf16; int8 at every size (faster than float32 from one); with
    float32 at every size and no other graph is traced."""
    from livespeech.models.guidance import GuidanceState
    from livespeech.models.loading import load_bundle
    from livespeech.server.runner import LOW_PRECISION_FROM_BATCH, ModelRunner

    assert LOW_PRECISION_FROM_BATCH == {"bfloat16": 2, "int8": 1}
    bundle = load_bundle(random_init=True)
    bf16 = torch.bfloat16
    for weights, dtype, want in (("bfloat16", bf16, [None, bf16, bf16, None]), ("int8", INT8, [INT8] * 4),
                                 ("float32", None, [None] * 4)):
        runner = ModelRunner(bundle, 3, matmul_weights=weights)
        assert set(runner.model_step.steps if runner.native else runner.model_step.graphs) == {None, dtype}
        voice = runner.make_voice("v", (np.random.default_rng(0).standard_normal(24000) * 0.1).astype(np.float32), 24000)
        for s in range(3):
            runner.admit(s, voice, seed=s)
            runner.add_chunk(s, list(range(100, 112)), 0, 0)
        seen, step = [], runner.model_step
        runner.model_step = lambda *a, **k: (seen.append(a[4]), step(*a, **k))[1]
        for slots in ([0], [0, 1], [0, 1, 2], [2]):
            n = len(slots)
            runner.step(slots, [(0, 0)] * n, [GuidanceState() for _ in slots], [False] * n)
        assert seen == want, weights
    with pytest.raises(ValueError, match="matmul_weights must be one of"):
        ModelRunner(bundle, 1, matmul_weights="auto")


@pytest.mark.parametrize("device_guidance", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"))])
def test_the_step_recorded_with_its_sampling_and_commit_equals_the_step_call_by_call(device, device_guidance):
    """With the CUDA graphs a step's sampling and commit are recorded with the model step
    over the bucket of slots (`ModelRunner._sample_and_commit`; recorded on CUDA, eagerly
    elsewhere): the same tokens, frames and endings as the runner stepping call by call,
    along a decode with a session sitting out, the letter schedule's graphemes, codebook
    1's bias, the runaway guard's EOS, temperatures, and a session whose top-k the
    recording does not cover (that step runs eagerly); the sessions not stepped keep
    their state."""
    from livespeech.api.session import SessionConfig
    from livespeech.models import graphemes
    from livespeech.models.loading import load_bundle
    from livespeech.server.runner import RECORDED_TOP_K, ModelRunner
    from livespeech.models.guidance import GuidanceState, SamplingSettings, Temperatures

    import dataclasses

    from tests.test_front_end import toy_front_end

    torch.manual_seed(0)
    # a front end's codebook-1 bias table (5 rows), there when the graphs are recorded
    bundle = dataclasses.replace(load_bundle(random_init=True, device=device), front_end=toy_front_end())
    noise = (np.random.default_rng(0).standard_normal(24000) * 0.1).astype(np.float32)
    runners = [ModelRunner(bundle, 4, cuda_graphs=graphs, frozen_step=False, device_guidance=device_guidance)
               for graphs in (False, True)]
    assert runners[0]._rows is None and runners[1]._rows is not None
    assert runners[1].first_code_bias is not None
    text = graphemes.text_to_ids("a short text to read")
    guides = []
    for r in runners:
        voice = r.make_voice("v", noise, 24000)
        gs = {}
        for slot in (0, 1, 3):
            gs[slot] = r.admit(slot, voice, seed=slot + 7, guidance=GuidanceState(text))
            r.add_chunk(slot, list(range(100, 106 + slot)), 0, 0)
        guides.append(gs)
    default = SessionConfig()
    temps = {0: Temperatures(1.0, 0.5, 1.0), 1: Temperatures(0.0, 1.0, 0.7), 3: Temperatures(1.0, 1.0, 1.0)}
    # (slots, forced graphemes, bias rows, runaway EOS, top-k of slot 3)
    plan = [((0, 1, 3), [5, -1, 7], [2, -1, 4], False, default.top_k),
            ((0, 3), [-1, -1], [-1, -1], False, default.top_k),
            ((1,), [9], [1], False, default.top_k),
            ((0, 1, 3), [-1, 4, -1], [-1, 1, 0], False, RECORDED_TOP_K[1] + 10),
            ((0, 1, 3), [-1, -1, -1], [3, 3, 3], True, default.top_k),
            ((1, 3), [6, 6], [-1, 2], False, default.top_k)]
    results = [[], []]
    for slots, forced, rows, eos, k3 in plan * 3:
        for r, gs, out in zip(runners, guides, results):
            for s in slots:
                r.set_sampling(s, SamplingSettings(1.0, k3 if s == 3 else default.top_k, default.grapheme_top_k,
                                                   temps[s]))
            with torch.inference_mode():
                out.append(list(r.step(list(slots), [(0, 0)] * len(slots), [gs[s] for s in slots],
                                       [eos and s == 1 for s in slots], forced, rows)))
    assert results[0] == results[1]
    assert any(x.frame is not None for step in results[0] for x in step)
    for name in ("inputs", "step", "eos_frame", "ring", "conv", "ssm"):
        a, b = (getattr(r.state, name) for r in runners)
        assert torch.allclose(a.float(), b.float(), atol=1e-5), name
