"""The captured decode step (models/step_graph.py): stepping a batch of slots over the
whole state equals the eager step of those slots alone, and leaves every other slot as
it was. On the CPU it runs eagerly (capture=False); the recording itself needs CUDA."""
import copy

import numpy as np
import pytest
import torch

from models.inference import DecodeState, enrollment_kv
from models.livespeech import LiveSpeech2
from models.step_graph import CapturedStep
from tests.test_livespeech import small_cfg


def _state(model, device="cpu"):
    """Four slots: 0, 2 and 3 hold sessions with their own voices and text; 1 is free."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(3)
    st = DecodeState.allocate(model, capacity=4, device=device)
    for slot in (0, 2, 3):
        codes = torch.randint(0, cfg.codebook_size, (1, cfg.n_acoustic_codebooks, 12), generator=g).to(device)
        st.reset_slot(slot, enrollment_kv(model, model.encode_enrollment(codes)[0]))
        text = torch.randint(0, 1000, (5 + slot,), generator=g).tolist()
        st.append_text(slot, text, [float(i) for i in range(len(text))], chunk=0)
    return st


def _run(model, st, step_fn, batches):
    """Steps `batches` (lists of slots) in turn; each step's greedy tokens are committed.
    Returns the logits of every step."""
    outs = []
    for slots in batches:
        view = st.view(slots, skip=("conv", "ssm", "mem_k", "mem_v") if step_fn else ())
        mask = st.window_mask(view, [0] * len(slots), [0] * len(slots))
        out = step_fn(slots, view.inputs, view.step, mask) if step_fn else model.step(view.inputs, view.step, view, mask)
        tok = torch.cat((out.graphemes.argmax(-1, keepdim=True), out.acoustic.argmax(-1)), 1)
        st.commit(view, tok)
        st.write_back(view)
        outs.append(out)
    return outs


# non-contiguous batches, a slot left out now and then, the free slot never stepped
BATCHES = [[0, 2, 3], [0, 3], [2], [0, 2, 3], [3, 0], [2, 3]]


def _check(device, capture):
    torch.manual_seed(0)
    model = LiveSpeech2(small_cfg(), device=device).to(device).eval()
    eager_state, graph_state = _state(model, device), _state(model, device)
    with torch.no_grad():
        want = _run(model, eager_state, None, BATCHES)
        got = _run(model, graph_state, CapturedStep(model, graph_state, capture=capture), BATCHES)
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


def test_engine_with_the_whole_state_step_speaks():
    """The engine on `cuda_graphs` (eager here): two concurrent sessions finish with their
    audio, and one session's audio equals the plain engine's for the same seed."""
    from server.engine import Engine, EngineConfig
    from server.session_api import AudioPacket, Finished, SessionConfig
    from models.loading import load_bundle
    from tests.test_engine import HARD, Collector

    torch.set_num_threads(1)
    audio = {}
    for graphs in (False, True):
        eng = Engine(load_bundle(random_init=True), EngineConfig(max_sessions=3, low_water_steps=0, cuda_graphs=graphs))
        eng.start()
        try:
            v = eng.make_voice("t", (np.random.default_rng(0).standard_normal(24000) * 0.1).astype(np.float32), 24000)
            cs = []
            for text in ("The first of two voices.", "And here is the second one."):
                c = Collector()
                h = eng.open_session(SessionConfig(**{**HARD, "seed": 5}, start_future_chunks=2), v, c)
                h.push_text(text)
                h.end_input()
                cs.append(c)
            assert all(c.done.wait(120) for c in cs)
        finally:
            eng.stop()
        assert all(c.of(Finished) for c in cs)
        audio[graphs] = [np.frombuffer(b"".join(p.data for p in c.of(AudioPacket)), dtype="<i2").astype(int) for c in cs]
    for plain, graphed in zip(audio[False], audio[True]):
        assert len(plain) == len(graphed) and np.abs(plain - graphed).max() <= 2
