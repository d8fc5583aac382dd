"""What ``generate`` hands to its decode paths: the arguments every path takes alike, bundled once
(``looplm.decode.generate._Decoding``), the same objects by name on every path, and which path each call takes;
and ``looplm.serve``'s API list, derived from the engine's."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import looplm
from looplm.decode import depth_schedule, speculative
from looplm.decode import generate as gen
from looplm.decode.sampling import sample_next
from looplm.decode.static_schedule import StaticDepthDecoder

NAMES = [f.name for f in dataclasses.fields(gen._Decoding)]


def _args(**kw) -> gen._Decoding:
    base = dict(
        do_sample=True,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        eos_token_id=None,
        pad_token_id=None,
        attention_mask=None,
        generator=torch.Generator().manual_seed(0),
        loop_options=None,
        return_stats=False,
    )
    return gen._Decoding(**{**base, **kw})


def test_the_shared_arguments_are_the_keywords_of_the_depth_and_speculative_paths():
    for fn in (depth_schedule.depth_batched_generate, speculative._speculative_generate):
        assert set(NAMES) <= set(inspect.signature(fn).parameters), fn.__name__


def test_kwargs_hands_down_the_objects_themselves():
    a = _args(attention_mask=torch.ones(2, 3, dtype=torch.long), loop_options={"exit_threshold": 0.5})
    kw = a.kwargs()
    assert list(kw) == NAMES
    assert all(kw[n] is getattr(a, n) for n in NAMES)  # (not copies: the caller's generator draws)


@pytest.mark.parametrize("pad, eos, want", [(None, None, 0), (None, 7, 7), (3, 7, 3), (0, 7, 0), (3, None, 3)])
def test_pad_is_the_pad_id_else_the_eos_id_else_0(pad, eos, want):
    assert _args(pad_token_id=pad, eos_token_id=eos).pad == want


def test_pick_is_sample_next_with_the_arguments():
    logits = torch.randn(4, 50)
    got = _args(generator=torch.Generator().manual_seed(1)).pick(logits)
    assert torch.equal(got, sample_next(logits, True, 0.7, 5, 0.9, torch.Generator().manual_seed(1)))
    assert torch.equal(_args(do_sample=False).pick(logits), logits.argmax(-1))


@pytest.fixture
def calls(monkeypatch):
    """Each decode path replaced by a stub that records its arguments: ``[(path, args, kwargs)]``."""
    seen = []

    def stub(name):
        def f(*a, **kw):
            seen.append((name, a, kw))
            return "ids"

        return f

    monkeypatch.setattr(depth_schedule, "depth_batched_generate", stub("depth"))
    monkeypatch.setattr(speculative, "speculative_generate", stub("speculative"))
    monkeypatch.setattr(gen, "_generate_adaptive", stub("token"))
    monkeypatch.setattr(gen, "_decode", stub("lean"))
    return seen


@pytest.mark.parametrize(
    "kw, path",
    [
        ({}, "lean"),
        ({"exit": "kl:0.0"}, "lean"),  # an exit that is off: the lean loop
        ({"exit": "kl:0.05"}, "token"),
        ({"exit": {"criterion": "kl", "threshold": 0.05, "schedule": "depth"}}, "depth"),
        ({"exit": {"criterion": "convergence", "threshold": 0.3, "schedule": "static"}}, "static"),
        ({"exit": {"criterion": "kl", "threshold": 0.0, "schedule": "depth"}, "return_stats": True}, "token"),
        ({"return_stats": True}, "token"),  # full depth, counted by the adaptive driver
        ({"speculative": 1}, "speculative"),
    ],
)
def test_each_path_gets_the_same_arguments(calls, kw, path):
    torch.manual_seed(0)
    m = looplm.build("tiny-llama", n_loops=3).eval()
    ids = torch.randint(0, 250, (2, 5))
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, 5, dtype=torch.long)
    given = dict(do_sample=True, temperature=0.5, top_k=3, top_p=0.8, eos_token_id=9, pad_token_id=1)
    given |= dict(attention_mask=mask, generator=g, loop_options=None, return_stats=kw.pop("return_stats", False))
    assert m.generate(ids, 4, **given, **kw) == "ids"
    [(name, a, got)] = calls
    assert name == ("depth" if path == "static" else path)
    if path in ("depth", "static", "speculative"):  # by name, the caller's objects
        assert (
            a[0] is m
            and a[1] is ids
            and a[2] == 4
            and set(got) == set(given) | ({"decoder"} if name == "depth" else set())
        )
        assert all(got[n] is given[n] for n in given)
        if name == "depth":
            assert got["decoder"] is (StaticDepthDecoder if path == "static" else None)
    else:  # one _Decoding of them
        args = a[-1]
        assert isinstance(args, gen._Decoding) and all(getattr(args, n) is given[n] for n in given)


def test_serve_exports_the_engine_names_it_imports():
    import looplm.serve as serve
    from looplm.serve import engine

    assert serve.__all__ == [
        "Engine",
        "EngineClosed",
        "EngineConfig",
        "FieldError",
        "FinishEvent",
        "PromptEvent",
        "QueueFull",
        "RequestError",
        "RequestHandle",
        "SamplingParams",
        "TokenEvent",
    ]
    assert all(getattr(serve, n) is getattr(engine, n) for n in serve.__all__)
    assert "parse_kv_budget" not in vars(serve)
