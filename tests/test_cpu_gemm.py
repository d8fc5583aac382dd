"""looplm.kernels.gemm: the split products equal plain matmuls, the measured choice is made once and
kept on disk, TunedLinear is an nn.Linear with the same values and gradients (eager, autocast,
compiled), and the trainer switches it on where its rule says."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import looplm
from looplm.kernels import gemm as cpu_gemm
from looplm.kernels.gemm import STRATEGIES, TunedLinear, tuned_linears
from looplm.train import load_train_config
from looplm.train.trainer import resolve_cpu_gemm

pytestmark = pytest.mark.kernels


@pytest.fixture(autouse=True)
def plans_in_tmp(tmp_path, monkeypatch):
    """Each test gets its own plans file and an empty memory."""
    monkeypatch.setenv("LOOPLM_CPU_GEMM_PLANS", str(tmp_path / "looplm" / "plans.json"))
    cpu_gemm.forget()
    yield tmp_path
    cpu_gemm.forget()


def _operands(M, K, N, layout, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g) if layout[0] == "n" else torch.randn(K, M, generator=g).t()
    b = torch.randn(K, N, generator=g) if layout[1] == "n" else torch.randn(N, K, generator=g).t()
    return a.to(dtype), b.to(dtype)


@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_split_equals_the_plain_product(strategy, layout):
    """Each strategy gives a @ b (odd sides: the halves differ by one) up to bf16 rounding of the output."""
    a, b = _operands(131, 140, 129, layout)
    ref = a.double() @ b.double()
    out = cpu_gemm._run(a, b, strategy)
    assert out.shape == (131, 129) and out.dtype == torch.bfloat16 and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref, rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(out, a @ b, rtol=2**-7, atol=1e-2)


def test_the_choice_is_measured_once_and_kept_on_disk(plans_in_tmp, monkeypatch):
    a, b = _operands(256, 128, 192, "nt")
    calls = []
    real = cpu_gemm._measure

    def counting(a, b):
        calls.append(a.shape)
        return real(a, b)

    monkeypatch.setattr(cpu_gemm, "_measure", counting)
    first = cpu_gemm.plan(a, b)
    assert first in STRATEGIES and len(calls) == 1
    assert cpu_gemm.plan(a, b) == first and len(calls) == 1  # remembered
    path = cpu_gemm.plans_path()
    assert path == plans_in_tmp / "looplm" / "plans.json"
    data = json.loads(path.read_text())
    (section,) = data.values()
    assert list(section.values()) == [first] and "256x128x192:nt:bfloat16" in next(iter(section))
    cpu_gemm.forget()  # a new process: reads the file, measures nothing
    monkeypatch.setattr(cpu_gemm, "_measure", lambda a, b: pytest.fail("measured again"))
    assert cpu_gemm.plan(a, b) == first
    # another layout of the same shape is another entry
    monkeypatch.setattr(cpu_gemm, "_measure", lambda a, b: "rows2")
    a2, b2 = _operands(256, 128, 192, "nn")
    assert cpu_gemm.plan(a2, b2) == "rows2"
    assert len(next(iter(json.loads(path.read_text()).values()))) == 2


def test_small_products_other_dtypes_and_a_bad_file_are_handled(plans_in_tmp, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_measure", lambda a, b: pytest.fail("should not measure"))
    assert cpu_gemm.plan(*_operands(1024, 64, 576, "nn")) == "direct"  # a side under MIN_SIDE
    assert cpu_gemm.plan(*_operands(256, 256, 256, "nn", torch.float32)) == "direct"  # fp32: torch's own
    path = cpu_gemm.plans_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    cpu_gemm.forget()
    monkeypatch.setattr(cpu_gemm, "_measure", lambda a, b: "cols2")
    assert cpu_gemm.plan(*_operands(256, 256, 256, "nn")) == "cols2"  # unreadable file: measured again
    assert json.loads(path.read_text())  # and rewritten whole


def _linear_pair(bias: bool, dtype=torch.float32):
    torch.manual_seed(0)
    ref = nn.Linear(160, 144, bias=bias).to(dtype)
    tuned = nn.Linear(160, 144, bias=bias).to(dtype)
    tuned.load_state_dict(ref.state_dict())
    assert tuned_linears(tuned) == 1 and type(tuned) is TunedLinear
    assert tuned.state_dict().keys() == ref.state_dict().keys()
    return ref, tuned


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tuned_linear_matches_f_linear_under_autocast(bias, strategy, monkeypatch):
    """fp32 master weights under bf16 autocast (the training setting): output, input gradient and
    parameter gradients (in fp32) equal nn.Linear's under autocast, whatever the split."""
    monkeypatch.setattr(cpu_gemm, "_measure", lambda a, b: strategy)
    ref, tuned = _linear_pair(bias)
    x = torch.randn(2, 80, 160)
    go = torch.randn(2, 80, 144)
    outs = []
    for m in (ref, tuned):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(xi)
        y.backward(go.to(y.dtype))
        outs.append((y, xi.grad, m.weight.grad, m.bias.grad if bias else None))
    (y0, gx0, gw0, gb0), (y1, gx1, gw1, gb1) = outs
    assert y1.dtype == torch.bfloat16 and gw1.dtype == torch.float32
    torch.testing.assert_close(y1, y0, rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(gx1, gx0, rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(gw1, gw0, rtol=2**-7, atol=5e-2)
    if bias:
        torch.testing.assert_close(gb1, gb0, rtol=2**-7, atol=5e-2)
    assert {k for k, v in cpu_gemm._fast.items() if v == strategy and k[4] == torch.bfloat16}  # the split ran


@pytest.mark.parametrize("optim", ["fused-adamw", "foreach-adamw", "sgd", "load_state_dict"])
def test_the_bf16_weight_copy_follows_every_update(optim):
    """The cached bf16 copy is reused within a step and remade after any update of the weight — fused
    AdamW's (which leaves the version counter alone), foreach and plain optimizers', load_state_dict's."""
    ref, tuned = _linear_pair(False)
    x = torch.randn(8, 160)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y0 = tuned(x)
        assert torch.equal(tuned(x), y0) and tuned._cast_cache[1] is tuned._cast_weight(torch.bfloat16)
    y0.float().sum().backward()
    if optim == "load_state_dict":
        tuned.load_state_dict({"weight": torch.randn(144, 160)})
    else:
        kind = {"fused-adamw": dict(fused=True), "foreach-adamw": dict(foreach=True)}
        opt = (
            torch.optim.AdamW(tuned.parameters(), lr=0.1, **kind[optim])
            if optim != "sgd"
            else torch.optim.SGD(tuned.parameters(), lr=0.1)
        )
        opt.step()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1 = tuned(x)
        want = F.linear(x, tuned.weight)
    assert not torch.equal(y1, y0)
    torch.testing.assert_close(y1, want, rtol=0, atol=0)


def test_tuned_linear_elsewhere_is_f_linear():
    """fp32 without autocast, frozen weights, no-grad: exactly F.linear."""
    ref, tuned = _linear_pair(True)
    x = torch.randn(3, 160)
    assert torch.equal(tuned(x), ref(x))
    tuned.weight.requires_grad_(False)
    xb = x.bfloat16().requires_grad_()
    wb = tuned.weight.bfloat16()
    with torch.no_grad():
        torch.testing.assert_close(tuned.to(torch.bfloat16)(xb), F.linear(xb, wb, tuned.bias), rtol=0, atol=0)


def test_compiled_tuned_linear_keeps_the_op_in_one_graph(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_measure", lambda a, b: "rows2")
    ref, tuned = _linear_pair(False, torch.bfloat16)
    x = torch.randn(256, 160, dtype=torch.bfloat16)

    def run(m):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.float().square().sum().backward()
        return y, xi.grad, m.weight.grad

    eager = run(tuned)
    tuned.weight.grad = None
    compiled = torch.compile(tuned, fullgraph=True, backend="aot_eager")
    got = run(compiled)
    for a, b in zip(eager, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_model_trains_the_same_with_tuned_linears(monkeypatch):
    """A tiny model with d 128 (so its products take the splits): the bf16-autocast loss and gradients
    of the tuned model equal the plain one's up to bf16 rounding."""
    monkeypatch.setattr(cpu_gemm, "_measure", lambda a, b: "cols2")
    torch.manual_seed(0)
    cfg = {
        "name": "t",
        "vocab_size": 256,
        "d_model": 128,
        "n_core": 2,
        "n_loops": 2,
        "d_ff": 256,
        "attention": {"n_heads": 4, "n_kv_heads": 2},
        "max_seq_len": 64,
    }
    plain = looplm.build(cfg).train()
    tuned = looplm.build(cfg).train()
    tuned.load_state_dict(plain.state_dict())
    assert tuned_linears(tuned) > 0
    ids = torch.randint(0, 256, (4, 64))
    res = []
    for m in (plain, tuned):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(ids, labels=ids, return_logits=False).loss
        loss.backward()
        res.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(res[1][0], res[0][0], rtol=1e-2, atol=1e-2)
    for n, g in res[0][1].items():
        torch.testing.assert_close(res[1][1][n], g, rtol=0.1, atol=2e-2, msg=n)
    assert any(v == "cols2" for v in cpu_gemm._fast.values())


def test_trainer_rule_and_config():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    from looplm.utils.cpuinfo import flags

    native = bool({"avx512_bf16", "amx_bf16"} & flags())
    assert resolve_cpu_gemm("auto", cpu, "bf16", False) == native
    assert not resolve_cpu_gemm("auto", cpu, "fp32", False)
    assert not resolve_cpu_gemm("auto", cuda, "bf16", False)
    assert not resolve_cpu_gemm("auto", cpu, "bf16", True)  # FSDP2
    assert resolve_cpu_gemm(True, cuda, "fp32", False) and not resolve_cpu_gemm(False, cpu, "bf16", False)
    with pytest.raises(ValueError, match="cpu_gemm: must be true, false or 'auto'"):
        load_train_config({"model": "tiny-llama", "train": {"cpu_gemm": "yes"}})


def test_a_model_switched_for_training_still_decodes_on_the_fast_path():
    """After tuned_linears (what looplm train does on a bf16 CPU), generate still takes the fused decode
    blocks and the GEMV kernels, gives the same tokens as the plain model, and leaves the layers
    TunedLinear."""
    from looplm.decode.generate import generate
    from looplm.kernels import decode, gemv

    torch.manual_seed(0)
    plain = looplm.build("tiny-qwen3").eval().to(torch.bfloat16)
    tuned = looplm.build("tiny-qwen3").eval().to(torch.bfloat16)
    tuned.load_state_dict(plain.state_dict())
    n = tuned_linears(tuned)
    assert n > 0
    if gemv.extension_available():
        assert all(decode.eligible(b) for b in tuned.core.stack.blocks)
        with gemv.decode_linears(tuned) as swapped:
            assert swapped == (n if gemv.available() else 0)  # every (tuned) linear gets the kernels
    prompt = torch.randint(0, tuned.config.vocab_size, (2, 5))
    a = generate(plain, prompt, max_new_tokens=6, do_sample=False)
    b = generate(tuned, prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)
    assert sum(type(m) is TunedLinear for m in tuned.modules()) == n


@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
def test_mm_f32_is_the_product_without_a_bf16_rounding(layout):
    """mm_f32 of bf16 operands (any of the four layouts, and a column slice) is the fp64 product to fp32
    accumulation error — closer than torch's bf16 matmul, which rounds the result to bf16."""
    a, b = _operands(150, 130, 140, layout)
    ref = a.double() @ b.double()
    for bb in (b, b[:, 10:100]):
        got = cpu_gemm.mm_f32(a, bb)
        r = a.double() @ bb.double()
        assert got.dtype == torch.float32 and got.shape == r.shape
        torch.testing.assert_close(got.double(), r, rtol=1e-5, atol=1e-4)
    assert (cpu_gemm.mm_f32(a, b).double() - ref).abs().max() < ((a @ b).double() - ref).abs().max()
    # other dtypes: the plain product, at least in fp32 (fp64 stays fp64)
    assert cpu_gemm.mm_f32(a.double(), b.double()).dtype == torch.float64
    assert cpu_gemm.mm_f32(a.float(), b.float()).dtype == torch.float32


def test_mm_f32_op_errors_say_what_is_wrong():
    from looplm.kernels import gemv

    if not gemv.available():
        pytest.skip(f"the AVX-512 build is not available: {gemv.unavailable_reason()}")
    op = torch.ops.looplm_cpu.mm_f32
    a, b = _operands(8, 6, 5, "nn")
    with pytest.raises(RuntimeError, match="2-d bf16 CPU"):
        op(a.float(), b.float())
    with pytest.raises(RuntimeError, match="2-d bf16 CPU"):
        op(a, b[:5])
    assert torch.equal(op(a[:, :0], b[:0]), torch.zeros(8, 5))  # K = 0: zeros


def test_tuned_linear_weight_gradient_is_fp32_for_the_master_weight(monkeypatch):
    """Under autocast TunedLinear hands the fp32 master weight an fp32 gradient that was never rounded to
    bf16: nearer the float64 gradient of the same bf16 products than nn.Linear's."""
    ref, tuned = _linear_pair(False)
    x = torch.randn(256, 160)
    go = torch.randn(256, 144)
    grads = []
    for m in (ref, tuned):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        y.backward(go.to(y.dtype))
        grads.append(m.weight.grad)
    exact = go.bfloat16().double().t() @ x.bfloat16().double()
    err_ref, err_tuned = ((g.double() - exact).abs().max().item() for g in grads)
    assert grads[1].dtype == torch.float32 and err_tuned <= err_ref


def test_trainer_with_tuned_linears_and_activation_checkpointing(tmp_path):
    """looplm train in bf16 with train.cpu_gemm on: run.json records the switched layers, and per-loop
    activation checkpointing (the forward recomputed in backward, reusing the cached bf16 weights)
    gives the same losses as without it."""
    from looplm.train.metrics import read_metrics
    from looplm.train.trainer import Trainer

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"line {i} of some text to train on" for i in range(300)))
    losses = {}
    for ac in (False, True):
        cfg = load_train_config(
            {
                "model": "tiny-coreloop",
                "data": {
                    "source": "files",
                    "paths": [str(corpus)],
                    "split_mode": "lines",
                    "seq_len": 32,
                    "val_every_nth": 10,
                },
                "train": {
                    "global_batch_size": 8,
                    "micro_batch_size": 4,
                    "max_steps": 3,
                    "precision": "bf16",
                    "cpu_gemm": True,
                    "compile": False,
                    "activation_checkpointing": ac,
                    "cpu_threads": 1,
                },
                "eval": {"every": 0, "at_end": False},
                "checkpoint": {"every": 0, "at_end": False},
                "logging": {"progress_bar": False, "tensorboard": False},
            }
        )
        out = tmp_path / f"ac{ac}"
        tr = Trainer(cfg, out, quiet=True)
        tr.fit()
        assert tr.tuned_linears > 0 and json.loads((out / "run.json").read_text())["tuned_linears"] == tr.tuned_linears
        losses[ac] = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert len(losses[False]) == 3 and losses[True] == losses[False]


def _group(bias: bool, outs=(144, 48, 48), dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    ref = [nn.Linear(160, o, bias=bias, dtype=dtype) for o in outs]
    tuned = [nn.Linear(160, o, bias=bias, dtype=dtype) for o in outs]
    for r, t in zip(ref, tuned):
        t.load_state_dict(r.state_dict())
        t.__class__ = TunedLinear
    return ref, tuned


def _run_group(layers, x, gos, grouped: bool):
    xi = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys = cpu_gemm.linear_group(xi, layers) if grouped else tuple(m(xi) for m in layers)
    sum((y.float() * go).sum() for y, go in zip(ys, gos)).backward()
    return ys, xi.grad, [m.weight.grad for m in layers], [m.bias.grad if m.bias is not None else None for m in layers]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_linear_group_is_the_layers_one_by_one(bias, strategy, monkeypatch):
    """Stacked q/k/v-like layers under bf16 autocast: each output, the input gradient (summed inside one
    product) and each layer's fp32 weight / bias gradient equal nn.Linear's layer by layer, to bf16 rounding."""
    monkeypatch.setattr(cpu_gemm, "_measure", lambda a, b: strategy)
    ref, tuned = _group(bias)
    x = torch.randn(2, 80, 160)
    gos = [torch.randn(2, 80, o) for o in (144, 48, 48)]
    ys0, gx0, gw0, gb0 = _run_group(ref, x, gos, grouped=False)
    ys1, gx1, gw1, gb1 = _run_group(tuned, x, gos, grouped=True)
    assert [y.shape for y in ys1] == [y.shape for y in ys0] and all(y.dtype == torch.bfloat16 for y in ys1)
    assert ys1[1].untyped_storage().data_ptr() == ys1[0].untyped_storage().data_ptr()  # views of one product
    for a, b in zip(ys1, ys0):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(gx1, gx0, rtol=2**-7, atol=2e-2)
    for a, b in zip(gw1, gw0):
        assert a.dtype == torch.float32 and a.shape == b.shape and a.is_contiguous()
        torch.testing.assert_close(a, b, rtol=2**-7, atol=5e-2)
    if bias:
        for a, b in zip(gb1, gb0):
            torch.testing.assert_close(a, b, rtol=2**-7, atol=5e-2)


def test_linear_group_weight_gradients_are_the_exact_products():
    """Each layer's weight gradient is its own row block of dyᵀ x in fp32 (a block mix-up would fail)."""
    _, tuned = _group(False, outs=(40, 24))
    x = torch.randn(64, 160).bfloat16().float()
    gos = [torch.randn(64, o).bfloat16().float() for o in (40, 24)]
    _, _, gws, _ = _run_group(tuned, x, gos, grouped=True)
    for gw, go in zip(gws, gos):
        torch.testing.assert_close(gw, go.double().t().mm(x.double()).float(), rtol=1e-5, atol=1e-4)


def test_linear_group_falls_back_to_the_layers(monkeypatch):
    """Plain nn.Linear, no autocast (fp32), no autograd, mixed biases: exactly the layers called one by one."""
    ref, tuned = _group(True)
    x = torch.randn(5, 160)
    assert all(torch.equal(a, b) for a, b in zip(cpu_gemm.linear_group(x, ref), (m(x) for m in ref)))
    assert all(torch.equal(a, b) for a, b in zip(cpu_gemm.linear_group(x, tuned), (m(x) for m in ref)))  # fp32
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert all(torch.equal(a, b) for a, b in zip(cpu_gemm.linear_group(x, tuned), [m(x) for m in tuned]))
        assert "_stack_cache" not in tuned[0].__dict__
    tuned[1].bias = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert all(torch.equal(a, b) for a, b in zip(cpu_gemm.linear_group(x, tuned), [m(x) for m in tuned]))


@pytest.mark.parametrize("optim", ["fused-adamw", "sgd", "load_state_dict"])
def test_linear_group_stacked_copy_follows_every_update(optim):
    """The stacked bf16 copy is made once per step and remade after any update of any of its weights."""
    _, tuned = _group(False, outs=(32, 16))
    x = torch.randn(8, 160)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y0 = cpu_gemm.linear_group(x, tuned)
        first = tuned[0]._stack_cache[1]
        cpu_gemm.linear_group(x, tuned)
        assert tuned[0]._stack_cache[1] is first  # reused within the step
    sum(y.float().sum() for y in y0).backward()
    if optim == "load_state_dict":
        tuned[1].load_state_dict({"weight": torch.randn(16, 160)})
    else:
        params = [p for m in tuned for p in m.parameters()]
        opt = (
            torch.optim.AdamW(params, lr=0.1, fused=True) if optim == "fused-adamw" else torch.optim.SGD(params, lr=0.1)
        )
        opt.step()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1 = cpu_gemm.linear_group(x, tuned)
        for y, m in zip(y1, tuned):
            torch.testing.assert_close(y, F.linear(x, m.weight), rtol=0, atol=0)
    assert tuned[0]._stack_cache[1] is not first


def test_compiled_linear_group_is_one_graph_and_equals_eager():
    _, tuned = _group(False, outs=(144, 48))
    x = torch.randn(256, 160)
    gos = [torch.randn(256, 144), torch.randn(256, 48)]

    def f(xi):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a, b = cpu_gemm.linear_group(xi, tuned)
        return a, b

    def run(fn):
        for m in tuned:
            m.weight.grad = None
        xi = x.clone().requires_grad_()
        ys = fn(xi)
        sum((y.float() * go).sum() for y, go in zip(ys, gos)).backward()
        return (*ys, xi.grad, *[m.weight.grad for m in tuned])

    eager = run(f)
    got = run(torch.compile(f, fullgraph=True, backend="aot_eager"))
    for a, b in zip(eager, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
