"""Fast paths equal their readable references: the chunked head + cross-entropy, the lean decode path
(last-position head, preallocated KV slots), and decoding on bf16 weights."""

import pytest
import torch

import looplm
from looplm.decode.generate import generate
from looplm.layers.attention import KVCache
from looplm.layers.loss import linear_cross_entropy, linear_cross_entropy_reference


@pytest.mark.parametrize("rows", [3, 16, 10**6])  # softmax blocks: uneven, the CPU default, whole chunk (CUDA)
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_linear_cross_entropy_equals_reference_loss_and_gradients(chunk, rows, monkeypatch):
    monkeypatch.setattr("looplm.layers.loss._CPU_ROWS", rows)
    torch.manual_seed(0)
    h = torch.randn(2, 50, 32, dtype=torch.float64, requires_grad=True)
    W = (0.2 * torch.randn(300, 32, dtype=torch.float64)).requires_grad_()
    y = torch.randint(0, 300, (2, 50))
    y[0, ::5] = -100
    ref = torch.nn.functional.cross_entropy((h @ W.t()).reshape(-1, 300), y.reshape(-1), ignore_index=-100)
    ref.backward()
    gh, gw = h.grad.clone(), W.grad.clone()
    h.grad = W.grad = None
    out = linear_cross_entropy(h, W, y, chunk_size=chunk)
    (2.0 * out).backward()  # the incoming gradient is applied
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, 2 * gh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(W.grad, 2 * gw, rtol=1e-10, atol=1e-12)


def test_chunked_loss_under_bf16_autocast_matches_the_plain_head():
    """Under bf16 autocast the logits' gradient is written back into the bf16 logits buffer; loss and
    gradients match the plain head (which also runs its matmuls in bf16)."""
    torch.manual_seed(0)
    h, W = torch.randn(64, 32, requires_grad=True), (0.2 * torch.randn(100, 32)).requires_grad_()
    y = torch.randint(0, 100, (64,))
    y[::9] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = linear_cross_entropy_reference(h, W, y)
    a.backward()
    gh, gw = h.grad.clone(), W.grad.clone()
    h.grad = W.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        b = linear_cross_entropy(h, W, y, chunk_size=40)
    b.backward()
    torch.testing.assert_close(b, a, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(h.grad, gh, rtol=2e-2, atol=2e-4)
    torch.testing.assert_close(W.grad, gw, rtol=2e-2, atol=2e-4)
    assert torch.isnan(linear_cross_entropy(h, W, torch.full((64,), -100)))  # like F.cross_entropy


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-mamba2"])  # untied, tied, Mamba-2
def test_model_loss_without_logits_equals_the_plain_loss(name):
    torch.manual_seed(0)
    a = looplm.build(name)
    b = looplm.build(name)
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, a.config.vocab_size, (2, 12))
    labels = x.clone()
    labels[1, :4] = -100
    oa = a(x, labels=labels)
    ob = b(x, labels=labels, return_logits=False)
    assert ob.logits is None
    torch.testing.assert_close(ob.loss, oa.loss, rtol=1e-6, atol=1e-6)
    oa.loss.backward()
    ob.loss.backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_logits_to_keep_and_preallocated_kv_slots():
    model = looplm.build("tiny-llama").eval()
    x = torch.randint(0, 260, (2, 9))
    with torch.no_grad():
        full = model(x).logits
        torch.testing.assert_close(model(x, logits_to_keep=1).logits, full[:, -1:])
        c1, c2 = model.new_cache(2), model.new_cache(2, capacity=12)
        a = [model(x[:, :5], cache=c1).logits] + [model(x[:, t : t + 1], cache=c1).logits for t in range(5, 9)]
        b = [model(x[:, :5], cache=c2).logits] + [model(x[:, t : t + 1], cache=c2).logits for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(b, 1), torch.cat(a, 1))
    slot = next(s for s in c2.slots.values() if isinstance(s, KVCache))
    assert slot._k.shape[2] == 12 and slot.seqlen == 9  # allocated once, filled in place
    with pytest.raises(ValueError, match="loss needs the logits"):
        model(x, labels=x, logits_to_keep=1)
    kv = KVCache(capacity=3)
    kv.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    with pytest.raises(ValueError, match="capacity 3 exceeded"):
        kv.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))


@pytest.mark.kernels
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mamba2"])
def test_generate_on_bf16_weights(name):
    torch.manual_seed(0)
    model = looplm.build(name).eval()
    x = torch.randint(0, 260, (2, 6))
    bf = looplm.build(name, dtype=torch.bfloat16).eval()
    bf.load_state_dict(model.state_dict())
    assert next(bf.parameters()).dtype == torch.bfloat16
    a = bf.generate(x, max_new_tokens=6)
    b = generate(bf, x, max_new_tokens=6, use_cache=False)
    assert a.shape == (2, 12) and torch.equal(a[:, :6], x)
    # cached and uncached bf16 decoding agree on (almost) every token; both are bf16 computations
    assert (a == b).float().mean() >= 0.9


_FAULTS_SCRIPT = """
import resource, sys, torch
from looplm.utils import cpu_malloc
kept = cpu_malloc.keep_freed_memory() if sys.argv[1] == "keep" else False
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.zeros(16 * 2**20); del x  # 64 MB allocated and freed, as a training step does
counts = []
for _ in range(9):  # allocated again and freed, nine times: the page faults of each
    before = faults(); y = torch.zeros(16 * 2**20); counts.append(faults() - before); del y
print(kept, *counts)
"""


@pytest.mark.skipif(
    not __import__("looplm.utils.cpu_malloc").utils.cpu_malloc.supported(), reason="needs Linux with glibc"
)
def test_cpu_malloc_reuses_freed_pages_instead_of_faulting_new_ones():
    """``keep_freed_memory``: a 64 MB tensor allocated again after a free touches no new page (the
    system default maps it fresh: one fault per 4 KiB page, 16k faults). Own processes: the setting
    is process-wide. The median of nine re-allocations: on the development VM the kernel's memory
    reclaim now and then takes freed pages back (about one re-allocation in ten faults them in)."""
    import statistics
    import subprocess
    import sys

    def run(mode):
        out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, mode], capture_output=True, text=True, check=True)
        kept, *counts = out.stdout.split()
        return kept == "True", [int(c) for c in counts]

    kept, faults_kept = run("keep")
    _, faults_default = run("default")
    assert kept
    assert statistics.median(faults_default) > 10_000, faults_default  # 64 MB / 4 KiB = 16,384 fresh pages
    assert statistics.median(faults_kept) < 100, faults_kept


def test_cpu_malloc_setting_resolves_and_validates():
    from looplm.utils import cpu_malloc
    from looplm.train import load_train_config

    assert cpu_malloc.resolve(True, "cuda") and not cpu_malloc.resolve(False, "cpu")
    assert cpu_malloc.resolve("auto", "cpu") == cpu_malloc.supported()
    assert not cpu_malloc.resolve("auto", "cuda")
    with pytest.raises(ValueError, match="cpu_malloc: must be true, false or 'auto'"):
        load_train_config({"model": "tiny-llama", "train": {"cpu_malloc": "yes"}})
