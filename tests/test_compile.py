"""The looped forward compiles with torch.compile without graph breaks, and computes the same thing."""

import pytest
import torch

import looplm
from looplm.parallel import CheckpointedCore, apply_activation_checkpointing


@pytest.mark.parametrize("name", ["tiny-coreloop", "tiny-mamba2"])
def test_no_graph_breaks(name):
    torch._dynamo.reset()
    model = looplm.build(name)
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    explanation = torch._dynamo.explain(model)(x, labels=x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("name", ["tiny-coreloop", "tiny-mamba2"])
def test_compiled_model_matches_eager_loss_and_gradients(name):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = looplm.build(name)
    compiled_model = looplm.build(name)
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model)
    x = torch.randint(0, eager.config.vocab_size, (2, 16))
    a, b = eager(x, labels=x), compiled(x, labels=x)
    torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b.loss, a.loss, atol=1e-5, rtol=1e-5)
    a.loss.backward()
    b.loss.backward()
    for (n, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-4, rtol=1e-3, msg=n)


def test_activation_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    a = looplm.build("tiny-coreloop")
    b = looplm.build("tiny-coreloop")
    b.load_state_dict(a.state_dict())
    apply_activation_checkpointing(b)
    apply_activation_checkpointing(b)  # idempotent
    assert isinstance(b.core, CheckpointedCore) and isinstance(b.core.stack, torch.nn.Module)
    assert b.state_dict().keys() == a.state_dict().keys()  # wrapping keeps every parameter name
    x = torch.randint(0, 260, (2, 16))
    a(x, labels=x).loss.backward()
    b(x, labels=x).loss.backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    with torch.no_grad():  # decoding through a checkpointed model gives the same tokens
        assert torch.equal(b.generate(x[:, :4], max_new_tokens=3), a.generate(x[:, :4], max_new_tokens=3))


def test_compiled_blocks_do_not_recompile_for_random_loop_counts():
    import random

    import torch._dynamo.utils as dynamo_utils

    from looplm.parallel import compile_blocks

    torch._dynamo.reset()
    model = looplm.build("tiny-coreloop")
    compile_blocks(model, backend="eager")  # dynamo's guards decide recompiles, whatever the backend
    x = torch.randint(0, 260, (2, 16))
    rng = random.Random(0)

    def step(loops, grad_loops):
        model(x, labels=x, num_loops=loops, num_grad_loops=grad_loops).loss.backward()

    step(3, None)
    step(4, 1)  # warm-up: with and without the no-grad prefix
    warm = dynamo_utils.counters["stats"]["unique_graphs"]
    for _ in range(20):
        step(rng.randint(1, 6), rng.choice([None, 1, 2]))
    assert dynamo_utils.counters["stats"]["unique_graphs"] == warm


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-stateloop", "tiny-mamba2", "tiny-hybrid"])
def test_compiled_blocks_decode_like_eager_without_recompiling(name):
    """The compiled decode step (``compile_blocks`` + ``generate``, ``looplm generate --compile``): the same
    greedy tokens as eager decoding, and after a warm-up no new graphs for other prompt lengths, lengths
    of generation or positions in the KV cache."""
    import torch._dynamo.utils as dynamo_utils

    from looplm.parallel import compile_blocks

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = looplm.build(name).eval()
    model = looplm.build(name).eval()
    model.load_state_dict(eager.state_dict())
    compile_blocks(model, backend="eager")
    V = model.config.vocab_size

    def both(T, new):
        x = torch.randint(0, V, (2, T))
        with torch.no_grad():
            assert torch.equal(model.generate(x, max_new_tokens=new), eager.generate(x, max_new_tokens=new))

    both(5, 4)
    both(9, 3)  # warm-up: a second prompt length makes the sequence dimension dynamic
    warm = dynamo_utils.counters["stats"]["unique_graphs"]
    for T, new in [(7, 6), (3, 9), (12, 2)]:
        both(T, new)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == warm


def test_bf16_autocast_casts_each_looped_weight_once_per_forward():
    """The looped core's weights are cast to bf16 once per forward, not once per iteration
    (autocast caches the casts of leaf parameters for the life of the autocast region)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCasts(TorchDispatchMode):
        def __init__(self, ptrs):
            super().__init__()
            self.ptrs, self.n = ptrs, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.ptrs:
                self.n += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for loops in (1, 4):
        model = looplm.build("tiny-llama", n_loops=loops)
        ptrs = {p.data_ptr() for p in model.parameters() if p.dim() == 2}
        x = torch.randint(0, 260, (2, 8))
        with CountCasts(ptrs) as mode, torch.autocast("cpu", dtype=torch.bfloat16):
            model(x, labels=x)
        counts[loops] = mode.n
    assert counts[1] > 0 and counts[4] == counts[1]
