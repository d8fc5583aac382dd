"""Request refill under continuous depth batching (exit ``max_batch``, looplm.decode.depth_schedule): a batch of N
prompts through fewer rows, a finished row taking the next prompt (its prompt at full depth in a cache of its
own, copied into the row's columns of every loop's slots). Each prompt's tokens equal the whole batch decoded
at once (itself held to the token schedule and to rows decoded alone: tests/test_depth_batch.py)."""

import pytest
import torch

import looplm
from looplm.decode.depth_schedule import DepthBatchedDecoder
from looplm.decode.scheduler import Request, RequestStatus, Scheduler
from looplm.serve.scheduler import Scheduler as ServedScheduler
from looplm.eval.decode_timing import queue_timing

from helpers import assert_refused_before_any_work

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(name):
    torch.manual_seed(0)
    return looplm.build(name).eval()


def _batch(seed=1, N=5, P=6, T=7, K=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (N, P), generator=g)
    mask = torch.ones(N, P, dtype=torch.long)
    mask[1, :3], mask[4, :2] = 0, 0  # left padding, also in refilled rows
    depths = torch.randint(1, K + 1, (N, T), generator=g)
    return ids, mask, depths


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid", "tiny-stateloop"])
@pytest.mark.parametrize("kv", ["copy", "propagate", "shared"])
def test_refilled_rows_decode_each_prompt_as_the_whole_batch_does(name, kv):
    """Replayed per-prompt, per-token depths: every prompt's tokens through 1, 2 or 3 rows equal the batch of 5
    decoded at once, and the work counted is the same tokens' (a prompt's depths follow it into any row)."""
    m = _model(name)
    ids, mask, depths = _batch(K=m.config.n_loops)
    ex = dict(criterion="replay", depths=depths, kv=kv, schedule="depth")
    whole, st = m.generate(ids, 7, attention_mask=mask, exit=ex, return_stats=True)
    for rows in (1, 2, 3):
        q, sq = m.generate(ids, 7, attention_mask=mask, exit={**ex, "max_batch": rows}, return_stats=True)
        assert torch.equal(q, whole), rows
        assert sq.summary()["tokens"] == st.summary()["tokens"] == 5 * 6
        for f in ("core_flops", "fill_flops", "fill_bytes", "other_flops", "full_core_flops"):
            assert getattr(sq, f) == pytest.approx(getattr(st, f)), (rows, f)
        assert sq.batch_size == rows and sq.core_calls >= st.core_calls  # fewer rows: at least as many passes


def test_a_mamba2_core_takes_the_refilled_prompts_state_and_a_broken_copy_is_caught(monkeypatch):
    """The prompt's per-loop Mamba-2 states and KV are copied into the row: without the copy of the attention
    slots the tokens differ (the test can fail), with it they equal the whole batch's (kl criterion, eos)."""
    import looplm.decode.depth_schedule as db

    m = _model("tiny-hybrid")
    ids, mask, _ = _batch(seed=3)
    ex = dict(criterion="kl", threshold=0.05, schedule="depth", ssm="propagate")
    whole = m.generate(ids, 7, attention_mask=mask, exit=ex)
    eos = int(whole[0, 8])  # a token prompt 0 emits early: its row is refilled sooner
    whole = m.generate(ids, 7, attention_mask=mask, exit=ex, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(
        m.generate(ids, 7, attention_mask=mask, exit={**ex, "max_batch": 2}, eos_token_id=eos, pad_token_id=0), whole
    )
    real = db._copy_rows
    monkeypatch.setattr(
        db, "_copy_rows", lambda src, dst, rows, P: real(src, dst, rows, P) if hasattr(src, "conv_state") else None
    )
    assert not torch.equal(
        m.generate(ids, 7, attention_mask=mask, exit={**ex, "max_batch": 2}, eos_token_id=eos, pad_token_id=0), whole
    )


def test_refill_leaves_the_prompts_out_of_the_decode_time_and_keeps_the_cache_bounds():
    m = _model("tiny-llama")
    ids, _, _ = _batch()
    dec = DepthBatchedDecoder(
        m, 2, 6 + 7, {"criterion": "replay", "depths": 2, "schedule": "depth", "max_batch": 2}, prompts=5
    )
    out = dec.run(ids, 7, None, lambda lg: lg.max(-1).indices, None, 0)
    assert out.shape == (5, 13) and dec.prompt_seconds > 0 and dec.decode_seconds > 0
    assert dec.cache.seqlen == 6 + 7 - 1
    bad = ids.clone()
    bad[4, 2] = m.config.vocab_size  # a queued prompt's token out of range: refused before any prompt runs
    fresh = DepthBatchedDecoder(
        m, 2, 13, {"criterion": "replay", "depths": 2, "schedule": "depth", "max_batch": 2}, prompts=5
    )
    with pytest.raises(ValueError, match="token id"):
        fresh.run(bad, 7, None, lambda lg: lg.max(-1).indices, None, 0)
    assert fresh.cache.seqlen == 0
    with pytest.raises(ValueError, match="decodes 2 rows; input_ids has 1"):
        DepthBatchedDecoder(m, 2, 13, {"criterion": "replay", "depths": 2, "schedule": "depth"}).run(
            ids[:1], 7, None, lambda lg: lg.max(-1).indices, None, 0
        )


@pytest.mark.parametrize(
    "spec,match",
    [
        ({"criterion": "kl", "threshold": 0.1, "schedule": "depth", "max_batch": 0}, "max_batch must be an int >= 1"),
        ({"criterion": "kl", "threshold": 0.1, "schedule": "depth", "max_batch": 1.5}, "max_batch must be an int >= 1"),
        (
            {"criterion": "kl", "threshold": 0.1, "schedule": "depth", "max_batch": True},
            "max_batch must be an int >= 1",
        ),
        ({"criterion": "kl", "threshold": 0.1, "max_batch": 2}, "runs under schedule='depth' only"),
        (
            {"criterion": "convergence", "threshold": 0.1, "schedule": "static", "max_batch": 2},
            "runs under schedule='depth' only",
        ),
    ],
)
def test_bad_max_batch_is_refused_before_any_work(spec, match):
    m = _model("tiny-llama")
    assert_refused_before_any_work(m, lambda: m.generate(torch.randint(0, 128, (4, 3)), 4, exit=spec), match)


def test_queue_timing_times_refill_against_full_depth_batches():
    m = _model("tiny-llama")
    spec = {"criterion": "replay", "depths": 2, "schedule": "depth"}
    mk = lambda b, c, n: DepthBatchedDecoder(m, b, c, {**spec, "max_batch": b}, prompts=n)  # noqa: E731
    res = queue_timing(m, torch.randint(0, 250, (4, 4)), 2, 5, mk, runs=1)
    assert res["full"]["ratio"] == 1.0 and res["refill"]["ms_per_token"] > 0
    assert res["refill"]["stats"]["tokens"] == 4 * 4 and res["refill"]["stats"]["executed_depth"] == 2
    with pytest.raises(ValueError, match="do not split into batches of rows=3"):
        queue_timing(m, torch.randint(0, 250, (4, 4)), 3, 5, mk, runs=1)


def _scheduled_admissions(N, rows, P, T, depths):
    """A :class:`Scheduler` driven with no model, as the offline run drives it: prompt ``i`` is a request of ``T``
    tokens; a token of prompt ``i`` with decoded-token index ``j`` exits ``depths[i, j]`` passes after it starts
    (the replay criterion), the cohorts' exits in start order. Returns the admissions: per admission, ``[(prompt,
    row)]``."""
    s = Scheduler(max_batch=rows, max_waiting=N, prefill_chunk=N * P, batch_prefill=True)
    for i in range(N):
        s.add(Request(i, [1] * P, T))
    admissions, cohorts = [], []  # cohorts: [[row, passes left]], the oldest first
    while True:
        while plan := s.schedule_prefill():
            admissions.append([(c.request.id, c.request.row) for c in plan])
            for c in plan:
                s.place(c.request)
                s.append_token(c.request, 0, 4)
        start = s.schedule_decode()
        if not s.in_flight:
            return admissions
        if start:
            cohorts.append([[t.row, int(depths[s.rows[t.row].id, s.rows[t.row].num_output_tokens - 1])] for t in start])
        exited = []
        for c in cohorts:
            for e in c:
                e[1] -= 1
            exited += [b for b, left in c if left == 0]
            c[:] = [e for e in c if e[1] > 0]
        cohorts = [c for c in cohorts if c]
        sample, _ = s.update_from_output(exited)
        for i in sample:
            req = s.rows[exited[i]]
            s.append_token(req, 0, 1)
            if req.num_output_tokens >= T:
                s.finish(req, RequestStatus.FINISHED_LENGTH)


def test_the_offline_run_admits_and_refills_through_the_engines_scheduler(monkeypatch):
    """One scheduler (issue 60): the offline run's admissions — which prompts take which rows, and in which order —
    are those of the serving engine's Scheduler (looplm.serve.scheduler, at home in looplm.decode.scheduler), driven
    here directly with no model, with the same prompts and each token's replayed depth. The run is spied through the
    Scheduler it builds, so a run that schedules on its own (or admits in another order) fails."""
    import looplm.decode.depth_schedule as db

    assert ServedScheduler is Scheduler
    seen = []  # the run's admissions

    class Spy(Scheduler):
        def schedule_prefill(self):
            plan = super().schedule_prefill()
            if plan:
                seen.append([(c.request.id, c.request.row) for c in plan])
            return plan

    refilled = []  # what the run's refills ran: [(prompt, row)]
    real = db.DepthBatchedDecoder._refill

    def refill(self, rows_h, input_ids, attention_mask, idx_h, *args):
        refilled.append(list(zip(idx_h, rows_h)))
        return real(self, rows_h, input_ids, attention_mask, idx_h, *args)

    monkeypatch.setattr(db, "Scheduler", Spy)
    monkeypatch.setattr(db.DepthBatchedDecoder, "_refill", refill)
    m = _model("tiny-llama")
    N, P, T, rows = 8, 6, 5, 3
    ids, mask, _ = _batch(N=N, P=P)
    depths = torch.tensor(
        [
            [2, 2, 2, 2, 1],
            [3, 3, 3, 2, 1],
            [1, 1, 2, 1, 2],
            [2, 2, 1, 3, 3],
            [1, 1, 2, 1, 2],
            [2, 2, 2, 3, 2],
            [3, 1, 3, 2, 2],
            [3, 2, 3, 1, 2],
        ]
    )  # [N, T] loops (K = 3)
    ex = dict(criterion="replay", depths=depths, kv="copy", schedule="depth")
    out = m.generate(ids, T, attention_mask=mask, exit={**ex, "max_batch": rows})
    want = _scheduled_admissions(N, rows, P, T, depths)
    assert seen == want and refilled == want[1:]
    assert want[0] == [(0, 0), (1, 1), (2, 2)] and len(want) > 2  # the first rows together, then refills
    assert any(r != sorted(r) for r in ([b for _, b in a] for a in want))  # rows taken in the order they freed
    assert torch.equal(out, m.generate(ids, T, attention_mask=mask, exit=ex))  # and each prompt decodes as in one batch
