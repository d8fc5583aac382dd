"""Tests of the pure-PyTorch Mamba-2 mixer (looplm.layers.mamba2): scan equivalences, decoding,
padding, gradients, weight compatibility with transformers, torch.compile, and the CUDA kernels."""

from __future__ import annotations

import math

import pytest
import torch

from looplm.layers.mamba2 import (
    KERNELS_AVAILABLE,
    Mamba2Mixer,
    ssd_chunked,
    ssd_sequential,
    ssd_step,
)

ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


def _ssd_inputs(batch=2, seqlen=37, nheads=4, headdim=8, ngroups=2, dstate=16, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seqlen, nheads, headdim, generator=g)
    dt = torch.rand(batch, seqlen, nheads, generator=g) * 0.5 + 0.01  # like softplus(dt + dt_bias)
    A = -(torch.rand(nheads, generator=g) * 4 + 0.5)
    B = torch.randn(batch, seqlen, ngroups, dstate, generator=g)
    C = torch.randn(batch, seqlen, ngroups, dstate, generator=g)
    D = torch.randn(nheads, generator=g)
    h0 = torch.randn(batch, nheads, headdim, dstate, generator=g)
    out = [x, dt, A, B, C, D, h0]
    if requires_grad:
        out = [t.clone().requires_grad_(True) for t in out]
    return out


def _mixer(seed=0, **kw) -> Mamba2Mixer:
    torch.manual_seed(seed)
    cfg = dict(d_model=32, d_state=16, headdim=8, ngroups=2, chunk_size=8)
    cfg.update(kw)
    m = Mamba2Mixer(cfg.pop("d_model"), **cfg)
    with torch.no_grad():  # non-trivial values everywhere (the default init has D = 1, zero conv bias...)
        m.D.uniform_(0.5, 1.5)
        m.norm.weight.uniform_(0.5, 1.5)
        if m.conv1d.bias is not None:
            m.conv1d.bias.uniform_(-0.2, 0.2)
    return m.eval()


# ---------------------------------------------------------------------------------------------------
# the scan
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 5, 8, 16, 64])  # 37 is no multiple of any; 64 > T
@pytest.mark.parametrize("ngroups", [1, 2])
@pytest.mark.parametrize("with_init", [False, True])
def test_chunked_matches_sequential(chunk_size, ngroups, with_init):
    x, dt, A, B, C, D, h0 = _ssd_inputs(ngroups=ngroups)
    init = h0 if with_init else None
    y_ref, s_ref = ssd_sequential(x, dt, A, B, C, D=D, initial_state=init)
    y, s = ssd_chunked(x, dt, A, B, C, chunk_size, D=D, initial_state=init)
    assert y.shape == x.shape and s.shape == (2, 4, 8, 16) and s.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=ATOL, rtol=1e-5)


def test_chunked_without_D_and_per_channel_D():
    x, dt, A, B, C, _, _ = _ssd_inputs()
    y_ref, _ = ssd_sequential(x, dt, A, B, C)
    y, _ = ssd_chunked(x, dt, A, B, C, 8)
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=1e-5)
    Dhp = torch.randn(4, 8)  # D of shape [h, p]
    y_ref, _ = ssd_sequential(x, dt, A, B, C, D=Dhp)
    y, _ = ssd_chunked(x, dt, A, B, C, 8, D=Dhp)
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=1e-5)


def test_chunked_long_strong_decay_is_finite():
    # large dt·|A| over a long chunk: the masked-cumsum segsum must not produce inf/nan
    x, dt, A, B, C, D, _ = _ssd_inputs(seqlen=200, batch=1)
    dt = dt * 40
    y_ref, s_ref = ssd_sequential(x, dt, A, B, C, D=D)
    y, s = ssd_chunked(x, dt, A, B, C, 128, D=D)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, s_ref, atol=1e-4, rtol=1e-4)


def test_step_matches_sequential():
    x, dt, A, B, C, D, h0 = _ssd_inputs(seqlen=6)
    y_ref, s_ref = ssd_sequential(x, dt, A, B, C, D=D, initial_state=h0)
    state, ys = h0, []
    for t in range(x.shape[1]):
        y, state = ssd_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D=D)
        ys.append(y)
    torch.testing.assert_close(torch.stack(ys, 1), y_ref, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(state, s_ref, atol=ATOL, rtol=1e-5)


def test_chunked_backward_matches_sequential():
    ins_ref = _ssd_inputs(batch=1, seqlen=13, requires_grad=True)
    ins = [t.detach().clone().requires_grad_(True) for t in ins_ref]
    g = torch.Generator().manual_seed(1)
    gy, gs = torch.randn(1, 13, 4, 8, generator=g), torch.randn(1, 4, 8, 16, generator=g)

    x, dt, A, B, C, D, h0 = ins_ref
    y, s = ssd_sequential(x, dt, A, B, C, D=D, initial_state=h0)
    ((y * gy).sum() + (s * gs).sum()).backward()
    x, dt, A, B, C, D, h0 = ins
    y, s = ssd_chunked(x, dt, A, B, C, 4, D=D, initial_state=h0)
    ((y * gy).sum() + (s * gs).sum()).backward()

    for name, a, b in zip(["x", "dt", "A", "B", "C", "D", "h0"], ins_ref, ins):
        assert torch.isfinite(b.grad).all(), name
        torch.testing.assert_close(b.grad, a.grad, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------------------------------------
# the mixer: construction
# ---------------------------------------------------------------------------------------------------


def test_parameters_shapes_and_init():
    torch.manual_seed(0)
    m = Mamba2Mixer(64, d_state=16, headdim=16, ngroups=2, dt_min=1e-3, dt_max=0.1)
    d_inner, nheads, conv_dim = 128, 8, 128 + 2 * 2 * 16
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes == {
        "in_proj.weight": (2 * d_inner + 2 * 2 * 16 + nheads, 64),
        "conv1d.weight": (conv_dim, 1, 4),
        "conv1d.bias": (conv_dim,),
        "dt_bias": (nheads,),
        "A_log": (nheads,),
        "D": (nheads,),
        "norm.weight": (d_inner,),
        "out_proj.weight": (64, d_inner),
    }
    assert all(getattr(p, "_no_weight_decay", False) for p in (m.A_log, m.D, m.dt_bias))
    assert not getattr(m.in_proj.weight, "_no_weight_decay", False)
    A = m.A_log.exp()
    assert ((A >= 1.0) & (A <= 16.0)).all()
    dt = torch.nn.functional.softplus(m.dt_bias)
    assert ((dt >= 1e-3 - 1e-6) & (dt <= 0.1 + 1e-6)).all()
    assert torch.equal(m.D, torch.ones(nheads))
    with pytest.raises(ValueError):
        Mamba2Mixer(32, headdim=24)  # 64 not a multiple of 24
    with pytest.raises(ValueError):
        Mamba2Mixer(32, headdim=8, ngroups=3)  # 8 heads, 3 groups


# ---------------------------------------------------------------------------------------------------
# the mixer: decoding paths
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ngroups", [1, 2])
def test_step_decoding_matches_forward(ngroups):
    m = _mixer(ngroups=ngroups)
    u = torch.randn(2, 21, 32)
    with torch.no_grad():
        y_full = m(u)
        st = m.new_cache(2)
        assert st.seqlen_offset == 0 and st.ssm_state.dtype == torch.float32
        ys = [m(u[:, t : t + 1], cache=st) for t in range(u.shape[1])]
    assert st.seqlen_offset == 21
    torch.testing.assert_close(torch.cat(ys, 1), y_full, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 3, 8, 13])
def test_prefill_then_step_matches_forward(k):
    m = _mixer()
    u = torch.randn(2, 20, 32)
    with torch.no_grad():
        y_full = m(u)
        st = m.new_cache(2)
        ys = [m(u[:, :k], cache=st)]
        assert st.seqlen_offset == k
        ys += [m(u[:, t : t + 1], cache=st) for t in range(k, 20)]
    torch.testing.assert_close(torch.cat(ys, 1), y_full, atol=ATOL, rtol=1e-5)


def test_prefill_then_multi_token_continuation_matches_forward():
    m = _mixer()
    u = torch.randn(2, 30, 32)
    with torch.no_grad():
        y_full = m(u)
        st = m.new_cache(2)
        ys = [m(u[:, :7], cache=st), m(u[:, 7:8], cache=st), m(u[:, 8:19], cache=st), m(u[:, 19:21], cache=st)]
        ys += [m(u[:, t : t + 1], cache=st) for t in range(21, 30)]
    assert st.seqlen_offset == 30
    torch.testing.assert_close(torch.cat(ys, 1), y_full, atol=ATOL, rtol=1e-5)


def test_final_state_of_prefill_equals_reference_scan():
    m = _mixer()
    u = torch.randn(1, 11, 32)
    with torch.no_grad():
        st = m.new_cache(1)
        m(u, cache=st)
        # conv_state: the last d_conv conv inputs (the xBC part of in_proj), oldest first
        xBC = m.in_proj(u)[..., m.d_inner : m.d_inner + m.conv_dim]
        torch.testing.assert_close(st.conv_state, xBC[:, -m.d_conv :].transpose(1, 2))
        # a short prefill (T < d_conv) keeps the leading zeros
        st2 = m.new_cache(1)
        m(u[:, :2], cache=st2)
        assert torch.equal(st2.conv_state[..., :2], torch.zeros(1, m.conv_dim, 2))


def test_offset_zero_state_ignores_stale_contents():
    m = _mixer()
    u = torch.randn(2, 9, 32)
    with torch.no_grad():
        y = m(u)
        st = m.new_cache(2)
        st.conv_state.normal_()
        st.ssm_state.normal_()
        torch.testing.assert_close(m(u, cache=st), y)


def test_state_index_select():
    m = _mixer()
    u = torch.randn(3, 12, 32)
    with torch.no_grad():
        st = m.new_cache(3)
        m(u[:, :8], cache=st)
        idx = torch.tensor([2, 0])
        st.index_select(idx)
        assert st.conv_state.shape[0] == 2 and st.ssm_state.shape[0] == 2
        ys = [m(u[idx, t : t + 1], cache=st) for t in range(8, 12)]
        y_full = m(u[idx])
    torch.testing.assert_close(torch.cat(ys, 1), y_full[:, 8:], atol=ATOL, rtol=1e-5)


def test_left_padding_matches_unpadded():
    m = _mixer(bias=True)  # in_proj bias: a zero input would not give a zero xBC
    lens = [13, 7, 1]
    T = max(lens)
    seqs = [torch.randn(1, n, 32) for n in lens]
    u = torch.zeros(len(lens), T, 32)
    pad_mask = torch.zeros(len(lens), T, dtype=torch.bool)
    for i, (s, n) in enumerate(zip(seqs, lens)):
        u[i, T - n :] = s[0]
        u[i, : T - n] = torch.randn(T - n, 32) * 3  # garbage under the padding
        pad_mask[i, T - n :] = True
    with torch.no_grad():
        y = m(u, pad_mask=pad_mask)
        for i, (s, n) in enumerate(zip(seqs, lens)):
            torch.testing.assert_close(y[i, T - n :], m(s)[0], atol=ATOL, rtol=1e-5)
        # decoding continues from a left-padded prefill exactly as from the row alone
        st = m.new_cache(len(lens))
        m(u, pad_mask=pad_mask, cache=st)
        nxt = torch.randn(len(lens), 1, 32)
        y_next = m(nxt, cache=st, pad_mask=torch.ones(len(lens), 1, dtype=torch.bool))
        for i, (s, n) in enumerate(zip(seqs, lens)):
            ref = m(torch.cat([s, nxt[i : i + 1]], 1))[0, -1]
            torch.testing.assert_close(y_next[i, 0], ref, atol=ATOL, rtol=1e-5)


def test_pad_step_leaves_ssm_state_untouched():
    m = _mixer()
    with torch.no_grad():
        st = m.new_cache(1)
        m(torch.randn(1, 5, 32), cache=st)
        before = st.ssm_state.clone()
        m(torch.randn(1, 1, 32), cache=st, pad_mask=torch.zeros(1, 1, dtype=torch.bool))
    torch.testing.assert_close(st.ssm_state, before, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------------
# the mixer: training
# ---------------------------------------------------------------------------------------------------


def test_gradients_reach_all_parameters():
    m = _mixer(bias=True).train()
    u = torch.randn(2, 19, 32, requires_grad=True)
    m(u).square().mean().backward()
    for name, p in list(m.named_parameters()) + [("input", u)]:
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_bf16_autocast_runs_scan_in_fp32():
    m = _mixer()
    u = torch.randn(2, 17, 32)
    with torch.no_grad():
        y32 = m(u)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            st = m.new_cache(2)
            y16 = m(u, cache=st)
            y16_step = m(u[:, :1], cache=st)
    assert y16.dtype == torch.bfloat16 and st.ssm_state.dtype == torch.float32
    assert torch.isfinite(y16_step.float()).all()
    assert (y16.float() - y32).abs().max() < 0.1 * y32.abs().max()


def test_torch_compile_no_graph_breaks():
    m = _mixer()
    u = torch.randn(2, 20, 32)

    def fn(x):
        return m(x)

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(u)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


# ---------------------------------------------------------------------------------------------------
# weight compatibility with transformers
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_bias", [False, True])
def test_parity_with_transformers(use_bias):
    transformers = pytest.importorskip("transformers")
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2Mixer

    hidden, state, head_dim, groups, expand = 64, 16, 16, 2, 2
    cfg = transformers.Mamba2Config(
        hidden_size=hidden,
        state_size=state,
        head_dim=head_dim,
        n_groups=groups,
        expand=expand,
        conv_kernel=4,
        num_heads=expand * hidden // head_dim,
        chunk_size=16,
        num_hidden_layers=1,
        vocab_size=100,
        use_bias=use_bias,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
    )
    torch.manual_seed(0)
    hf = HFMamba2Mixer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():  # random weights everywhere
            if name == "A_log":
                p.copy_(torch.log(torch.empty_like(p).uniform_(1, 16)))
            elif name == "dt_bias":
                p.uniform_(-5, -1)
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(max(1, p.shape[-1])))
    ours = Mamba2Mixer(
        hidden, expand=expand, d_state=state, d_conv=4, headdim=head_dim, ngroups=groups, chunk_size=8, bias=use_bias
    ).eval()
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=True)
    assert not missing and not unexpected

    u = torch.randn(2, 45, hidden)
    with torch.no_grad():
        # transformers < 5 has a separate `torch_forward`; in 5.x `forward` falls back to torch without kernels
        y_hf = hf.torch_forward(u) if hasattr(hf, "torch_forward") else hf(u)
        y = ours(u)
        st = ours.new_cache(2)
        y_dec = torch.cat([ours(u[:, :30], cache=st)] + [ours(u[:, t : t + 1], cache=st) for t in range(30, 45)], 1)
    torch.testing.assert_close(y, y_hf, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(y_dec, y_hf, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------
# CUDA kernels (mamba_ssm) against the torch path
# ---------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not KERNELS_AVAILABLE, reason="needs mamba_ssm")
def test_cuda_kernels_match_torch_path():
    torch.manual_seed(0)
    m = Mamba2Mixer(128, d_state=32, headdim=32, ngroups=2, chunk_size=32).cuda().eval()
    ref = Mamba2Mixer(128, d_state=32, headdim=32, ngroups=2, chunk_size=32, use_kernels=False).cuda().eval()
    ref.load_state_dict(m.state_dict())
    u = torch.randn(2, 77, 128, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(m(u), ref(u), atol=2e-3, rtol=2e-3)
        ys = {}
        for name, mod in (("kernel", m), ("torch", ref)):
            st = mod.new_cache(2)
            ys[name] = torch.cat(
                [mod(u[:, :50], cache=st)] + [mod(u[:, t : t + 1], cache=st) for t in range(50, 77)], 1
            )
        torch.testing.assert_close(ys["kernel"], ys["torch"], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(ys["kernel"], ref(u), atol=2e-3, rtol=2e-3)
    # backward through the kernel
    u.requires_grad_(True)
    m.train()(u).square().mean().backward()
    g_kernel = u.grad.clone()
    u.grad = None
    ref.train()(u).square().mean().backward()
    torch.testing.assert_close(g_kernel, u.grad, atol=2e-3, rtol=2e-2)
