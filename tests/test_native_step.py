"""The CPU step as one native call (models/native_step.py).

It equals the eager `LiveSpeech2.step` along a decode (float32, bfloat16 and int8
weights; gathered, sliced and strided views; a phone input; no visible text); rows that
share a voice read one copy of its enrollment memory with the same result; a row that
goes non-finite fails alone; the runner steps through it by default and through the
frozen graph when told not to or where it cannot be built. Built by the C++ compiler at
first use: where there is one (CI), the build must succeed.
"""
import logging
import shutil

import numpy as np
import pytest
import torch

from livespeech.models import native_step
from livespeech.models.derived import INT8, INT8_REDUCE_RANGE
from livespeech.models.inference import DecodeState, enrollment_kv
from livespeech.models.livespeech import LiveSpeech2
from livespeech.models.native_step import NativeStep
from tests.test_livespeech import small_cfg
from tests.test_step_graph import BATCHES, _run, _state

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="the native step is built by a C++ compiler")


def test_it_builds_where_a_compiler_is():
    assert native_step.native_module() is not None


def int8_rounding(logits: torch.Tensor) -> torch.Tensor:
    """How far int8's rounding may move `logits` (each call's activations quantised): 2 %
    of their largest, 4 % with fbgemm's 7-bit activations (a CPU without VNNI: a step
    twice as coarse)."""
    return (0.04 if INT8_REDUCE_RANGE else 0.02) * logits.abs().max()


@pytest.mark.parametrize("dtype, atol", [(None, 1e-5), (torch.bfloat16, 1e-4), (INT8, None)])
def test_the_native_step_equals_the_eager_step_along_a_decode(dtype, atol):
    """Gathered ([0, 2, 3]) and sliced ([2, 3]) batches of 1 to 4 rows as the text grows,
    both decodes committing the eager step's greedy tokens. int8 quantises each call's
    activations, so a rounding apart moves a code a step: its logits stay within
    `int8_rounding`."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LiveSpeech2(small_cfg()).eval()
    native = NativeStep(model, matmul_dtype=dtype)
    eager_state, native_state = _state(model), _state(model)
    batches = BATCHES + [[0], [0, 1, 2, 3]]
    with torch.no_grad():
        want = _run(model, eager_state, lambda *a: model.step(*a, matmul_dtype=dtype), batches, whole_state=False)
        got = _run(model, native_state, lambda *a: native(*a, dtype), batches, whole_state=False, tokens=want)
    for a, b in zip(want, got):
        for x, y in ((a.graphemes, b.graphemes), (a.acoustic, b.acoustic)):
            assert y.dtype == torch.float32 and y.shape == x.shape
            tol = atol if atol is not None else int8_rounding(x)
            assert (x - y).abs().max() <= tol
    for name in ("conv", "ssm", "inputs", "step", "ring"):
        a, b = getattr(eager_state, name).float(), getattr(native_state, name).float()
        # with int8, the recurrent state within a rounding of the activations too (7-bit
        # ones: a step is 1/64 of a row's largest)
        tol = (0.02 * a.abs().max() if INT8_REDUCE_RANGE else 1e-4) if dtype == INT8 else 1e-5
        assert (a - b).abs().max() <= tol, name


def test_other_state_and_window_sizes_equal_the_eager_step():
    """A model whose Mamba state and conv window are not the default model's (16, 4), which
    the loops take at run time rather than when compiled."""
    torch.manual_seed(0)
    model = LiveSpeech2(small_cfg(d_state=4, d_conv=3)).eval()
    native = NativeStep(model)
    eager_state, native_state = _state(model), _state(model)
    with torch.no_grad():
        want = _run(model, eager_state, None, BATCHES, whole_state=False)
        got = _run(model, native_state, native, BATCHES, whole_state=False)
    for a, b in zip(want, got):
        assert torch.allclose(a.acoustic, b.acoustic, atol=1e-5) and torch.allclose(a.graphemes, b.graphemes, atol=1e-5)
    assert torch.allclose(eager_state.ssm, native_state.ssm, atol=1e-5)
    assert torch.allclose(eager_state.conv, native_state.conv, atol=1e-5)


def _one_voice_state(model, n=4):
    """n slots speaking one voice, each with its own text and its own recurrent state."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(5)
    st = DecodeState.allocate(model, capacity=n)
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.n_acoustic_codebooks, 12), generator=g)
    kv = enrollment_kv(model, model.encode_enrollment(codes)[0])
    for slot in range(n):
        st.reset_slot(slot, kv)
        text = torch.randint(0, 1000, (3 + 2 * slot,), generator=g).tolist()
        st.append_text(slot, text, [float(i) for i in range(len(text))], chunk=0)
    st.ssm.normal_(generator=g)
    return st, kv


def test_rows_of_one_voice_read_its_enrollment_once_with_the_same_result():
    """`DecodeState.voice` numbers the slots reset with one enrollment tensor alike; the
    native step given those numbers reads the first such row's enrollment memory for
    all, which is the same memory: the same logits and states as each row its own. A
    row whose number is shared but whose enrollment differs would read the wrong one:
    the numbers decide (a row's own memory is not read)."""
    torch.manual_seed(0)
    model = LiveSpeech2(small_cfg()).eval()
    native = NativeStep(model)
    states = [_one_voice_state(model)[0] for _ in range(3)]
    assert len(set(states[0].voice.tolist())) == 1
    slots = [0, 1, 2, 3]
    outs = []
    with torch.no_grad():
        for st, voices in zip(states, (None, torch.from_numpy(states[1].voice), None)):
            view = st.view(slots)
            mask = st.window_mask(view, [0] * 4, [0] * 4)
            if voices is None and st is states[2]:  # rows 1-3 told they speak row 0's voice, with another memory
                st.mem_v[:, 1:, :, :st.n_enroll] += 1.0
                out = native(view.inputs, view.step, view, mask, voices=torch.zeros(4, dtype=torch.long))
            else:
                out = native(view.inputs, view.step, view, mask, voices=voices)
            outs.append(out)
    assert torch.equal(outs[0].acoustic, outs[1].acoustic) and torch.equal(outs[0].graphemes, outs[1].graphemes)
    assert torch.equal(states[0].ssm, states[1].ssm)
    assert torch.equal(outs[2].acoustic, outs[0].acoustic)  # row 0's memory read for all: unchanged result


def test_a_voice_number_follows_the_tensor_not_its_address():
    """Slots reset with one tensor share a number, with another tensor they do not, and a
    tensor made after the first is gone (possibly at its address) gets a new one."""
    torch.manual_seed(0)
    model = LiveSpeech2(small_cfg()).eval()
    st, kv = _one_voice_state(model, n=4)
    other = kv.clone()
    st.reset_slot(1, other)
    assert st.voice[0] == st.voice[2] != st.voice[1]
    first = int(st.voice[1])
    del other
    for _ in range(3):
        again = kv.clone()  # often at the freed tensor's address
        st.reset_slot(3, again)
        assert st.voice[3] not in (first, st.voice[0])
        first = int(st.voice[3])
        del again


def test_with_a_phone_input_and_with_no_visible_text():
    torch.manual_seed(0)
    model = LiveSpeech2(small_cfg(n_phones=5)).eval()
    torch.nn.init.normal_(model.phone_emb.weight)
    native = NativeStep(model)
    phones = torch.tensor([4, -1, 0])
    for mask in (torch.ones(3, 2, dtype=torch.bool), torch.zeros(3, 0, dtype=torch.bool)):
        states = _state(model), _state(model)
        with torch.no_grad():
            outs = []
            for st, step in zip(states, (model.step, native)):
                view = st.view([0, 2, 3])
                outs.append(step(view.inputs, view.step, view, mask, phones=phones))
        assert torch.allclose(outs[0].acoustic, outs[1].acoustic, atol=1e-5)
        assert torch.allclose(outs[0].graphemes, outs[1].graphemes, atol=1e-5)
        assert torch.allclose(states[0].ssm, states[1].ssm, atol=1e-5)


@pytest.mark.parametrize("where", ["ssm", "mem_k"])
@pytest.mark.parametrize("dtype", [None, INT8])
def test_a_non_finite_row_fails_alone(dtype, where):
    """A session whose recurrent state or voice (its enrollment memory) went NaN gets
    non-finite logits; the other rows of its batch step as they would without it (int8:
    each row scaled on its own before fbgemm's one quantisation a call, a non-finite row
    as zeros, so the others move by its rounding only: `int8_rounding`)."""
    torch.manual_seed(0)
    model = LiveSpeech2(small_cfg()).eval()
    native = NativeStep(model, matmul_dtype=dtype)
    states = _state(model), _state(model)
    getattr(states[1], where)[:, 2] = float("nan")
    outs = []
    with torch.no_grad():
        for st in states:
            view = st.view([0, 2, 3])
            mask = st.window_mask(view, [0] * 3, [0] * 3)
            outs.append(native(view.inputs, view.step, view, mask, dtype))
    assert not torch.isfinite(outs[1].acoustic[1]).any()
    for row in (0, 2):
        assert torch.isfinite(outs[1].acoustic[row]).all()
        tol = 1e-5 if dtype is None else int8_rounding(outs[0].acoustic[row])
        assert (outs[0].acoustic[row] - outs[1].acoustic[row]).abs().max() <= tol


def test_the_runner_steps_natively_unless_told_not_to_or_where_it_cannot_be_built(monkeypatch, caplog):
    from livespeech.models.loading import load_bundle
    from livespeech.models.step_graph import FrozenStep
    from livespeech.server.runner import ModelRunner

    bundle = load_bundle(random_init=True)
    runner = ModelRunner(bundle, 2)
    assert runner.native and runner.frozen and isinstance(runner.model_step, NativeStep)
    assert runner.model_step_runtime == "native"
    assert isinstance(ModelRunner(bundle, 2, native_step=False).model_step, FrozenStep)
    assert ModelRunner(bundle, 2, frozen_step=False).model_step == bundle.model.step
    monkeypatch.setattr(native_step, "native_module", lambda: None)
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner(bundle, 2)
    assert isinstance(runner.model_step, FrozenStep) and not runner.native
    assert "native step failed" in caplog.text


def test_the_runner_passes_each_rows_voice(monkeypatch):
    """Through the runner, sessions of one voice are stepped with one voice number and
    sessions of another with theirs; the tokens equal those of the frozen graph's step."""
    from livespeech.models.guidance import GuidanceState
    from livespeech.models.loading import load_bundle
    from livespeech.server.runner import ModelRunner

    bundle = load_bundle(random_init=True)
    seen, call = [], NativeStep.__call__
    monkeypatch.setattr(NativeStep, "__call__", lambda self, *a, **k: (seen.append(k.get("voices")), call(self, *a, **k))[1])
    results = []
    for native in (True, False):
        rng = np.random.default_rng(0)
        runner = ModelRunner(bundle, 4, native_step=native, matmul_weights="float32")
        voices = [runner.make_voice(v, (rng.standard_normal(24000) * 0.1).astype(np.float32), 24000)
                  for v in ("a", "b")]
        for s, v in enumerate((0, 1, 0, 0)):
            runner.admit(s, voices[v], seed=s)
            runner.add_chunk(s, list(range(100, 110)), 0, 0)
        out = runner.step([0, 1, 2, 3], [(0, 0)] * 4, [GuidanceState() for _ in range(4)], [False] * 4)
        results.append(np.concatenate((out.grapheme[:, None], out.frames), 1))
    assert len(seen) == 1  # the frozen graph's runner took no voices
    v = seen[0].tolist()
    assert v[0] == v[2] == v[3] != v[1]
    assert np.array_equal(results[0], results[1])
