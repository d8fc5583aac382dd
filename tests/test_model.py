"""The loop driver: K loops == K unrolled core calls, caches, padding, inputs, errors."""

import pytest
import torch

import looplm
from looplm.config import ConfigError, ModelConfig

TINY = ["tiny-llama", "tiny-qwen3", "tiny-coreloop", "tiny-mamba2", "tiny-hybrid"]


@pytest.mark.parametrize("name", TINY)
def test_loop_equals_unrolled_core_calls(name):
    model = looplm.build(name).eval()
    cfg = model.config
    x = torch.randint(0, cfg.vocab_size, (2, 10))
    with torch.no_grad():
        ref = model(x).logits
        # unrolled by hand: embed -> prelude -> core K times -> coda -> norm -> head
        fctx = model.forward_context(x, None, None, 0)
        h = model.embed(x) * model.embed_multiplier
        for blk in model.prelude.blocks:
            h = blk(h, fctx)
        for _ in range(cfg.n_loops):
            for blk in model.core.stack.blocks:
                h = blk(h, fctx)
        for blk in model.coda.blocks:
            h = blk(h, fctx)
        manual = model.lm_head(model.norm(h))
    torch.testing.assert_close(ref, manual, atol=1e-6, rtol=1e-6)


def test_num_loops_changes_depth_and_matches_a_config_with_that_k():
    model = looplm.build("tiny-llama").eval()
    x = torch.randint(0, 260, (1, 8))
    other = looplm.LoopedLM(model.config.replace(n_loops=5)).eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        a = model(x, num_loops=5).logits
        b = other(x).logits
        c = model(x).logits
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)


def test_output_iterations_are_the_core_outputs():
    model = looplm.build("tiny-llama").eval()
    x = torch.randint(0, 260, (2, 8))
    with torch.no_grad():
        out = model(x, output_iterations=True, output_hidden=True)
        assert len(out.iterations) == 3
        torch.testing.assert_close(model.lm_head(model.norm(out.iterations[-1])), out.logits)
        torch.testing.assert_close(out.hidden, model.norm(out.iterations[-1]))
        short = model(x, num_loops=2).logits
        torch.testing.assert_close(model.lm_head(model.norm(out.iterations[1])), short)
    assert model(x).iterations is None


def test_truncated_backprop_only_reaches_last_loops():
    model = looplm.build("tiny-coreloop")
    x = torch.randint(0, 260, (2, 8))
    # with 1 gradient loop, the prelude still gets gradients only through... nothing (vanilla rule) -> no grad
    model(x, labels=x, num_grad_loops=1).loss.backward()
    assert model.prelude.blocks[0].mlp.up_proj.weight.grad is None
    assert model.core.stack.blocks[0].mlp.up_proj.weight.grad is not None
    model.zero_grad(set_to_none=True)
    model(x, labels=x).loss.backward()
    assert model.prelude.blocks[0].mlp.up_proj.weight.grad is not None


def test_loss_is_shifted_cross_entropy_with_ignore_index():
    model = looplm.build("tiny-llama")
    x = torch.randint(0, 260, (2, 9))
    labels = x.clone()
    labels[0, 3] = -100
    out = model(x, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, 260)
    ref = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, ref)


@pytest.mark.parametrize("return_logits", [True, False])
def test_tied_embedding_gradient_is_dense_and_equals_the_dense_lookup(return_logits):
    """With a loss on a tied model the lookup's gradient is sparse and lands in the head's dense one: the
    weight's gradient is a dense tensor equal to the one of a plain dense lookup, also accumulated over two
    backward passes (micro-batches); an untied embedding keeps a dense gradient of its own."""
    torch.manual_seed(0)
    tied = looplm.build("tiny-llama", tie_embeddings=True)
    assert tied.config.tie_embeddings and tied.lm_head.weight is tied.embed.weight
    x = torch.randint(0, 260, (2, 9))
    for _ in range(2):
        tied(x, labels=x, return_logits=return_logits).loss.backward()
    got = tied.embed.weight.grad
    assert got.layout == torch.strided and got.is_contiguous()
    want = {}
    for n, p in tied.named_parameters():
        want[n], p.grad = p.grad, None
    dense = tied._embed
    tied._embed = lambda ids, head_in_loss: dense(ids, head_in_loss=False)  # the plain nn.Embedding lookup
    for _ in range(2):
        tied(x, labels=x, return_logits=return_logits).loss.backward()
    for n, p in tied.named_parameters():
        torch.testing.assert_close(want[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)
    untied = looplm.build("tiny-llama")
    assert not untied.config.tie_embeddings
    untied(x, labels=x).loss.backward()
    assert untied.embed.weight.grad.layout == torch.strided


@pytest.mark.parametrize("name", TINY)
def test_cached_decoding_matches_full_forward(name):
    model = looplm.build(name).eval()
    x = torch.randint(0, model.config.vocab_size, (2, 14))
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_cache(2)
        parts = [model(x[:, :5], cache=cache).logits]
        parts.append(model(x[:, 5:9], cache=cache).logits)  # multi-token continuation
        parts += [model(x[:, t : t + 1], cache=cache).logits for t in range(9, 14)]
    assert cache.seqlen == 14
    assert (
        len([k for k in cache.slots if k[0] != "rule"])
        == model.config.n_prelude + model.config.n_coda + model.config.n_core * model.config.n_loops
    )
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", TINY)
def test_left_padded_batch_equals_each_sequence_alone(name):
    model = looplm.build(name).eval()
    V = model.config.vocab_size
    a, b = torch.randint(0, V, (1, 11)), torch.randint(0, V, (1, 6))
    ids = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.zeros(2, 11, dtype=torch.long)
    ids[0], mask[0] = a[0], 1
    ids[1, 5:], mask[1, 5:] = b[0], 1
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        alone_a, alone_b = model(a).logits, model(b).logits
    torch.testing.assert_close(batch[0], alone_a[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(batch[1, 5:], alone_b[0], atol=2e-5, rtol=1e-4)
    # and generation: padded batch == each prompt alone (greedy)
    gen = model.generate(ids, max_new_tokens=5, attention_mask=mask)
    ga = model.generate(a, max_new_tokens=5)
    gb = model.generate(b, max_new_tokens=5)
    assert torch.equal(gen[0], ga[0]) and torch.equal(gen[1, 5:], gb[0])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mamba2"])
def test_generate_with_cache_equals_without(name):
    model = looplm.build(name).eval()
    x = torch.randint(0, 260, (2, 6))
    a = model.generate(x, max_new_tokens=8)
    b = looplm.decode.generate.generate(model, x, max_new_tokens=8, use_cache=False)
    assert a.shape == (2, 14) and torch.equal(a[:, :6], x)
    assert torch.equal(a, b)
    # r != K at decode time
    c = model.generate(x, max_new_tokens=4, num_loops=5)
    d = looplm.decode.generate.generate(model, x, max_new_tokens=4, num_loops=5, use_cache=False)
    assert torch.equal(c, d)


def test_generate_sampling_and_eos():
    model = looplm.build("tiny-llama").eval()
    x = torch.randint(0, 260, (3, 4))
    g = torch.Generator().manual_seed(1)
    s1 = model.generate(x, max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, generator=g)
    g = torch.Generator().manual_seed(1)
    s2 = model.generate(x, max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, generator=g)
    assert torch.equal(s1, s2)
    greedy = model.generate(x, max_new_tokens=6)
    eos = int(greedy[0, 4])  # the first greedy token of row 0 becomes "eos"
    out = model.generate(x, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    assert out[0, 4] == eos and (out[0, 5:] == 0).all()


def test_top_k_and_top_p_restrict_the_sampled_tokens():
    from looplm.decode.generate import sample_next

    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(4000, 4)
    g = torch.Generator().manual_seed(0)

    def support(**kw):
        return set(sample_next(logits, True, 1.0, generator=g, **{"top_k": None, "top_p": None, **kw}).tolist())

    assert support() == {0, 1, 2, 3}
    assert support(top_k=2) == {1, 3}
    assert support(top_k=1) == {1}
    assert support(top_p=0.7) == {1, 3}  # 0.5 < 0.7 keeps token 3; 0.5 + 0.3 > 0.7 drops the rest
    assert support(top_p=0.45) == {1}
    assert support(top_p=0.9) == {1, 2, 3}
    assert support(top_p=1.0) == {0, 1, 2, 3}
    assert support(top_k=3, top_p=0.7) == {1, 3}


def test_generate_arguments_are_checked_up_front():
    model = looplm.build("tiny-llama").eval()
    x = torch.randint(0, 260, (2, 4))
    for kw, msg in [
        (dict(do_sample=True, top_p=0.0), "top_p must be in"),
        (dict(do_sample=True, top_p=1.5), "top_p must be in"),
        (dict(top_k=-1), "top_k must be"),
        (dict(temperature=-0.1), "temperature must be"),
        (dict(max_new_tokens=-1), "max_new_tokens must be"),
        (dict(attention_mask=torch.ones(2, 3)), "attention_mask must have the shape"),
        (dict(max_new_tokens=600), "exceeds the model's max_seq_len=512"),
        (dict(num_loops=2.5), "num_loops must be a positive int"),
    ]:
        with pytest.raises((ValueError, TypeError), match=msg):
            model.generate(x, **{"max_new_tokens": 2, **kw})
    # the max_seq_len check fires before any decoding work
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="max_seq_len"):
        model.generate(x, max_new_tokens=509)
    handle.remove()
    assert calls == []
    assert model.generate(x, max_new_tokens=508).shape == (2, 512)


def test_input_errors_are_clear():
    model = looplm.build("tiny-llama")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.tensor([[1, 2, 260]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 513, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[batch, seq_len\]"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="num_loops"):
        model(torch.zeros(1, 3, dtype=torch.long), num_loops=0)


def test_config_errors_name_every_bad_field():
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(
            dict(
                d_model=60,
                n_loops=0,
                n_core=0,
                attention=dict(n_heads=8, n_kv_heads=3, n_head=2),
                mixer="attention",
                attn_layer_idx=[7],
                vocab_sise=3,
            )
        )
    msg = str(e.value)
    for needle in [
        "n_loops",
        "n_core",
        "n_kv_heads",
        "does not divide d_model",
        "attn_layer_idx",
        "vocab_sise",
        "did you mean 'vocab_size'",
        "attention.n_head",
        "did you mean 'n_heads'",
    ]:
        assert needle in msg, needle
    assert isinstance(e.value, ValueError)
    with pytest.raises(ConfigError, match="ngroups"):
        ModelConfig(mixer="mamba2", d_ff=0, mamba=looplm.config.Mamba2Config(headdim=16, ngroups=3))
    with pytest.raises(ConfigError, match="unknown rule"):
        ModelConfig.from_dict(dict(rule=dict(name="vanila")))
    with pytest.raises(ValueError, match="unknown preset"):
        looplm.build("tiny-lama")


def test_meta_build_and_overrides():
    m = looplm.build("tiny-llama", n_loops=7, overrides={"attention.n_kv_heads": 4})
    assert m.config.n_loops == 7 and m.config.n_kv_heads == 4
    meta = looplm.build("qwen3-0.6b", device="meta")
    assert meta.embed.weight.is_meta
    # every buffer joins the parameters (RoPE's inverse frequencies are computed on the CPU: a CUDA build
    # once kept them there)
    assert all(b.is_meta for b in meta.buffers())
    assert meta.lm_head.weight is meta.embed.weight  # tied


def test_init_statistics():
    model = looplm.build("tiny-llama", d_model=256, d_ff=512, attention={"n_heads": 4, "n_kv_heads": 2})
    w = model.core.stack.blocks[0].mlp.up_proj.weight
    assert abs(w.std().item() - 0.02) < 0.002
    assert torch.all(model.norm.weight == 1)


# ------------------------------------------------------------------------------------- bad inputs, refused up front
def test_num_grad_loops_must_be_a_positive_int():
    model = looplm.build("tiny-llama").train()
    x = torch.randint(0, 256, (1, 8))
    for bad in (0, -1, 2.5, True, "2"):  # 0 / -1 / 2.5 used to train the core with zero gradient
        with pytest.raises(ValueError, match=f"num_grad_loops must be None .* or an int >= 1, got {bad!r}"):
            model(x, labels=x, num_grad_loops=bad)
    model(x, labels=x, num_grad_loops=1).loss.backward()
    assert model.core.stack.blocks[0].mlp.down_proj.weight.grad.abs().sum() > 0


def test_sampling_temperature_must_be_finite():
    model = looplm.build("tiny-llama").eval()
    x = torch.randint(0, 256, (1, 4))
    for bad in (float("nan"), float("inf"), -1.0, None):  # NaN reached torch.multinomial
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            model.generate(x, max_new_tokens=2, do_sample=True, temperature=bad)


def test_unknown_loop_options_are_refused_naming_the_known_ones():
    x = torch.randint(0, 256, (1, 6))
    gate = looplm.build("tiny-llama", overrides={"rule.name": "exit_gate"}).eval()
    with pytest.raises(
        ValueError,
        match=r"\['exit_treshold'\]: not read by the recurrence rule 'exit_gate' \(did you mean "
        r"'exit_threshold'\?\); it reads: 'exit_threshold'",
    ):
        gate(x, loop_options={"exit_treshold": 0.5})  # was silently ignored: q stayed the rule's default
    gate(x, loop_options={"exit_threshold": 0.5})
    with pytest.raises(ValueError, match="not read by the recurrence rule 'vanilla'; it reads: none"):
        looplm.build("tiny-llama").eval()(x, loop_options={"exit_threshold": 0.5})
    from looplm.recurrence import RULES

    assert RULES["stateloop"].loop_options == ("read_scale", "state_hook") and RULES["timestep"].loop_options == (
        "grid",
    )


def test_every_loop_option_a_rule_reads_is_declared():
    """A rule file that reads ``lctx.loop_options.get(KEY)`` declares KEY in some rule's ``loop_options``."""
    import re
    from pathlib import Path

    import looplm.recurrence as rec
    from looplm.recurrence import RULES

    declared = {k for cls in RULES.values() for k in cls.loop_options}
    read = set()
    for f in Path(rec.__file__).parent.glob("*.py"):
        read |= set(re.findall(r"loop_options\.get\(\s*[\"'](\w+)[\"']", f.read_text()))
    assert read and read <= declared, read - declared


def test_a_cache_of_another_model_is_refused_up_front():
    wide, narrow = looplm.build("tiny-llama"), looplm.build("tiny-llama", d_model=32, d_ff=64)
    x = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        cache = wide.new_cache(1)
        wide(x, cache=cache)
        with pytest.raises(
            ValueError, match=r"this cache belongs to another model \(d_model 64 vs 32.*model.new_cache"
        ):
            narrow(x[:, :1], cache=cache)  # was a raw size error deep inside attention
        with pytest.raises(ValueError, match="belongs to another model"):
            narrow(x, cache=wide.new_cache(1))
        from looplm.cache import LoopCache

        own = LoopCache(narrow.config.n_loops, 1)  # made by hand: it belongs to the first model that fills it
        narrow(x, cache=own)
        with pytest.raises(ValueError, match="belongs to another model"):
            wide(x[:, :1], cache=own)
