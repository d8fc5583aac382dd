"""Pipeline stages of the vLLM plugin (``looplm.vllm.stages``; pure, no vLLM): the looped core whole on one
rank, the cuts between prelude, core and coda balancing block calls, refusals by name."""

from __future__ import annotations

import pytest

from looplm import load_model_config
from looplm.vllm.stages import Stage, pipeline_refusal, pipeline_stages


def _cfg(preset="tiny-coreloop", **over):
    return load_model_config(preset, over)


def test_one_rank_holds_everything():
    c = _cfg()  # (1, 2, 3, 1)
    (st,) = pipeline_stages(c, 3, 1)
    assert st == Stage(0, (0,), True, (3,), True, True)
    assert pipeline_refusal(c, 3, 1) is None


def test_core_stays_whole_and_cuts_balance_block_calls():
    c = _cfg()  # units: prelude 0 (1), core (3 loops x 2 = 6), coda 3 (1)
    a, b = pipeline_stages(c, 3, 2)
    assert (a.prelude, a.core, a.coda, a.first, a.last) == ((0,), False, (), True, False)
    assert (b.prelude, b.core, b.coda, b.first, b.last) == ((), True, (3,), False, True)
    assert a.holds("prelude", 0) and not a.holds("core", 1) and not a.holds("rule", None)
    assert b.holds("core", 2) and b.holds("rule", None) and b.holds("coda", 3) and not b.holds("prelude", 0)
    three = pipeline_stages(c, 3, 3)
    assert [(s.prelude, s.core, s.coda) for s in three] == [((0,), False, ()), ((), True, ()), ((), False, (3,))]
    # a heavy prelude: 4 prelude blocks (cost 4) against a core of 2 x 1 loop (cost 2) and no coda
    c = _cfg("tiny-llama", n_prelude=4, n_loops=1)
    st = pipeline_stages(c, 1, 2)
    assert [(s.prelude, s.core) for s in st] == [((0, 1, 2), False), ((3,), True)]  # 3 | 1 + 2 (not 2 | 2 + 2)
    assert max(len(s.prelude) + 2 * s.core for s in st) == 3


@pytest.mark.parametrize(
    "preset, over, pp, reason",
    [
        ("tiny-llama", {}, 2, "1 unit(s) here (p = 0, c = 0)"),  # the whole depth is the looped core
        ("tiny-coreloop", {}, 4, "3 unit(s) here (p = 1, c = 1); serve at pipeline-parallel size <= 3"),
        ("tiny-coreloop", {"rule": {"name": "ponderlm"}}, 2, "PonderLM at pipeline-parallel size 2"),
        ("tiny-hybrid", {"n_prelude": 1, "n_core": 1, "n_coda": 1}, 2, "Mamba-2 blocks at pipeline-parallel size 2"),
    ],
)
def test_sizes_and_designs_that_do_not_pipeline_are_refused_by_name(preset, over, pp, reason):
    c = load_model_config(preset, over)
    why = pipeline_refusal(c, c.n_loops, pp)
    assert why is not None and reason in why, why
    with pytest.raises(ValueError, match="pipeline-parallel size"):
        pipeline_stages(c, c.n_loops, pp)


def test_exits_are_refused_under_pipeline_parallelism():
    c = _cfg()
    ex = {"criterion": "convergence", "threshold": 0.5, "kv": "copy", "min_loops": 1}
    assert "per-token exit" in pipeline_refusal(c, 3, 2, ex)
    assert pipeline_refusal(c, 3, 1, ex) is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match=f"pipeline-parallel size must be a positive int, got {bad!r}"):
        pipeline_refusal(_cfg(), 3, bad)
