"""models/mamba.py: custom selective scan, forward/step equivalence, mamba-ssm compatibility."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from livespeech.models import mamba
from livespeech.models.mamba import MambaBlock, make_mamba, scan_tiling, selective_scan


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def naive_scan(u, delta, A, B, C, D=None, z=None):
    """Reference: the recurrence written step by step, differentiated by autograd."""
    b, T, d = u.shape
    h = u.new_zeros(b, d, A.shape[1])
    ys = []
    for t in range(T):
        dBu = (delta[:, t] * u[:, t])[:, :, None] * B[:, t, None, :]
        h = torch.exp(delta[:, t, :, None] * A) * h + dBu
        ys.append((h * C[:, t, None, :]).sum(-1))
    y = torch.stack(ys, 1)
    if D is not None:
        y = y + D * u
    if z is not None:
        y = y * F.silu(z)
    return y


def naive_block(m: MambaBlock, x):
    """MambaBlock.forward built from nn modules and naive_scan (no custom kernels)."""
    T = x.shape[1]
    u, z = m.in_proj(x).chunk(2, -1)
    u = F.silu(m.conv1d(u.transpose(1, 2))[..., :T]).transpose(1, 2)
    dt, B, C = m.x_proj(u).split([m.dt_rank, m.d_state, m.d_state], -1)
    y = naive_scan(u, F.softplus(m.dt_proj(dt)), -torch.exp(m.A_log), B, C, m.D, z)
    return m.out_proj(y)


def scan_inputs(b, T, d, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return [r(b, T, d), F.softplus(r(b, T, d)), -torch.exp(r(d, n)), r(b, T, n), r(b, T, n),
            r(d), r(b, T, d)]


def run_steps(m, x, three_d=False):
    """Decode x [B, T, D] frame by frame from a zero cache with m.step (ours or mamba-ssm's)."""
    conv_state, ssm_state = m.allocate_inference_cache(x.shape[0], x.shape[1])
    outs = []
    for t in range(x.shape[1]):
        xt = x[:, t : t + 1] if three_d else x[:, t]
        out, c, s = m.step(xt, conv_state, ssm_state)
        assert c is conv_state and s is ssm_state
        outs.append(out[:, 0] if three_d else out)
    return torch.stack(outs, 1), conv_state, ssm_state


def test_state_dict_names_and_shapes_match_mamba_ssm():
    m = MambaBlock(256, d_state=16, d_conv=4, expand=2)
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes == {
        "A_log": (512, 16),
        "D": (512,),
        "in_proj.weight": (1024, 256),
        "conv1d.weight": (512, 1, 4),
        "conv1d.bias": (512,),
        "x_proj.weight": (48, 512),
        "dt_proj.weight": (512, 16),
        "dt_proj.bias": (512,),
        "out_proj.weight": (256, 512),
    }


def test_init_follows_mamba_ssm():
    torch.manual_seed(0)
    m = MambaBlock(64, d_state=8, dt_min=0.001, dt_max=0.1)
    assert torch.equal(m.A_log, torch.log(torch.arange(1, 9, dtype=torch.float32)).repeat(128, 1))
    assert torch.equal(m.D, torch.ones(128))
    assert m.A_log._no_weight_decay and m.D._no_weight_decay and m.dt_proj.bias._no_reinit
    dt = F.softplus(m.dt_proj.bias)
    assert dt.min() >= 0.001 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)
    assert m.dt_proj.weight.abs().max() <= m.dt_rank ** -0.5
    assert m.dt_rank == math.ceil(64 / 16)


@pytest.mark.parametrize("with_dz", [True, False])
def test_scan_gradcheck(with_dz, monkeypatch):
    u, delta, A, B, C, D, z = (t.requires_grad_() for t in scan_inputs(2, 7, 4, 3, torch.float64))
    if not with_dz:
        D = z = None
    # several chunks with a short last one, one batch row per tile; then a single block
    for chunk, tile_elems in ((3, 12), (16, 1 << 16)):
        monkeypatch.setitem(mamba._TILING, "cpu", (tile_elems, 1 << 19, 32))
        fn = lambda *a: selective_scan(*a, chunk_size=chunk)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (u, delta, A, B, C, D, z))


@pytest.mark.parametrize("chunk,tile_elems",
                         [(1, 1 << 16), (5, 1 << 16), (64, 1 << 16), (None, 60), (7, 60)])
def test_scan_matches_naive_autograd(chunk, tile_elems, monkeypatch):
    monkeypatch.setitem(mamba._TILING, "cpu", (tile_elems, 1 << 19, 32))  # 60 / (n*d = 30): 2-row tiles of 5
    ins = [t.requires_grad_() for t in scan_inputs(5, 45, 6, 5, torch.float64, seed=1)]
    y, y_ref = selective_scan(*ins, chunk_size=chunk), naive_scan(*ins)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    dy = torch.randn_like(y)
    for g, g_ref in zip(torch.autograd.grad(y, ins, dy), torch.autograd.grad(y_ref, ins, dy)):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-9)


def test_scan_tiles_cpu_batches_for_the_cache_and_cuda_batches_whole():
    state = 16 * 512  # n * d_inner of the default model
    L, bt = scan_tiling(256, state, torch.device("cpu"))
    assert bt * state <= 1 << 16 and 4 <= L <= 32
    L, bt = scan_tiling(256, state, torch.device("cuda"))  # a training batch: one kernel per step
    assert bt == 256 and L == 64
    assert scan_tiling(256, state, torch.device("cuda"), chunk_size=16) == (16, 256)


def test_block_gradients_match_naive_block():
    torch.manual_seed(0)
    m = MambaBlock(16, d_state=4, chunk_size=8).double()
    x = torch.randn(2, 21, 16, dtype=torch.float64, requires_grad=True)
    params = [x, *m.parameters()]
    y, y_ref = m(x), naive_block(m, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    dy = torch.randn_like(y)
    for g, g_ref in zip(torch.autograd.grad(y, params, dy), torch.autograd.grad(y_ref, params, dy)):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("T,chunk", [(53, 16), (29, 8), (1, 16), (3, 64)])
def test_forward_equals_stepwise_decode(T, chunk):
    torch.manual_seed(T)
    m = MambaBlock(32, chunk_size=chunk)
    x = torch.randn(3, T, 32)
    with torch.inference_mode():
        y = m(x)
        y_steps, conv_state, ssm_state = run_steps(m, x)
        y_steps3, _, _ = run_steps(m, x, three_d=True)
    assert (y - y_steps).abs().max() < 1e-5
    assert torch.equal(y_steps, y_steps3)
    # conv_state holds the last d_conv conv inputs, newest last (zero-padded before t=0)
    xin = F.linear(x, m.in_proj.weight)[..., : m.d_inner]
    expect = F.pad(xin.transpose(1, 2), (m.d_conv, 0))[..., -m.d_conv :]
    torch.testing.assert_close(conv_state, expect)
    assert ssm_state.abs().sum() > 0


def test_step_updates_caller_state_in_place():
    torch.manual_seed(0)
    m = MambaBlock(32)
    conv_state, ssm_state = m.allocate_inference_cache(4, max_seqlen=10)
    assert conv_state.shape == (4, 64, 4) and ssm_state.shape == (4, 64, 16)
    assert not conv_state.any() and not ssm_state.any()
    ptrs = conv_state.data_ptr(), ssm_state.data_ptr()
    x = torch.randn(4, 32)
    with torch.inference_mode():
        a, _, _ = m.step(x, conv_state, ssm_state)
        # rows are independent sessions: resetting row 1 makes it replay its first step
        conv_state[1].zero_()
        ssm_state[1].zero_()
        b, _, _ = m.step(x, conv_state, ssm_state)
    assert (conv_state.data_ptr(), ssm_state.data_ptr()) == ptrs
    torch.testing.assert_close(b[1], a[1])
    assert not torch.allclose(b[0], a[0])


def test_step_with_non_contiguous_conv_state():
    torch.manual_seed(0)
    m = MambaBlock(32)
    x = torch.randn(2, 9, 32)
    with torch.inference_mode():
        y_ref, conv_ref, _ = run_steps(m, x)
        conv_state = m.allocate_inference_cache(2)[0].transpose(0, 1).contiguous().transpose(0, 1)
        ssm_state = m.allocate_inference_cache(2)[1]
        assert not conv_state.is_contiguous()
        ys = [m.step(x[:, t], conv_state, ssm_state)[0] for t in range(9)]
    torch.testing.assert_close(torch.stack(ys, 1), y_ref)
    torch.testing.assert_close(conv_state, conv_ref)


def test_make_mamba_falls_back_to_pure_torch_and_shares_state_dict():
    a = make_mamba(64, d_state=8, layer_idx=3)
    assert type(a) is MambaBlock and a.layer_idx == 3 and a.d_state == 8
    b = make_mamba(64, d_state=8, prefer_cuda_kernels=False, dt_max=0.2)
    assert type(b) is MambaBlock
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 5, 64)
    torch.testing.assert_close(a(x), b(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mamba-ssm kernels need CUDA")
def test_parity_with_mamba_ssm():
    mamba_ssm = pytest.importorskip("mamba_ssm")
    torch.manual_seed(0)
    ours = MambaBlock(64, layer_idx=0)
    theirs = make_mamba(64, layer_idx=0, device="cuda")
    assert isinstance(theirs, mamba_ssm.Mamba)
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 37, 64)

    y_ours = ours(x)
    y_theirs = theirs(x.cuda())
    torch.testing.assert_close(y_theirs.cpu(), y_ours, rtol=1e-3, atol=1e-4)
    dy = torch.randn_like(y_ours)
    y_ours.backward(dy)
    y_theirs.backward(dy.cuda())
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(theirs_params[name].grad.cpu(), p.grad, rtol=1e-3, atol=1e-4,
                                   msg=name)

    with torch.inference_mode():
        steps_ours, _, _ = run_steps(ours, x, three_d=True)
        steps_theirs, _, _ = run_steps(theirs, x.cuda(), three_d=True)
    torch.testing.assert_close(steps_theirs.cpu(), steps_ours, rtol=1e-3, atol=1e-4)


_TRITON_CHECK = """
import torch
from livespeech.models.mamba import MambaBlock
from livespeech.models.mamba_triton import check_against_torch, use_triton_scan
errs = [check_against_torch('cpu', b=2, T=9, d=40, n=16), check_against_torch('cpu', b=1, T=5, d=32, n=8, seed=3)]
torch.manual_seed(0)
block = MambaBlock(24, d_state=16)
x = torch.randn(2, 7, 24, requires_grad=True)
outs = []
for triton_scan in (False, True):
    if triton_scan:
        assert use_triton_scan(block) == 1
    y = block(x)
    outs.append([y.detach(), *torch.autograd.grad(y.square().sum(), [x, *block.parameters()])])
errs += [float((b - a).norm() / a.norm()) for a, b in zip(*outs)]
print(max(errs))
"""


def test_the_triton_scan_matches_the_pytorch_scan_under_tritons_interpreter():
    """models/mamba_triton.py's kernels (training on CUDA) against models/mamba.py's scan,
    output and gradients, run by Triton's interpreter on the CPU; alone and inside a block."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _TRITON_CHECK], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split()[-1]) < 1e-5
