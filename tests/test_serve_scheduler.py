"""The serving engine's scheduler (looplm.serve.scheduler) without a model, the way vLLM tests its scheduler: a small
simulated engine runs each plan (a prompt's last chunk places it and picks its first token; every token started exits at
the next pass unless a test holds it in flight), and the tests read the plans and the state. Admission under the KV
budget, FIFO order, max_batch and max_waiting, chunked prefill plans, preemption of the youngest (idle and in flight)
and its re-admission with the tokens it replays, aborts that free capacity, the token schedule, and bad input."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from looplm.serve.scheduler import Request, RequestStatus, Scheduler

RS = RequestStatus
# its home (looplm.serve.scheduler re-exports it)
SCHEDULER_PY = Path(__file__).resolve().parents[1] / "src" / "looplm" / "decode" / "scheduler.py"


def _req(rid, prompt_len=4, max_tokens=3):
    return Request(rid, list(range(1, prompt_len + 1)), max_tokens)


class Sim:
    """Runs plans as the engine does, with made-up tokens (``100 + index``) at depth 1."""

    def __init__(self, sched: Scheduler):
        self.s = sched
        self.flight: list[int] = []  # rows with a token in flight
        self.prefills: list[tuple] = []  # (request id, start, end) of every chunk run
        self.decoded: list[list] = []  # per step: the (row, token, forced depth) started
        self.batches: list[list] = []  # the request ids of each batched prefill

    def step(self, hold=()):
        """One step; rows in ``hold`` keep their token in flight through this pass."""
        s = self.s
        plan = s.schedule()
        self.decoded.append([(t.row, t.token_id, t.forced_depth) for t in plan.decode])
        self.flight += [t.row for t in plan.decode]
        if len(plan.prefill) > 1:
            self.batches.append([c.request.id for c in plan.prefill])
        for c in plan.prefill:
            self.prefills.append((c.request.id, c.start, c.end))
            if c.last:
                req = c.request
                if req.max_tokens == 0:
                    s.finish(req, RS.FINISHED_LENGTH)
                else:
                    s.place(req)
                    if req.next_token is None:
                        self.token(req)
        exits = [b for b in self.flight if b not in hold]
        self.flight = [b for b in self.flight if b in hold]
        if exits:
            sample, _ = s.update_from_output(exits)
            for i in sample:
                self.token(s.rows[exits[i]])
        return plan

    def token(self, req):
        self.s.append_token(req, 100 + req.num_output_tokens, 1 + req.num_output_tokens % 3)
        if req.num_output_tokens >= req.max_tokens:
            self.s.finish(req, RS.FINISHED_LENGTH)

    def run(self, steps=100):
        for _ in range(steps):
            if not self.s.num_held:
                return
            self.step()
        raise AssertionError("the requests did not finish")


def test_the_scheduler_imports_no_torch():
    """scheduler.py loaded alone (no package import) leaves torch unimported: it is pure Python."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('sched', {str(SCHEDULER_PY)!r})\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules['sched'] = mod; spec.loader.exec_module(mod)\n"
        "assert mod.Scheduler and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert importlib.util.find_spec("looplm.serve.scheduler") is not None
    import looplm.decode.scheduler as home
    import looplm.serve.scheduler as served

    assert served.Scheduler is home.Scheduler and served.Request is home.Request  # one scheduler, two import paths


def test_admission_is_fifo_one_prompt_a_step_and_bounded_by_max_batch():
    s = Scheduler(max_batch=2, max_waiting=8)
    sim = Sim(s)
    reqs = [_req(i, prompt_len=3, max_tokens=5) for i in range(1, 6)]
    for r in reqs:
        s.add(r)
    assert s.num_held == 5 and s.num_waiting == 5 and s.room() == 5
    sim.step()  # r1 prefilled whole, placed, its first token picked
    assert reqs[0].status is RS.RUNNING and reqs[0].row == 0 and reqs[0].num_cached == 3 and reqs[0].next_token == 100
    sim.step()  # r1 starts its token; r2 takes row 1
    assert sim.decoded[-1] == [(0, 100, 0)] and reqs[1].row == 1
    plan = sim.step()  # no free row: no prefill
    assert plan.prefill == [] and s.num_running == 2 and s.num_waiting == 3
    sim.run()
    assert [p[0] for p in sim.prefills] == [1, 2, 3, 4, 5]  # FIFO: nobody overtakes the head
    assert all(r.status is RS.FINISHED_LENGTH and r.output_token_ids == [100, 101, 102, 103, 104] for r in reqs)
    assert s.num_held == 0 and s.num_running == 0 and s.rows == [None, None] and not s.requests


def test_chunked_prefill_plans_never_leave_one_token_and_decoding_rows_keep_moving():
    s = Scheduler(max_batch=2, prefill_chunk=4)
    sim = Sim(s)
    a, b, c = _req(1, prompt_len=2, max_tokens=20), _req(2, prompt_len=10), _req(3, prompt_len=9)
    for r in (a, b, c):
        s.add(r)
    sim.step()
    for _ in range(3):  # b's chunks, a decoding beside each
        sim.step()
        assert sim.decoded[-1] and sim.decoded[-1][0][0] == a.row
    assert sim.prefills[:4] == [(1, 0, 2), (2, 0, 4), (2, 4, 8), (2, 8, 10)]
    assert b.status is RS.RUNNING and s.prefilling == []
    s.finish(b, RS.FINISHED_ABORTED)
    sim.step()
    sim.step()
    assert sim.prefills[4:] == [(3, 0, 4), (3, 4, 9)]  # 9 = 4 + 5: a single last token is taken with the chunk
    whole = Scheduler(max_batch=1, prefill_chunk=None)
    whole.add(_req(9, prompt_len=50))
    plan = whole.schedule()
    assert [(c.start, c.end, c.last) for c in plan.prefill] == [(0, 50, True)]


def test_a_prefilling_request_holds_a_row_and_does_not_also_wait():
    """The capacity off by one: a request whose prompt is being prefilled counts once (running), not also as waiting."""
    s = Scheduler(max_batch=1, max_waiting=1, prefill_chunk=2)
    s.add(_req(1, prompt_len=12))
    s.schedule()
    assert len(s.prefilling) == 1 and s.num_running == 1 and s.num_waiting == 0 and s.num_held == 1
    assert s.room() == 1  # one more may wait
    s.add(_req(2))
    assert s.room() == 0 and s.room(pending=1) == -1


def test_the_kv_budget_holds_a_request_back_until_rows_free():
    """Admission needs (prompt + max_tokens) × S beside what the rows hold; a prefilling request holds its prompt × S,
    a placed one its columns × S (plus a token in flight)."""
    S = 4
    s = Scheduler(max_batch=4, kv_budget=(4 + 6) * S + 3 * S, slots_per_token=S)
    sim = Sim(s)
    a, b = _req(1, prompt_len=4, max_tokens=6), _req(2, prompt_len=4, max_tokens=6)
    s.add(a)
    s.add(b)
    plan = sim.step()
    assert plan.kv_tokens == 4 * S and a.row is not None  # a prefilling: its prompt
    assert s.kv_tokens_used() == 4 * S  # placed: its 4 columns, nothing in flight
    plan = sim.step()  # a starts a token: 5 columns held in flight; b needs 10 × S more: over the budget
    assert plan.prefill == [] and plan.kv_tokens == 5 * S and b.status is RS.WAITING
    sim.run()
    assert a.finished and b.finished and b.num_preemptions == 0
    assert [p[0] for p in sim.prefills] == [1, 2]


def test_the_youngest_is_preempted_at_once_when_idle_and_replays_its_tokens():
    """Two requests outgrow the budget: the younger (idle) loses its row at once, goes first in the queue, is
    prefilled again when there is room and replays its tokens (the scheduled token ids and the depths they ran),
    then goes on; the oldest is never preempted."""
    S = 2
    s = Scheduler(max_batch=2, kv_budget=12 * S, slots_per_token=S)
    sim = Sim(s)
    a, b, c = (
        _req(1, prompt_len=2, max_tokens=8),
        _req(2, prompt_len=2, max_tokens=6),
        _req(3, prompt_len=2, max_tokens=2),
    )
    for r in (a, b, c):
        s.add(r)
    preempted = []
    for _ in range(60):
        if not s.num_held:
            break
        plan = sim.step()
        preempted += plan.preempted
        assert plan.kv_tokens <= 12 * S
        assert s.kv_tokens_used() <= 12 * S
    assert not s.num_held
    assert preempted and a not in preempted and all(r.num_preemptions == preempted.count(r) for r in (b, c))
    assert s.num_preemptions == len(preempted)
    for r in (a, b, c):
        assert r.output_token_ids == [100 + i for i in range(r.max_tokens)]  # no token made twice, none lost
    victim = preempted[0]
    again = [i for i, p in enumerate(sim.prefills) if p[0] == victim.id]
    assert len(again) >= 2  # prefilled again
    # its replay: the tokens it had made started again, each leaving at the depth its token ran the first time
    replayed = [t for step in sim.decoded for t in step if t[0] is not None and t[2]]
    assert replayed and all(t[2] == 1 + (t[1] - 100 + 1) % 3 for t in replayed)


def test_a_youngest_row_in_flight_is_preempted_when_its_token_exits():
    """The younger row's token is in flight when the rows outgrow the budget: it is marked (PREEMPTING) and the
    older row waits rather than outgrow it; when the token exits it is dropped (not sampled) and the request goes
    first in the queue with its tokens to replay; then the older row goes on."""
    s = Scheduler(max_batch=2, kv_budget=9, slots_per_token=1)
    sim = Sim(s)
    a, b = _req(1, prompt_len=3, max_tokens=5), _req(2, prompt_len=3, max_tokens=2)
    s.add(a)
    s.add(b)
    sim.step()  # a placed (3 columns)
    sim.step()  # a's token (4 held in flight) beside b's admission: 4 + (3 + 2) <= 9; b placed
    assert b.status is RS.RUNNING and s.kv_tokens_used() == 4 + 3
    sim.step(hold=[b.row])  # both start: 5 + 4 = 9; b's token stays in flight
    assert a.num_cached == 5 and b.in_flight and s.kv_tokens_used() == 9
    plan = sim.step(hold=[b.row])  # a would make 10 > 9: b (younger, in flight) is marked; a waits meanwhile
    assert b.status is RS.PREEMPTING and plan.preempted == [] and plan.decode == [] and a.next_token is not None
    made = list(b.output_token_ids)
    sample, preempted = s.update_from_output([b.row])  # b's token exits: dropped, b preempted
    sim.flight.clear()
    assert sample == [] and preempted == [b] and b.status is RS.PREEMPTED and s.waiting[0] is b and b.row is None
    assert b.output_token_ids == made and list(b.replay_tokens) == made[1:] and s.kv_tokens_used() == 5
    plan = sim.step()
    assert [t.row for t in plan.decode] == [a.row]
    sim.run()
    assert a.output_token_ids == [100 + i for i in range(5)] and b.output_token_ids == [100, 101]


def test_aborts_free_capacity_wherever_the_request_is():
    s = Scheduler(max_batch=2, max_waiting=2, prefill_chunk=2)
    sim = Sim(s)
    run, pre, w1, w2 = _req(1, prompt_len=2, max_tokens=9), _req(2, prompt_len=9), _req(3), _req(4)
    for r in (run, pre, w1, w2):
        s.add(r)
    sim.step()
    sim.step()  # run decodes; pre prefills (row 1)
    assert s.room() == 0
    assert s.finish(w2, RS.FINISHED_ABORTED) and not s.finish(w2, RS.FINISHED_ABORTED)  # waiting: out of the queue
    assert s.room() == 1 and w2 not in s.waiting
    row = pre.row
    s.finish(pre, RS.FINISHED_STOPPED)  # prefilling: its row frees at once
    assert s.rows[row] is None and s.prefilling == [] and s.room() == 2
    plan = s.schedule()  # run starts a token (in flight now); w1 takes the freed row
    assert [c.request for c in plan.prefill] == [w1] and [t.row for t in plan.decode] == [run.row]
    s.finish(run, RS.FINISHED_ABORTED)  # in flight: the row is held until its token exits
    assert s.rows[run.row] is run and s.room() == 2
    sample, _ = s.update_from_output([0])
    assert sample == [] and s.rows[0] is None and s.room() == 3
    assert s.get(run.id) is None and s.get(w1.id) is w1
    assert [r.status.finish_reason for r in (run, pre, w2)] == [
        "abort",
        "stop",
        "abort",
    ] and w1.status.finish_reason is None


def test_echo_requests_prefill_without_a_row_and_the_token_schedule_waits_for_the_batch():
    s = Scheduler(max_batch=1)
    sim = Sim(s)
    busy, echo = _req(1, max_tokens=5), _req(2, max_tokens=0)
    s.add(busy)
    s.add(echo)
    sim.step()
    plan = sim.step()  # the one row is busy: the max_tokens = 0 request prefills anyway, without a row
    assert [c.request for c in plan.prefill] == [echo] and echo.row is None and echo.status is RS.FINISHED_LENGTH
    tok = Scheduler(max_batch=2, wait_for_batch=True)
    sim = Sim(tok)
    a, b = _req(1, max_tokens=4), _req(2, max_tokens=4)
    tok.add(a)
    tok.add(b)
    sim.step()  # a placed
    sim.step(hold=[0])  # a starts (and stays in flight); b placed
    assert a.in_flight and b.next_token is not None
    assert sim.step(hold=[0]).decode == []  # a's token in flight: b may not start (the token schedule)
    assert sim.step().decode == []  # (a's token exits at this step's pass)
    assert sorted(t.row for t in sim.step().decode) == [0, 1]  # then the batch starts together


def test_batched_prefill_packs_whole_prompts_in_order_within_the_chunk():
    """Whole prompts join the head's in one batch while rows, the budget and ``requests × longest <= prefill_chunk``
    hold them; an echo request, one without a row (``max_tokens = 0``) or a prompt longer than a chunk runs alone,
    and nobody overtakes the queue's head."""
    s = Scheduler(max_batch=4, prefill_chunk=12, batch_prefill=True)
    sim = Sim(s)
    lens = [3, 4, 3, 5, 2]
    reqs = [_req(i + 1, prompt_len=n, max_tokens=2) for i, n in enumerate(lens)]
    for r in reqs:
        s.add(r)
    plan = sim.step()  # 3 × 4 = 12 tokens: the first three; the fourth would make 4 × 5 = 20
    assert [c.request.id for c in plan.prefill] == [1, 2, 3] and all(c.last and c.start == 0 for c in plan.prefill)
    assert [r.row for r in reqs[:3]] == [0, 1, 2] and all(r.status is RS.RUNNING for r in reqs[:3])
    plan = sim.step()  # one row left: the fourth alone
    assert [c.request.id for c in plan.prefill] == [4]
    sim.run()
    assert sim.batches == [[1, 2, 3]] and all(r.output_token_ids == [100, 101] for r in reqs)

    s = Scheduler(max_batch=4, prefill_chunk=12, batch_prefill=True)
    sim = Sim(s)
    echo, zero = _req(2, prompt_len=2), _req(4, prompt_len=2, max_tokens=0)
    echo.echo = True
    for r in (_req(1, prompt_len=2), echo, _req(3, prompt_len=2), zero, _req(5, prompt_len=2), _req(6, prompt_len=20)):
        s.add(r)
    ids = [[c.request.id for c in sim.step().prefill] for _ in range(6)]
    assert ids == [[1], [2], [3], [4], [5], [6]]  # each next one is echo, max_tokens = 0 or longer than a chunk
    assert [c.end for c in sim.step().prefill] == [20]  # (6 in chunks of 12: 12, then the last 8)
    sim.run()
    for flag, chunk in ((False, 12), (True, None)):  # off, or no chunk: one prompt a step
        s = Scheduler(max_batch=4, prefill_chunk=chunk, batch_prefill=flag)
        for i in range(3):
            s.add(_req(i + 1, prompt_len=2))
        assert len(s.schedule().prefill) == 1


def test_batched_prefill_stops_at_the_budget():
    S = 2
    s = Scheduler(max_batch=4, kv_budget=(4 + 3) * S * 2, slots_per_token=S, prefill_chunk=64, batch_prefill=True)
    for i in range(3):
        s.add(_req(i + 1, prompt_len=4, max_tokens=3))
    plan = s.schedule()  # each needs (4 + 3) × S beside the prompts admitted before it: two fit
    assert [c.request.id for c in plan.prefill] == [1, 2] and s.kv_tokens_used() == 2 * 4 * S
    assert s.waiting[0].id == 3 and s.waiting[0].row is None


def test_a_free_row_is_taken_in_the_order_rows_were_freed():
    """Admission takes the row freed first (the offline depth-batched run's refill order, looplm.decode.depth_schedule),
    not the lowest free one; schedule_decode and schedule_prefill are the two halves of schedule."""
    s = Scheduler(max_batch=3, max_waiting=8, prefill_chunk=64, batch_prefill=True)
    reqs = [_req(i, prompt_len=3, max_tokens=5) for i in range(5)]
    for r in reqs:
        s.add(r)
    assert [(c.request.id, c.request.row) for c in s.schedule_prefill()] == [(0, 0), (1, 1), (2, 2)]
    for r in reqs[:3]:
        s.place(r)
        s.append_token(r, 7, 1)
    assert [t.row for t in s.schedule_decode()] == [0, 1, 2] and s.schedule_prefill() == []  # no free row
    assert s.update_from_output([2, 0, 1]) == ([0, 1, 2], [])
    s.finish(reqs[2], RS.FINISHED_STOPPED)  # row 2 frees first, then row 0
    s.finish(reqs[0], RS.FINISHED_LENGTH)
    assert list(s.free_rows) == [2, 0] and s.num_free_rows == 2
    assert [(c.request.id, c.request.row) for c in s.schedule_prefill()] == [(3, 2), (4, 0)]


def test_finish_all_ends_everything_and_frees_every_row():
    s = Scheduler(max_batch=2, prefill_chunk=2)
    sim = Sim(s)
    reqs = [_req(i, prompt_len=2 if i == 1 else 9, max_tokens=5) for i in range(1, 5)]
    for r in reqs:
        s.add(r)
    sim.step()
    s.schedule()  # r1 in flight, r2 prefilling
    done = s.finish_all(RS.FINISHED_ERROR)
    assert set(done) == set(reqs) and all(r.status is RS.FINISHED_ERROR for r in reqs)
    assert s.rows == [None, None] and not s.waiting and s.num_held == 0 and s.room() == 2 + 64


def test_bad_input_is_named():
    with pytest.raises(ValueError) as e:
        Scheduler(max_batch=0, max_waiting=-1, kv_budget=0, slots_per_token=True, prefill_chunk=1)
    for name in ("max_batch", "max_waiting", "kv_budget", "slots_per_token", "prefill_chunk"):
        assert name in str(e.value)
    s = Scheduler(max_batch=1)
    r = _req(1)
    s.add(r)
    with pytest.raises(ValueError, match="already scheduled"):
        s.add(r)
    with pytest.raises(ValueError, match="empty prompt"):
        s.add(Request(2, [], 1))
    with pytest.raises(ValueError, match="no finished prompt"):
        s.place(r)
    with pytest.raises(ValueError, match="row 0 had no token in flight"):
        s.update_from_output([0])
    with pytest.raises(ValueError, match="finished status"):
        s.finish(r, RS.RUNNING)
    with pytest.raises(ValueError, match="finish reason"):
        RS.of_reason("done")
    assert RS.of_reason("length") is RS.FINISHED_LENGTH and RS.FINISHED_LENGTH.finished and not RS.PREEMPTED.finished
