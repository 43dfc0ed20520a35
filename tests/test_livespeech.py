"""The LiveSpeech 2 decoder: teacher-forced forward == recurrent step, Eq. 1's RoPE
cross-attention, the np/nf window, the delay pattern and the batched decode state."""
import math

import pytest
import torch

from livespeech.models import graphemes
from livespeech.models.attention import (CrossAttention, apply_rope, current_chunk, rope_angles,
                              streaming_dropout_mask, window_chunk_range)
from livespeech.models.config import ModelConfig, preset
from livespeech.models.delay import build_delayed, undelay
from livespeech.models.inference import DecodeState, enrollment_kv
from livespeech.models.livespeech import CodebookLossWeights, LiveSpeech2, codebook_losses


def small_cfg(**kw):
    base = dict(d_model=64, n_shared_layers=2, n_group_layers=1, codebook_groups=(3, 2),
                n_acoustic_codebooks=4, codebook_size=32, n_heads=4, n_enroll=4,
                enc_d_model=32, enc_layers=1, enc_heads=2, max_text_tokens=12)
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LiveSpeech2(small_cfg()).eval()


def random_example(cfg, t=20, l=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    acoustic = torch.randint(0, cfg.codebook_size, (1, cfg.n_acoustic_codebooks, t), generator=g)
    graph = torch.randint(graphemes.SPACE, cfg.n_graphemes, (1, 1, t + 1), generator=g)
    graph[0, 0, t] = graphemes.EOS
    codes = torch.cat((graph, torch.cat((acoustic, acoustic[:, :, -1:]), 2)), 1)
    last = torch.tensor([[t] + [t - 1] * cfg.n_acoustic_codebooks])
    text = torch.randint(0, 1000, (1, l), generator=g)
    pos = torch.tensor([[0.0, 1, 2, 7, 8, 15]])[:, :l]
    return codes, last, text, pos


def teacher_forced_example(model):
    """(inputs, targets, enrollment, text, positions, mask) of `random_example`, delayed."""
    cfg = model.cfg
    codes, last, text, pos = random_example(cfg)
    inputs, targets, _ = build_delayed(codes, last, cfg.delays, model.none_ids())
    enroll = model.encode_enrollment(torch.randint(0, cfg.codebook_size, (1, cfg.n_acoustic_codebooks, 30)))
    return inputs, targets, enroll, text, pos, torch.ones(1, text.shape[1], dtype=torch.bool)


def test_presets_validate():
    paper = preset("paper")
    assert paper.n_codebooks == 17 and paper.codebook_groups == (4, 4, 4, 5)
    assert paper.memory_size == 64 + 75 and paper.text_vocab_size == 51_867
    with pytest.raises(ValueError):
        ModelConfig(codebook_groups=(4, 4))
    with pytest.raises(ValueError):
        preset("nope")


def test_forward_equals_recurrent_step(model):
    inputs, targets, enroll, text, pos, mask = teacher_forced_example(model)
    with torch.no_grad():
        full = model(inputs, enroll, text, pos, mask)
        state = DecodeState.allocate(model, capacity=3)
        slot = 1
        state.reset_slot(slot, enrollment_kv(model, enroll[0]))
        state.append_text(slot, text[0].tolist(), pos[0].tolist(), chunk=0)
        for s in range(inputs.shape[2]):
            view = state.view([slot])
            view.inputs.copy_(inputs[:, :, s])
            m = state.window_mask(view, [0], [0])
            out = model.step(view.inputs, view.step, view, m)
            state.commit(view, targets[:, :, s])
            assert torch.allclose(out.graphemes, full[0][:, s], atol=1e-4)
            for k in range(model.cfg.n_acoustic_codebooks):
                assert torch.allclose(out.acoustic[:, k], full[k + 1][:, s], atol=1e-4)


def test_with_a_phone_input_forward_equals_recurrent_step_and_the_phone_counts():
    torch.manual_seed(0)
    model = LiveSpeech2(small_cfg(n_phones=5)).eval()
    torch.nn.init.normal_(model.phone_emb.weight)  # zero as built: give the phones an effect
    inputs, targets, enroll, text, pos, mask = teacher_forced_example(model)
    phones = torch.randint(-1, 5, (1, inputs.shape[2]), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(inputs, enroll, text, pos, mask, phones=phones)
        other = model(inputs, enroll, text, pos, mask, phones=(phones + 1) % 5)
        assert not torch.allclose(full[1], other[1], atol=1e-3)
        with pytest.raises(ValueError, match="pass phones"):
            model(inputs, enroll, text, pos, mask)
        state = DecodeState.allocate(model, capacity=1)
        state.reset_slot(0, enrollment_kv(model, enroll[0]))
        state.append_text(0, text[0].tolist(), pos[0].tolist(), chunk=0)
        for s in range(inputs.shape[2]):
            view = state.view([0])
            view.inputs.copy_(inputs[:, :, s])
            out = model.step(view.inputs, view.step, view, state.window_mask(view, [0], [0]), phones=phones[:, s])
            state.commit(view, targets[:, :, s])
            assert torch.allclose(out.acoustic[:, 0], full[1][:, s], atol=1e-4)


def test_a_phone_input_added_to_a_trained_decoder_starts_with_no_effect(model):
    grown = LiveSpeech2(small_cfg(n_phones=5)).eval()
    missing, unexpected = grown.load_state_dict(model.state_dict(), strict=False)
    assert missing == ["phone_emb.weight"] and not unexpected
    inputs, _, enroll, text, pos, mask = teacher_forced_example(model)
    with torch.no_grad():
        a = model(inputs, enroll, text, pos, mask)
        b = grown(inputs, enroll, text, pos, mask, phones=torch.randint(-1, 5, inputs.shape[::2]))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_gathered_view_equals_slice(model):
    """A gathered view (slots 0 and 2) steps as a slice of the same sessions does, its
    memory gathered only up to the slots the step reads (`memory_slots`, as the runner
    gathers it), and its state goes back to its slots."""
    cfg = model.cfg
    enroll = model.encode_enrollment(torch.randint(0, cfg.codebook_size, (2, cfg.n_acoustic_codebooks, 10)))
    st = DecodeState.allocate(model, capacity=4)
    for slot, e in zip((0, 2), enroll):
        st.reset_slot(slot, enrollment_kv(model, e))
        st.append_text(slot, [5, 6, 7], [0, 1, 2], chunk=0)
    ref = DecodeState.allocate(model, capacity=2)
    for slot, e in zip((0, 1), enroll):
        ref.reset_slot(slot, enrollment_kv(model, e))
        ref.append_text(slot, [5, 6, 7], [0, 1, 2], chunk=0)
    with torch.no_grad():
        for _ in range(5):
            v1, v2 = st.view([0, 2], memory_slots=cfg.n_enroll + 3), ref.view([0, 1])
            assert v1.mem_k.shape[3] == cfg.n_enroll + 3 < st.mem_k.shape[3]
            o1 = model.step(v1.inputs, v1.step, v1, st.window_mask(v1, [0, 0], [0, 0])[:, :3])
            o2 = model.step(v2.inputs, v2.step, v2, ref.window_mask(v2, [0, 0], [0, 0]))
            assert torch.allclose(o1.acoustic, o2.acoustic, atol=1e-5)
            tok = torch.cat((o2.graphemes.argmax(-1, keepdim=True), o2.acoustic.argmax(-1)), 1)
            st.commit(v1, tok)
            ref.commit(v2, tok)
            st.write_back(v1)
    assert torch.equal(st.step[[0, 2]], ref.step) and st.step[1] == 0
    assert torch.allclose(st.ssm[:, [0, 2]], ref.ssm, atol=1e-6)
    assert torch.allclose(st.mem_k[:, [0, 2]], ref.mem_k)


def test_rope_relative_shift_invariance():
    torch.manual_seed(0)
    att = CrossAttention(32, 4)
    x = torch.randn(2, 5, 32)
    enr = att.project_memory(torch.randn(2, 3, 32))
    txt = att.project_memory(torch.randn(2, 7, 32))
    qpos = torch.arange(5).repeat(2, 1).float() + 10
    kpos = torch.tensor([[0, 1, 2, 9, 10, 11, 30]] * 2).float()
    mask = torch.ones(2, 7, dtype=torch.bool)
    a = att.attend(x, qpos, *enr, *txt, kpos, mask)
    b = att.attend(x, qpos + 123, *enr, *txt, kpos + 123, mask)
    assert torch.allclose(a, b, atol=1e-4)
    # not invariant to shifting the text alone: positions matter
    c = att.attend(x, qpos, *enr, *txt, kpos + 40, mask)
    assert not torch.allclose(a, c, atol=1e-3)


def test_rope_is_a_rotation():
    x = torch.randn(3, 8)
    cos, sin = rope_angles(torch.tensor([0.0, 5.0, 100.0]), 8, 10_000.0)
    y = apply_rope(x, cos, sin)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(y[0], x[0])


def test_the_query_rotation_as_a_matrix_is_the_rotation():
    """A step's query, [q ; RoPE(q)], as one matmul with the frame's `rope_query_matrix`."""
    from livespeech.models.attention import rope_query_matrix

    q = torch.randn(3, 4, 16)  # [B, H, hd]
    cos, sin = rope_angles(torch.tensor([0.0, 7.0, 4321.0]), 16, 10_000.0)
    want = torch.cat((q, apply_rope(q, cos[:, None], sin[:, None])), dim=-1)
    assert torch.allclose(torch.bmm(q, rope_query_matrix(cos, sin)), want, atol=1e-5)


def test_enrollment_keys_are_not_rotated():
    torch.manual_seed(0)
    att = CrossAttention(16, 2)
    x = torch.randn(1, 1, 16)
    enr = att.project_memory(torch.randn(1, 3, 16))
    txt = att.project_memory(torch.randn(1, 2, 16))
    none = torch.zeros(1, 2, dtype=torch.bool)
    # with all text masked only enrollment is attended: the query position is irrelevant
    a = att.attend(x, torch.tensor([[0.0]]), *enr, *txt, torch.zeros(1, 2), none)
    b = att.attend(x, torch.tensor([[57.0]]), *enr, *txt, torch.zeros(1, 2), none)
    assert torch.allclose(a, b, atol=1e-6)


def test_window_worked_examples():
    taus = [0, 20, 45, 70, 100]
    assert current_chunk(0, taus) == 0
    assert current_chunk(19, taus) == 0
    assert current_chunk(20, taus) == 1
    assert current_chunk(99, taus) == 3
    assert current_chunk(500, taus) == 4
    # np=4, nf=2 (online mode)
    assert window_chunk_range(0, 4, 2, 5) == (0, 2)
    assert window_chunk_range(3, 4, 2, 5) == (0, 4)
    assert window_chunk_range(4, 1, 2, 5) == (3, 4)
    # np=inf (offline)
    assert window_chunk_range(4, None, 2, 9) == (0, 6)
    assert window_chunk_range(6, 0, 0, 9) == (6, 6)


def test_window_mask_selects_chunks(model):
    st = DecodeState.allocate(model, capacity=1)
    st.reset_slot(0, torch.zeros(model.n_layers, 2, 4, 4, 16))
    for c, n in enumerate([2, 3, 1, 2]):
        st.append_text(0, list(range(n)), [10.0 * c + i for i in range(n)], chunk=c)
    v = st.view([0])
    m = st.window_mask(v, [1], [2])[0]
    assert m.tolist()[:8] == [False, False, True, True, True, True, False, False]
    st.evict_chunks_before(0, 2)
    assert st.cached_chunks(0).tolist() == [2, 3, 3] and st.txt_chunk[0, :3].tolist() == [2, 3, 3]
    assert st.txt_pos[0, :3].tolist() == [20.0, 30.0, 31.0]
    st.set_chunk_positions([0], [3], [40.0])
    assert st.txt_pos[0, :3].tolist() == [20.0, 30.0, 31.0]  # applied when a window sees chunk 3
    st.rotate_windows([0], [(2, 2)])
    assert st.txt_pos[0, :3].tolist() == [20.0, 30.0, 31.0]
    st.rotate_windows([0], [(2, 3)])
    assert st.txt_pos[0, :3].tolist() == [20.0, 40.0, 41.0]


def test_a_chunk_added_unrotated_is_rotated_when_a_window_first_sees_it(model):
    """`append_chunk` (the server's) leaves a chunk's rotation to the first window that
    shows it; from then on the memory equals one where `append_text` rotated it at once."""
    enroll = torch.randn(model.n_layers, 2, 4, 4, 16)
    now, later = (DecodeState.allocate(model, capacity=2) for _ in range(2))
    for st in (now, later):
        st.reset_slot(1, enroll)
    for c, n in enumerate([2, 3, 1]):
        now.append_text(1, list(range(5, 5 + n)), [7.0 * c + i for i in range(n)], chunk=c)
        later.append_chunk(1, list(range(5, 5 + n)), 7.0 * c, chunk=c)
        # written with the next step's inputs, or when read; here a chunk at a time, so
        # that its new tokens are projected together as `append_text` projects them
        assert later.pending_text
        later.write_pending_text()
    with pytest.raises(ValueError):
        later.append_chunk(1, [5], 0.0, chunk=2)
    assert torch.equal(now.mem_v, later.mem_v) and torch.equal(now.txt_chunk, later.txt_chunk)
    later.rotate_windows([1], [(0, 1)])  # chunk 2 is not shown yet: it stays as it was cached
    shown = now.n_enroll + 5  # the enrollment and chunks 0 and 1
    assert torch.equal(now.mem_k[:, :, :, :shown], later.mem_k[:, :, :, :shown])
    assert not torch.equal(now.mem_k, later.mem_k) and later.txt_pos[1].tolist()[:6] == [0, 1, 7, 8, 9, 0]
    later.rotate_windows([1], [(2, 2)])
    assert torch.equal(now.mem_k, later.mem_k) and torch.equal(now.txt_pos, later.txt_pos)


def test_chunks_of_many_slots_are_written_together_before_anything_reads_them(model):
    """Chunks cached in several slots wait on the host (`pending_text`) and are written
    all at once when the memory is next read (a view, a rotation, an eviction): the same
    memory as written chunk by chunk; a reset slot's pending chunks are dropped."""
    enroll = torch.randn(model.n_layers, 2, 4, 4, 16)
    together, alone = (DecodeState.allocate(model, capacity=3) for _ in range(2))
    for st in (together, alone):
        for slot in range(3):
            st.reset_slot(slot, enroll)
    for c in range(3):
        for slot in range(3):
            ids = [10 + slot, 20 + c, 30 + slot * c]
            together.append_chunk(slot, ids, 5.0 * c, chunk=c)
            alone.append_chunk(slot, ids, 5.0 * c, chunk=c)
            alone.write_pending_text()
    assert len(together.pending_text) == 9 and not alone.pending_text
    together.append_chunk(1, [99], 20.0, chunk=3)
    together.reset_slot(1, enroll)  # its chunks never reach the memory
    alone.reset_slot(1, enroll)
    together.view([0, 1, 2])
    assert not together.pending_text
    for name in ("mem_v", "txt_chunk"):
        assert torch.allclose(getattr(together, name).float(), getattr(alone, name).float(), atol=1e-6), name
    # (a reset leaves a slot's unrotated keys as they were: its chunk ids mask them)
    assert torch.allclose(together.txt_k[:, [0, 2]], alone.txt_k[:, [0, 2]], atol=1e-6)
    together.append_chunk(2, [7, 8], 30.0, chunk=3)
    together.evict_chunks_before(2, 1)  # compacts the memory: the pending chunk is written first
    assert together.txt_chunk[2].tolist()[:8] == [1, 1, 1, 2, 2, 2, 3, 3]


def test_chunk_spans_kept_on_the_host_match_the_text_memory(model):
    """Re-placing a chunk, evicting and cutting the step's mask find the text's layout from
    a host-side index (no device sync); through appends (a chunk in two pieces too),
    evictions and a reset it agrees with txt_chunk."""
    import random

    rng = random.Random(0)
    st = DecodeState.allocate(model, capacity=2)
    enroll = torch.zeros(model.n_layers, 2, 4, 4, 16)
    st.reset_slot(1, enroll)
    chunk = 0
    for _ in range(60):
        op = rng.random()
        if op < 0.6 and st.text_room(1) >= 3:
            n = rng.randint(1, 3)
            st.append_text(1, [1] * n, [0.0] * n, chunk=chunk)
            chunk += rng.random() < 0.7  # sometimes the same chunk again, right after
        elif op < 0.9:
            st.evict_chunks_before(1, rng.randint(0, chunk))
        else:
            st.reset_slot(1, enroll)
        row = st.txt_chunk[1].tolist()
        cached = st.cached_chunks(1).tolist()
        assert cached == row[: len(cached)] and set(row[len(cached) :]) <= {-1}
        for c in range(chunk + 2):
            assert st.tokens_before(1, c) == sum(0 <= x < c for x in row)
        # the step's visible length, from the host: the window mask's last shown slot + 1
        lo = [rng.randint(0, chunk + 1) for _ in range(2)]
        hi = [a + rng.randint(0, 3) for a in lo]
        shown = st.window_mask(st.view([0, 1]), lo, hi).any(0).nonzero()
        assert st.visible_length([0, 1], lo, hi) == (int(shown[-1]) + 1 if shown.numel() else 0)


def test_replaced_chunks_are_rotated_when_a_window_sees_them(model):
    """A re-placed chunk's keys are re-rotated lazily (rotate_windows), only once a window
    includes it; the step then sees exactly the keys of a chunk added at the new place."""
    enroll = torch.randn(model.n_layers, 2, 4, 4, 16)
    chunks = [[5, 6], [7, 8, 9], [10], [11, 12]]
    lazy, ref = DecodeState.allocate(model, capacity=1), DecodeState.allocate(model, capacity=1)
    for st in (lazy, ref):
        st.reset_slot(0, enroll)
    new_tau = {1: 23.0, 3: 57.0}
    for c, ids in enumerate(chunks):
        lazy.append_text(0, ids, [10.0 * c + i for i in range(len(ids))], chunk=c)
        tau = new_tau.get(c, 10.0 * c)
        ref.append_text(0, ids, [tau + i for i in range(len(ids))], chunk=c)
    lazy.set_chunk_positions([0, 0], list(new_tau), list(new_tau.values()))
    n = model.cfg.n_enroll
    assert not torch.equal(lazy.mem_k[:, 0, :, n + 2 : n + 5], ref.mem_k[:, 0, :, n + 2 : n + 5])  # not yet
    lazy.rotate_windows([0], [(0, 2)])  # chunk 1 enters a window; chunk 3 is still outside
    assert torch.allclose(lazy.mem_k[:, 0, :, : n + 6], ref.mem_k[:, 0, :, : n + 6], atol=1e-6)
    assert torch.equal(lazy.txt_pos[0, :6], ref.txt_pos[0, :6])
    assert not torch.allclose(lazy.mem_k[:, 0, :, n + 6 : n + 8], ref.mem_k[:, 0, :, n + 6 : n + 8])
    assert _unrotated(lazy, 0) == {3: 57.0}
    with torch.no_grad():  # what a step with window 0..2 computes is the same
        outs = [model.step(v.inputs, v.step, v, st.window_mask(v, [0], [2]))
                for st in (lazy, ref) for v in [st.view([0])]]
    assert torch.allclose(outs[0].graphemes, outs[1].graphemes, atol=1e-5)
    lazy.rotate_windows([0], [(0, 9)])  # chunk 3 too: the whole memory now equals the reference's
    assert torch.equal(lazy.txt_pos, ref.txt_pos)
    assert torch.allclose(lazy.mem_k, ref.mem_k, atol=1e-6)
    lazy.set_chunk_positions([0], [1], [30.0])
    lazy.evict_chunks_before(0, 2)  # a pending re-placement of an evicted chunk is dropped
    assert _unrotated(lazy, 0) == {}


def _unrotated(st: DecodeState, slot: int) -> dict[int, float]:
    """The slot's chunks whose keys await rotation, with their first positions."""
    out: dict[int, float] = {}
    for c, pos in zip(st.cached_chunks(slot).tolist(), st.unrotated[slot].tolist()):
        if pos == pos and c not in out:  # not NaN
            out[c] = pos
    return out


def test_delay_pattern_round_trip():
    codes = torch.arange(3 * 6).view(1, 3, 6)
    last = torch.tensor([[5, 4, 4]])
    inputs, targets, valid = build_delayed(codes, last, (0, 1, 2), (100, 101, 102))
    assert targets.shape == (1, 3, 8)
    assert targets[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 100, 100]
    assert targets[0, 1].tolist() == [101, 6, 7, 8, 9, 10, 101, 101]
    assert targets[0, 2].tolist() == [102, 102, 12, 13, 14, 15, 16, 102]
    assert inputs[0, :, 0].tolist() == [100, 101, 102]
    assert torch.equal(inputs[0, :, 1:], targets[0, :, :-1])
    assert torch.equal(undelay(targets[0], (0, 1, 2), 5), codes[0, :, :5])


def test_commit_emits_frames_in_order_and_stops_after_eos(model):
    cfg = model.cfg
    st = DecodeState.allocate(model, capacity=1)
    st.reset_slot(0, torch.zeros(model.n_layers, 2, 4, 4, 16))
    t_eos = 6
    got = []
    for s in range(t_eos + cfg.max_delay + 3):
        v = st.view([0])
        g = graphemes.EOS if s == t_eos else graphemes.SPACE + 1
        # acoustic token of codebook k at step s encodes its frame s - d_k
        tok = torch.tensor([[g] + [(s - cfg.delays[k]) % cfg.codebook_size for k in range(1, cfg.n_codebooks)]])
        r = st.commit(v, tok)
        if r.has_frame[0]:
            got.append((int(r.frame_index[0]), r.frames[0].tolist()))
        if r.done[0]:
            break
    assert [f for f, _ in got] == list(range(t_eos))
    for f, codes in got:
        assert codes[1:] == [f] * cfg.n_acoustic_codebooks


def test_streaming_dropout_mask_contains_closest_key():
    g = torch.Generator().manual_seed(0)
    qpos = torch.arange(30).unsqueeze(0).float()
    kpos = torch.tensor([[0.0, 1, 2, 10, 11, 20, 21, 22]])
    valid = torch.ones(1, 8, dtype=torch.bool)
    valid[0, 7] = False
    m = streaming_dropout_mask(qpos, kpos, valid, r1=1, r2=1, generator=g)
    closest = (qpos[0].unsqueeze(1) - kpos[0, :7]).abs().argmin(1)
    for t in range(30):
        c = int(closest[t])
        assert m[0, t, c] and not m[0, t, 7]
        assert m[0, t, max(0, c - 1)] and m[0, t, min(6, c + 1)]
        row = m[0, t, :7].int().tolist()
        first, lastv = row.index(1), 6 - row[::-1].index(1)
        assert all(row[first : lastv + 1])  # one contiguous window


def test_codebook_losses_are_the_mean_over_valid_positions_and_zero_without_any():
    """The loss ignores the invalid positions instead of cutting them out (no read of the
    device): the same CE and accuracy as over the valid positions alone; a codebook with
    none has loss and accuracy 0, and its logits still get a (zero) gradient."""
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(3, 7, 11, generator=g, requires_grad=True) for _ in range(3)]
    targets = torch.randint(0, 11, (3, 3, 7), generator=g)
    valid = torch.rand(3, 3, 7, generator=g) < 0.6
    valid[:, 2] = False
    loss, acc = codebook_losses(logits, targets, valid)
    for k in range(2):
        m = valid[:, k]
        want = torch.nn.functional.cross_entropy(logits[k][m], targets[:, k][m])
        torch.testing.assert_close(loss[k], want)
        torch.testing.assert_close(acc[k], (logits[k][m].argmax(-1) == targets[:, k][m]).float().mean())
    assert float(loss[2]) == 0.0 and float(acc[2]) == 0.0
    loss.sum().backward()
    assert logits[2].grad is not None and float(logits[2].grad.abs().sum()) == 0.0


def test_losses_and_weights(model):
    cfg = model.cfg
    codes, last, text, pos = random_example(cfg)
    inputs, targets, valid = build_delayed(codes, last, cfg.delays, model.none_ids())
    enroll = model.encode_enrollment(torch.randint(0, cfg.codebook_size, (1, cfg.n_acoustic_codebooks, 12)))
    logits = model(inputs, enroll, text, pos, torch.ones(1, 6, dtype=torch.bool))
    loss, acc = codebook_losses(logits, targets, valid)
    assert loss.shape == (cfg.n_codebooks,) and torch.isfinite(loss).all()
    assert abs(float(loss[1]) - math.log(cfg.codebook_size)) < 1.5
    w = CodebookLossWeights(cfg.n_codebooks, lambda_cb=0.1, momentum=0.0)
    w.update(torch.tensor([0.9] + [0.1] * cfg.n_acoustic_codebooks))
    ws = w.weights()
    assert abs(float(ws.mean()) - 1) < 1e-6 and ws[0] < ws[1]
    (loss * ws).sum().backward()
    boosted = CodebookLossWeights(cfg.n_codebooks, lambda_cb=0.1, momentum=0.0, boost={1: 3.0})
    boosted.update(torch.tensor([0.9] + [0.1] * cfg.n_acoustic_codebooks))
    wb = boosted.weights()
    assert abs(float(wb.mean()) - 1) < 1e-6
    assert abs(float(wb[1] / wb[2]) - 3.0) < 1e-5 and abs(float(wb[0] / wb[2]) - float(ws[0] / ws[2])) < 1e-5
    with pytest.raises(ValueError):
        CodebookLossWeights(cfg.n_codebooks, boost={cfg.n_codebooks: 2.0})


def _one_step(model, mask_len=None, seed=3):
    """One decode step of a fresh slot with 6 text tokens (chunks 0 and 1), the window on
    chunk 0; `mask_len` narrows the text mask to that many slots."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    enroll = model.encode_enrollment(torch.randint(0, cfg.codebook_size, (1, cfg.n_acoustic_codebooks, 10), generator=g))
    st = DecodeState.allocate(model, capacity=1)
    st.reset_slot(0, enrollment_kv(model, enroll[0]))
    st.append_text(0, [5, 6, 7], [0, 1, 2], chunk=0)
    st.append_text(0, [8, 9, 10], [3, 4, 5], chunk=1)
    view = st.view([0])
    mask = st.window_mask(view, [0], [0])
    if mask_len is not None:
        assert not mask[:, mask_len:].any()
        mask = mask[:, :mask_len]
    with torch.no_grad():
        return model.step(view.inputs, view.step, view, mask)


def test_step_reads_only_the_text_slots_its_mask_covers(model):
    full, narrow = _one_step(model), _one_step(model, mask_len=3)
    assert torch.allclose(full.graphemes, narrow.graphemes, atol=1e-6)
    assert torch.allclose(full.acoustic, narrow.acoustic, atol=1e-6)


def test_a_bf16_step_leaves_a_mamba_ssm_block_its_own_projections(model):
    """mamba-ssm's block (on CUDA where it is installed) has no matmul dtype in its step:
    a step with bf16 matmul weights (a GPU's default) calls it as mamba-ssm does, and
    still runs its own block's projections in bf16."""
    import copy

    model = copy.deepcopy(model)
    layer = model.layers[0]
    calls = []

    class MambaSsmLike(torch.nn.Module):  # mamba_ssm.Mamba's step signature
        def __init__(self, block):
            super().__init__()
            self.block = block

        def step(self, hidden_states, conv_state, ssm_state):
            calls.append(hidden_states.dtype)
            return self.block.step(hidden_states, conv_state, ssm_state)

    layer.mamba = MambaSsmLike(layer.mamba)
    st = DecodeState.allocate(model, capacity=1)
    with torch.no_grad():
        out = model.step(st.inputs[:1], st.step[:1], st.view([0]), torch.zeros(1, 0, dtype=torch.bool),
                         torch.bfloat16)
    assert calls == [torch.float32] and torch.isfinite(out.acoustic).all()


def test_step_follows_in_place_weight_updates(model):
    """The step keeps weights derived from the parameters (transposed, stacked heads,
    exp(A_log)); an in-place update, as an optimiser makes, must show in the next step."""
    import copy

    warm = copy.deepcopy(model)
    before = _one_step(warm)  # builds the derived tensors
    with torch.no_grad():
        for m in (warm, model_copy := copy.deepcopy(model)):
            m.heads[1].weight.mul_(2.0)
            m.layers[0].mamba.A_log.add_(0.5)
            m.layers[0].mamba.in_proj.weight.mul_(0.5)
            m.layers[1].xattn.q_proj.weight.mul_(3.0)
            m.code_emb[2].weight.add_(0.1)
    after, fresh = _one_step(warm), _one_step(model_copy)
    assert not torch.allclose(before.acoustic, after.acoustic, atol=1e-3)
    assert torch.allclose(after.graphemes, fresh.graphemes, atol=1e-6)
    assert torch.allclose(after.acoustic, fresh.acoustic, atol=1e-6)


def test_random_model_with_too_small_codec_is_refused_clearly():
    """random:paper speaks 16 acoustic codebooks; the default 'small' codec has 8."""
    from livespeech.models.loading import load_bundle
    with pytest.raises(ValueError, match="paper/encodec_24khz"):
        load_bundle("random:paper")


def test_re_placements_of_many_sessions_are_applied_together(model):
    """One rotate_windows call for a batch applies each slot's own re-placements inside its
    own window (chunks of different lengths, several per slot) and leaves the rest pending:
    the keys equal those of chunks added at their new places."""
    enroll = torch.randn(model.n_layers, 2, 4, 4, 16)
    chunks = [[5, 6], [7, 8, 9], [10], [11, 12]]
    moves = {0: {1: 23.0, 2: 31.0, 3: 57.0}, 2: {0: 4.0, 3: 44.0}}  # slot -> chunk -> new tau
    windows = {0: (1, 2), 1: (0, 3), 2: (0, 3)}
    lazy, ref = DecodeState.allocate(model, capacity=3), DecodeState.allocate(model, capacity=3)
    for st in (lazy, ref):
        for s in range(3):
            st.reset_slot(s, enroll)
    for s in range(3):
        for c, ids in enumerate(chunks):
            lazy.append_text(s, ids, [10.0 * c + i for i in range(len(ids))], chunk=c)
            seen = moves.get(s, {}).get(c) if windows[s][0] <= c <= windows[s][1] else None
            tau = 10.0 * c if seen is None else seen
            ref.append_text(s, ids, [tau + i for i in range(len(ids))], chunk=c)
    lazy.set_chunk_positions(*zip(*((s, c, tau) for s, m in moves.items() for c, tau in m.items())))
    lazy.rotate_windows([0, 1, 2], [windows[s] for s in range(3)])
    assert torch.equal(lazy.txt_pos, ref.txt_pos)
    assert torch.allclose(lazy.mem_k, ref.mem_k, atol=1e-6)
    assert [_unrotated(lazy, s) for s in range(3)] == [{3: 57.0}, {}, {}]  # slot 0's chunk 3 is outside its window


def test_text_kv_keeps_each_tokens_projection_and_forgets_the_least_recently_used(model):
    """A text token's K/V is its own projection whatever chunk it arrives in; repeated
    tokens are not projected again, and past its capacity the cache drops the token used
    longest ago."""
    from livespeech.models.inference import TextKV

    project = model.project_text

    def direct(ids):
        with torch.no_grad():
            return torch.stack([torch.stack((k[0], v[0])) for k, v in project(torch.tensor([ids]))])

    cache = TextKV(model, capacity=4)
    calls = []

    def counted(ids):
        calls.append(ids.tolist()[0])
        return project(ids)

    model.project_text = counted
    try:
        assert torch.allclose(cache([5, 6, 5]), direct([5, 6, 5]), atol=1e-6)
        assert torch.allclose(cache([7, 5, 8]), direct([7, 5, 8]), atol=1e-6)
        assert calls == [[5, 6], [7, 8]]  # each token once, 5 not again
        cache([9])  # five tokens seen, room for four: 6 (used longest ago) goes
        assert len(cache) == 4
        cache([6, 7])
        assert calls[-1] == [6]
    finally:
        del model.project_text
    assert torch.allclose(cache([6, 9, 7]), direct([6, 9, 7]), atol=1e-6)


def test_a_warmed_text_kv_projects_no_warmed_token_again(model):
    """`TextKV.warm` keeps the tokens' own projections, in batches, at most its capacity
    of them; a later call on warmed tokens projects nothing."""
    from livespeech.models.inference import TextKV

    project, calls = model.project_text, []
    model.project_text = lambda ids: calls.append(ids.shape[1]) or project(ids)
    try:
        cache = TextKV(model, capacity=10)
        cache.warm(range(30), batch=4)
        assert calls == [4, 4, 2] and len(cache) == 10
        warmed = cache(list(range(10)))
        assert calls == [4, 4, 2]
    finally:
        del model.project_text
    assert torch.allclose(warmed, TextKV(model)(list(range(10))), atol=1e-6)


def test_the_native_commit_equals_torchs(model, monkeypatch):
    """On the CPU `commit` is one native call (models/native/sampler.cpp): the same
    frames, flags and state as the TorchScript commit, step by step, for rows at
    different steps (a ring wrapping), ending at different EOS, on a gathered view."""
    from livespeech.models import inference

    if inference.native_module() is None:
        pytest.skip("the native extension is not built here (no compiler)")
    cfg = model.cfg
    states = [DecodeState.allocate(model, capacity=4) for _ in range(2)]
    gen = torch.Generator().manual_seed(4)
    for st in states:
        for slot in range(4):
            st.reset_slot(slot, torch.zeros(model.n_layers, 2, 4, 4, 16))
    eos_at = {0: 3, 2: 40, 3: 11}  # slot 1 never ends
    for s in range(60):
        rows = [0, 2, 3] if s % 3 else [0, 1, 2, 3]
        tok = torch.randint(graphemes.SPACE + 1, cfg.codebook_size, (len(rows), cfg.n_codebooks), generator=gen)
        tok[:, 0] = torch.tensor([graphemes.EOS if eos_at.get(r) == s else graphemes.SPACE + 1 for r in rows])
        results = []
        for st, native in zip(states, (True, False)):
            if not native:
                monkeypatch.setattr(inference, "native_module", lambda: None)
            v = st.view(rows)
            results.append(st.commit(v, tok.clone()))
            st.write_back(v)
            monkeypatch.undo()
        a, b = results
        for name in ("frames", "frame_index", "has_frame", "done"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (s, name)
    for name in ("step", "eos_frame", "ring", "inputs"):
        assert torch.equal(getattr(states[0], name), getattr(states[1], name)), name
