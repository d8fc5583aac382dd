"""The looped forward compiles with torch.compile without graph breaks at a fixed K."""

import pytest
import torch

import looplm
from looplm.parallel import apply_activation_checkpointing


@pytest.mark.parametrize("name", ["tiny-coreloop", "tiny-mamba2"])
def test_no_graph_breaks(name):
    torch._dynamo.reset()
    model = looplm.build(name)
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    explanation = torch._dynamo.explain(model)(x, labels=x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_activation_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    a = looplm.build("tiny-coreloop")
    b = looplm.build("tiny-coreloop")
    b.load_state_dict(a.state_dict())
    apply_activation_checkpointing(b)
    apply_activation_checkpointing(b)  # idempotent
    x = torch.randint(0, 260, (2, 16))
    a(x, labels=x).loss.backward()
    b(x, labels=x).loss.backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    with torch.no_grad():  # decoding through a checkpointed model still works
        assert b.generate(x[:, :4], max_new_tokens=3).shape == (2, 7)
