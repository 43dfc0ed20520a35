"""The compiled CPU attention over the text memory (models/cpu_attention.py) against
torch's attention on the same memory, in float32 and in bfloat16, and in the step."""
import math

import pytest
import torch

from livespeech.models import compiled, cpu_attention
from livespeech.models.attention import CrossAttention, rope_angles, rope_query_matrix

pytestmark = pytest.mark.skipif(not compiled.available(), reason="numba is not installed")

B, H, HD, N_ENROLL = 5, 4, 16, 6


def _memory(text: int, capacity: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, H, capacity, 2 hd] keys in the step's layout (enrollment keys in the first half,
    text keys in the second, zeros elsewhere) and [B, H, capacity, hd] values; the first
    N_ENROLL + text slots filled, the rest left as a server leaves unused slots."""
    g = torch.Generator().manual_seed(seed)
    k = torch.zeros(B, H, capacity, 2 * HD)
    k[:, :, :N_ENROLL, :HD] = torch.randn(B, H, N_ENROLL, HD, generator=g)
    k[:, :, N_ENROLL:N_ENROLL + text, HD:] = torch.randn(B, H, text, HD, generator=g)
    v = torch.randn(B, H, capacity, HD, generator=g)
    return k, v


def _window_bias(m: int, seed: int = 1) -> torch.Tensor:
    """[B, 1, 1, m]: enrollment keys visible, each row's text keys masked at random (one
    row with none visible)."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.zeros(B, 1, 1, m)
    bias[:, 0, 0, N_ENROLL:].masked_fill_(torch.rand(B, m - N_ENROLL, generator=g) < 0.5, float("-inf"))
    bias[0, 0, 0, N_ENROLL:] = float("-inf")
    return bias


def _reference(q2: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The definition, in float64: softmax(q2 . k / sqrt(hd) + bias) v, every key whole."""
    s = torch.einsum("bhd,bhmd->bhm", q2.double(), k.double()) / math.sqrt(HD) + bias[:, 0].double()
    return torch.einsum("bhm,bhmd->bhd", s.softmax(-1), v.double()).reshape(B, -1)


@pytest.mark.parametrize("dtype", cpu_attention.READS)
@pytest.mark.parametrize("text", [0, 1, 9])
def test_the_loop_equals_the_attention_it_replaces(dtype, text):
    """Every session's output is softmax(scale q2 . k + bias) v over its keys, whichever
    half of a key holds it, with the window's masked keys out, read from a view of the
    memory's first slots (the step's slicing) in float32 or bfloat16."""
    k, v = _memory(text, capacity=N_ENROLL + text + 7)
    m = N_ENROLL + text
    # the second layer of a state's memory: a storage offset, then the key axis sliced
    k, v = (torch.stack((torch.full_like(t, 9.0), t)).to(dtype)[1, :, :, :m] for t in (k, v))
    assert not k.is_contiguous() and k.storage_offset() > 0
    q2 = torch.randn(B, H, 2 * HD, generator=torch.Generator().manual_seed(2))
    bias = _window_bias(m)
    assert cpu_attention.applies(k, v)
    got = torch.ops.livespeech.memory_attention(q2, k, v, bias, N_ENROLL, 1 / math.sqrt(HD))
    want = _reference(q2, k.float(), v.float(), bias)  # the memory as stored (rounded, in bf16)
    assert got.dtype == torch.float32 and got.shape == (B, H * HD)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_key_is_read_from_its_own_half():
    """An enrollment key's second half and a text key's first half are not read: filled
    with garbage there, the output stays as with zeros (the layout's promise)."""
    k, v = _memory(5, capacity=N_ENROLL + 5)
    bias = torch.zeros(B, 1, 1, N_ENROLL + 5)
    q2 = torch.randn(B, H, 2 * HD, generator=torch.Generator().manual_seed(3))
    clean = torch.ops.livespeech.memory_attention(q2, k, v, bias, N_ENROLL, 0.25)
    dirty = k.clone()
    dirty[:, :, :N_ENROLL, HD:] = 1e3
    dirty[:, :, N_ENROLL:, :HD] = -1e3
    torch.testing.assert_close(torch.ops.livespeech.memory_attention(q2, dirty, v, bias, N_ENROLL, 0.25), clean,
                               rtol=0, atol=0)
    # and torch's attention, which reads keys whole, sees the garbage: the check can fail
    assert not torch.allclose(_reference(q2, dirty, v, bias).float(), clean, atol=1e-3)


@pytest.mark.parametrize("dtype", cpu_attention.READS)
def test_attend_step_takes_the_loop_where_it_applies(dtype):
    """`CrossAttention.attend_step` with n_enroll (the model step's call) equals the torch
    attention it replaces on the same memory, and outside the loop's reach (numba missing)
    the torch attention runs."""
    torch.manual_seed(0)
    attn = CrossAttention(H * HD, H).eval()
    k, v = _memory(9, capacity=N_ENROLL + 12)
    k, v = k.to(dtype)[:, :, :N_ENROLL + 9], v.to(dtype)[:, :, :N_ENROLL + 9]
    x = torch.randn(B, H * HD)
    q_rope = rope_query_matrix(*rope_angles(torch.arange(B) * 7.0, HD, 10_000.0))
    bias = _window_bias(N_ENROLL + 9)
    with torch.no_grad():
        looped = attn.attend_step(x, q_rope, k, v, bias.to(dtype), n_enroll=N_ENROLL)
        plain = attn.attend_step(x, q_rope, k.float(), v.float(), bias)
    torch.testing.assert_close(looped, plain, rtol=1e-5, atol=1e-5)


def test_without_numba_the_attention_runs_as_torch_ops(monkeypatch):
    monkeypatch.setattr(compiled, "numba", None)
    k, v = _memory(3, capacity=N_ENROLL + 3)
    assert not cpu_attention.applies(k, v) and not cpu_attention.runs_on(torch.device("cpu"))


def test_the_frozen_step_calls_the_loop():
    """The op is recorded by the trace and kept by the freeze: the frozen step on a
    bfloat16 memory runs it, and equals the eager step."""
    from livespeech.models.inference import DecodeState
    from livespeech.models.livespeech import LiveSpeech2
    from livespeech.models.config import preset
    from livespeech.models.step_graph import FrozenStep

    torch.manual_seed(0)
    model = LiveSpeech2(preset("micro")).eval()
    state = DecodeState.allocate(model, capacity=3, memory_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    state.mem_k.copy_(torch.randn(state.mem_k.shape, generator=g))
    state.mem_v.copy_(torch.randn(state.mem_v.shape, generator=g))
    frozen = FrozenStep(model, memory_dtype=torch.bfloat16)
    graph = next(iter(frozen.graphs.values()))
    assert "livespeech::memory_attention" in str(graph.graph)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    inputs, frame = state.inputs.clone(), torch.tensor([0, 3, 11])
    view = state.view(range(3))
    kept = [t.clone() for t in (view.conv, view.ssm)]
    with torch.inference_mode():
        eager = model.step(inputs, frame, view, mask)
        view.conv.copy_(kept[0]), view.ssm.copy_(kept[1])
        out = frozen(inputs, frame, view, mask)
    torch.testing.assert_close(out.acoustic, eager.acoustic, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.graphemes, eager.graphemes, rtol=1e-4, atol=1e-4)


def test_the_model_step_is_the_same_with_the_loop():
    """`LiveSpeech2.step` on a float32 memory, every layer's attention through the loop
    against torch's attention: the same logits (a model of three layers, the state's
    later layers at offsets in its memory, a batch of gathered rows)."""
    from livespeech.models.config import preset
    from livespeech.models.inference import DecodeState
    from livespeech.models.livespeech import LiveSpeech2

    torch.manual_seed(0)
    model = LiveSpeech2(preset("micro")).eval()
    mask = torch.rand(3, 6, generator=torch.Generator().manual_seed(5)) < 0.6
    outs = []
    for on in (True, False):
        state = DecodeState.allocate(model, capacity=4)
        keys = torch.randn(state.mem_k.shape, generator=torch.Generator().manual_seed(6))
        e, hd = model.cfg.n_enroll, state.mem_k.shape[-1] // 2
        keys[:, :, :, :e, hd:] = 0  # the step's layout: each key in its own half
        keys[:, :, :, e:, :hd] = 0
        state.mem_k.copy_(keys)
        state.mem_v.copy_(torch.randn(state.mem_v.shape, generator=torch.Generator().manual_seed(7)))
        view = state.view([0, 2, 3])
        with pytest.MonkeyPatch.context() as mp, torch.inference_mode():
            if not on:
                mp.setattr(cpu_attention, "applies", lambda mem_k, mem_v: False)
            outs.append(model.step(state.inputs[:3], torch.tensor([1, 4, 9]), view, mask))
    torch.testing.assert_close(outs[0].acoustic, outs[1].acoustic, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0].graphemes, outs[1].graphemes, rtol=1e-5, atol=1e-5)
