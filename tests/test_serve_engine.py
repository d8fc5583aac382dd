"""The serving engine (looplm.serve.engine): continuous batching of requests that arrive at any time, each row at
its own depth. Every request's greedy output equals ``model.generate`` of its prompt alone (fp32), at full depth and
under each exit criterion, under the depth and the token schedule; requests that join mid-batch, chunked prefill,
per-request thresholds, seeds, logprobs and echo, aborts, the bounded queue, shutdown, an engine error, and the
refusals (each field named). Every wait is bounded."""

import threading
import time

import pytest
import torch

import looplm
from looplm.serve import (
    Engine,
    EngineClosed,
    EngineConfig,
    FinishEvent,
    PromptEvent,
    QueueFull,
    RequestError,
    SamplingParams,
    TokenEvent,
)

pytestmark = pytest.mark.usefixtures("one_thread")

WAIT_S = 60.0  # the most any test waits for an engine event


def _model(name="tiny-coreloop", **kw):
    torch.manual_seed(0)
    return looplm.build(name, **kw).eval()


def _prompts(n=5, lens=(5, 9, 3, 12, 7), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (int(lens[i % len(lens)]),), generator=g).tolist() for i in range(n)]


class Collect:
    """One request's events (called from the engine thread)."""

    def __init__(self, then=None):
        self.tokens, self.depths, self.logprobs, self.tops, self.stops = [], [], [], [], []
        self.prompt = self.finish = None
        self.done = threading.Event()
        self.then = then  # called after each token event (a test's hook)

    def __call__(self, ev):
        if isinstance(ev, TokenEvent):
            self.tokens.append(ev.token_id)
            self.depths.append(ev.depth)
            self.logprobs.append(ev.logprob)
            self.tops.append(ev.top_logprobs)
            self.stops.append(ev.stop)
            if self.then is not None:
                self.then(self)
        elif isinstance(ev, PromptEvent):
            self.prompt = ev
        elif isinstance(ev, FinishEvent):
            assert self.finish is None, "two finish events"
            self.finish = ev
            self.done.set()

    def wait(self):
        assert self.done.wait(WAIT_S), "the request did not finish in time"
        return self


def _run(engine, prompts, params):
    """Submit every prompt at once; wait for all."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    cs = [Collect() for _ in prompts]
    for p, sp, c in zip(prompts, params, cs):
        engine.submit(p, sp, c)
    return [c.wait() for c in cs]


def _alone(m, prompt, n, exit=None, **kw):
    """``model.generate`` of one prompt alone: its new tokens and (under an exit) each decoded token's depth."""
    ids = torch.tensor([prompt])
    if exit is None:
        return m.generate(ids, n, **kw)[0, len(prompt) :].tolist(), None
    out, st = m.generate(ids, n, exit=exit, return_stats=True, **kw)
    return out[0, len(prompt) :].tolist(), [int(d) for d in torch.cat([s.reshape(-1) for s in st.selected])]


@pytest.fixture
def engine_of():
    """Make started engines; every one is shut down at the end of the test."""
    made = []

    def make(model, **cfg):
        e = Engine(model, EngineConfig(**cfg)).start()
        made.append(e)
        return e

    yield make
    for e in made:
        e.shutdown()


# ------------------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("schedule", ["depth", "token"])
@pytest.mark.parametrize("exit", [None, "kl:0.004", "convergence:0.9"])
def test_greedy_output_equals_generate_alone(engine_of, exit, schedule):
    """Five prompts of different lengths through three rows (two wait and take the rows of the first to finish):
    each request's tokens equal ``model.generate`` of its prompt alone, and so does every token's depth (its first
    token, from the prompt, ran every loop); the thresholds give a mix of depths."""
    m = _model()
    K, N = m.config.n_loops, 10
    prompts = _prompts()
    refs = [_alone(m, p, N, exit) for p in prompts]
    eng = engine_of(m, max_batch=3, exit=exit, exit_schedule=schedule, prefill_chunk=4)
    outs = _run(eng, prompts, SamplingParams(max_tokens=N, temperature=0))
    for (toks, depths), c in zip(refs, outs):
        assert c.tokens == toks
        assert c.finish.reason == "length" and c.finish.completion_tokens == N and c.finish.prompt_tokens > 0
        assert c.depths[0] == K
        if exit is None:
            assert c.depths == [K] * N
        else:
            assert c.depths[1:] == depths
    if exit is not None:  # the thresholds are chosen to exit some tokens early, not all
        every = [d for c in outs for d in c.depths[1:]]
        assert min(every) < K and max(every) == K
    s = eng.stats()
    assert s["generation_tokens_total"] == 5 * N and s["prompt_tokens_total"] == sum(map(len, prompts))
    assert sum(s["exits_by_depth"]) == 5 * (N - 1)  # decoded tokens (the first of each came from its prompt)


@pytest.mark.parametrize("schedule", ["depth", "token"])
def test_prompts_at_adaptive_depth_equal_generate_alone(engine_of, schedule):
    """``prefill='exit'``: a prompt's tokens after the first take the exits (whole, at its request's own ε): every
    request's tokens and depths equal ``model.generate`` alone with ``Exit(prefill='exit')``, its first token's
    depth is its prompt's last position's; a request with ``exit='none'`` runs its prompt at full depth; and the
    outputs differ from a full-depth prompt's (the prompt's skipped loops hold the policy's fill)."""
    m = _model()
    K, N = m.config.n_loops, 10
    prompts = _prompts()
    thr = [0.004, 0.004, 0.02, 0.004, 0.0]  # per request (0: exit='none', full depth)
    refs = [
        _alone(m, p, N, {"criterion": "kl", "threshold": t, "prefill": "exit"}) if t else _alone(m, p, N)
        for p, t in zip(prompts, thr)
    ]
    eng = engine_of(m, max_batch=3, exit="kl:0.004", exit_schedule=schedule, prefill="exit", prefill_chunk=None)
    params = [SamplingParams(max_tokens=N, temperature=0, exit=f"kl:{t}" if t else "none") for t in thr]
    outs = _run(eng, prompts, params)
    for (toks, depths), c, t in zip(refs, outs, thr):
        assert c.tokens == toks
        if t:
            assert c.depths[1:] == depths
        else:
            assert c.depths == [K] * N
    assert min(c.depths[0] for c in outs[:4]) < K  # a prompt's last position left early
    assert "prefill exit" in eng.describe()
    full = [_alone(m, p, N, "kl:0.004")[0] for p in prompts[:2]]
    assert any(f != c.tokens for f, c in zip(full, outs))


def test_exit_gate_and_kv_policies_equal_generate_alone(engine_of):
    """The gate criterion (its q is the rule's output selection too) and the propagate / shared KV policies."""
    m = _model("tiny-llama", overrides={"rule": {"name": "exit_gate"}})
    with torch.no_grad():
        m.rule.gate.weight.normal_(0, 1.0)
        m.rule.gate.bias.zero_()
    prompts, N = _prompts(4), 8
    for exit, kv in (("gate:0.5", "copy"), ("kl:0.004", "propagate"), ("kl:0.004", "shared")):
        spec = {"criterion": exit.split(":")[0], "threshold": float(exit.split(":")[1]), "kv": kv}
        refs = [_alone(m, p, N, spec) for p in prompts]
        eng = engine_of(m, max_batch=2, exit=exit, kv_policy=kv)
        outs = _run(eng, prompts, SamplingParams(max_tokens=N, temperature=0))
        for (toks, depths), c in zip(refs, outs):
            assert c.tokens == toks, (exit, kv)
            assert c.depths[1:] == depths, (exit, kv)
        eng.shutdown()


@pytest.mark.parametrize("name,exit", [("tiny-hybrid", None), ("tiny-stateloop", "kl:0.01")])
def test_state_carrying_cores_equal_generate_alone(engine_of, name, exit):
    """Mamba-2 layers in the core, and StateLoop's per-loop state mixers: a row's state is copied from its
    prompt's own prefill into the batch."""
    m = _model(name)
    prompts, N = _prompts(4), 8
    refs = [_alone(m, p, N, exit)[0] for p in prompts]
    outs = _run(
        engine_of(m, max_batch=2, prefill_chunk=4, exit=exit), prompts, SamplingParams(max_tokens=N, temperature=0)
    )
    assert [c.tokens for c in outs] == refs


def test_per_request_thresholds_share_a_batch(engine_of):
    """Under kl every request may carry its own ε, or ask for full depth (``'none'``): each equals
    ``generate`` alone with its own exit, in one batch."""
    m = _model()
    K, N = m.config.n_loops, 10
    prompts = _prompts(3)
    exits = ["kl:0.002", "none", None]  # None: the engine's kl:0.006
    refs = [_alone(m, prompts[0], N, "kl:0.002"), _alone(m, prompts[1], N), _alone(m, prompts[2], N, "kl:0.006")]
    eng = engine_of(m, max_batch=3, exit="kl:0.006")
    outs = _run(eng, prompts, [SamplingParams(max_tokens=N, temperature=0, exit=e) for e in exits])
    assert [c.tokens for c in outs] == [r[0] for r in refs]
    assert outs[0].depths[1:] == refs[0][1] and outs[2].depths[1:] == refs[2][1]
    assert outs[1].depths == [K] * N
    assert outs[0].finish.loops > outs[2].finish.loops  # a tighter ε runs more loops


def test_a_request_joining_mid_batch_leaves_the_others_tokens_alone(engine_of):
    """Requests submitted while others decode (from the engine's own callback, so at a known token) join at the
    next pass; every request's tokens equal its alone-decoded reference."""
    m = _model()
    N = 12
    prompts = _prompts(4)
    refs = [_alone(m, p, N, "kl:0.004")[0] for p in prompts]
    eng = engine_of(m, max_batch=4, exit="kl:0.004", prefill_chunk=2)
    sp = SamplingParams(max_tokens=N, temperature=0)
    late = [Collect(), Collect(), Collect()]

    def join(c):
        if len(c.tokens) in (3, 5, 6):  # a new request at the first's 3rd, 5th and 6th token
            i = {3: 0, 5: 1, 6: 2}[len(c.tokens)]
            eng.submit(prompts[i + 1], sp, late[i])

    first = Collect(then=join)
    eng.submit(prompts[0], sp, first)
    assert first.wait().tokens == refs[0]
    assert [c.wait().tokens for c in late] == refs[1:]


def test_chunked_prefill_equals_the_whole_prompt(engine_of):
    """A 23-token prompt prefilled 2, 5 or all tokens per tick: the same tokens, and its echoed prompt logprobs
    and generated tokens' logprobs equal the model's full forward to 1e-5."""
    m = _model()
    prompt = _prompts(1, lens=(23,))[0]
    N = 6
    ref = _alone(m, prompt, N)[0]
    seq = torch.tensor([prompt + ref])
    with torch.no_grad():
        lp = torch.log_softmax(m(seq).logits.float(), -1)[0]  # [T, V]
    want_prompt = [lp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    want_gen = [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(ref)]
    for chunk in (2, 5, None):
        eng = engine_of(m, max_batch=2, prefill_chunk=chunk)
        c = _run(eng, [prompt], SamplingParams(max_tokens=N, temperature=0, logprobs=3, prompt_logprobs=True))[0]
        assert c.tokens == ref
        assert c.prompt.token_logprobs[0] is None and len(c.prompt.token_logprobs) == len(prompt)
        assert c.prompt.token_logprobs[1:] == pytest.approx(want_prompt, abs=1e-5)
        assert c.logprobs == pytest.approx(want_gen, abs=1e-5)
        assert all(
            len(t) == 3 and t[0][0] == tok for t, tok in zip(c.tops, c.tokens)
        )  # greedy: the top token is chosen
        eng.shutdown()


@pytest.mark.parametrize("schedule", ["depth", "token"])
@pytest.mark.parametrize("exit", [None, "kl:0.004"])
def test_batched_prefill_equals_generate_alone(engine_of, exit, schedule):
    """Prompts that wait together are prefilled as one right-padded forward (while the engine was held, four
    arrive): each request's tokens and depths still equal ``model.generate`` of its prompt alone; models whose
    prompt caches hold a state that runs over positions (Mamba-2) prefill one prompt at a time."""
    m = _model()
    N = 8
    prompts = _prompts(5)
    refs = [_alone(m, p, N, exit) for p in prompts]
    eng = engine_of(m, max_batch=5, exit=exit, exit_schedule=schedule, prefill_chunk=64)
    assert eng.runner.can_batch_prefill
    batches = []
    real = eng.runner.prefill_batch
    eng.runner.prefill_batch = lambda rids, ps: batches.append(len(rids)) or real(rids, ps)
    hold, held = threading.Event(), threading.Event()

    def block(c):
        if len(c.tokens) == 1:
            held.set()
            hold.wait(WAIT_S)

    sp = SamplingParams(max_tokens=N, temperature=0)
    cs = [Collect(then=block)] + [Collect() for _ in prompts[1:]]
    eng.submit(prompts[0], sp, cs[0])
    assert held.wait(WAIT_S)
    for p, c in zip(prompts[1:], cs[1:]):
        eng.submit(p, sp, c)
    hold.set()
    for (toks, depths), c in zip(refs, cs):
        assert c.wait().tokens == toks
        if exit is not None:
            assert c.depths[1:] == depths
    assert batches == [4]  # the four prompts that waited: one forward (12 × 4 = 48 padded tokens <= 64)
    assert eng.stats()["prompt_tokens_total"] == sum(map(len, prompts))
    assert not engine_of(_model("tiny-hybrid"), max_batch=2).runner.can_batch_prefill


def test_a_decode_pass_hands_the_head_one_position_per_row(engine_of):
    """The rows that leave a pass reach the final norm and the head as ``[e, 1, d]``, the shape of a decode step, so
    the head takes the GEMV decode step where ``generate``'s does (looplm.kernels.gemv: only 3-D calls of one
    position per row do); a 2-D call would fall back to torch's matmul on every token."""
    m = _model("tiny-llama")
    e = engine_of(m, max_batch=4)
    seen = []
    hook = m.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(tuple(inp[0].shape)))
    try:
        _run(e, _prompts(3), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    finally:
        hook.remove()
    decode = [s for s in seen if s[0] <= 4 and s[1:] == (1, m.config.d_model)]
    assert seen and all(len(s) == 3 for s in seen), seen
    assert len(decode) >= 3, seen  # (the tokens after the first come from decode passes)


def test_batched_prefill_runs_the_head_at_each_prompts_last_position_only():
    """ModelRunner.prefill_batch asks the decoder for one position per row (``logits_at``): the final norm and the head
    see ``[n, 1, d]`` — not the last ``longest − shortest + 1`` positions of every prompt — and each row's logits are
    its prompt's last position's (to 1e-5 against the prompt alone). The decoder's ``logits_at`` reads the same logits
    as ``logits_to_keep`` over the whole prompt, at full depth and with ``prefill='exit'``; bad positions are refused,
    named, before any work."""
    from looplm.decode.exits import Exit
    from looplm.decode.token_schedule import AdaptiveDecoder
    from looplm.serve.runner import ModelRunner

    m = _model()
    runner = ModelRunner(m, 4, 64, Exit(criterion="convergence", threshold=0.0, schedule="depth").resolved(m, 4))
    prompts = _prompts(3, lens=(5, 12, 3))
    seen = []
    hook = m.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(tuple(inp[0].shape)))
    try:
        logits, depth = runner.prefill_batch([1, 2, 3], prompts)  # [3, V]
    finally:
        hook.remove()
    assert seen == [(3, 1, m.config.d_model)] and logits.shape == (3, m.config.vocab_size) and depth == runner.K
    for i, p in enumerate(prompts):
        alone, _ = runner.prefill(10 + i, p, 0, len(p), 1)  # [1, V]: the prompt alone, its last position
        torch.testing.assert_close(logits[i], alone[0], atol=1e-5, rtol=1e-5)

    ids = torch.randint(0, 250, (3, 7), generator=torch.Generator().manual_seed(2))
    at = torch.tensor([6, 2, 4])  # [3]
    for prefill in ("full", "exit"):
        spec = Exit(criterion="kl", threshold=0.05, prefill=prefill)
        every = AdaptiveDecoder(m, 3, 7, spec)(ids, logits_to_keep=7)  # [3, 7, V]
        dec = AdaptiveDecoder(m, 3, 7, spec)
        picked = dec(ids, logits_at=at)  # [3, 1, V]
        assert picked.shape == (3, 1, m.config.vocab_size)
        torch.testing.assert_close(picked[:, 0], every[torch.arange(3), at], atol=1e-5, rtol=1e-5)
    for bad, match in [
        (torch.tensor([1, 2]), r"logits_at must be a \[3\] integer tensor .* shape \(2,\)"),
        (torch.tensor([1.0, 2.0, 3.0]), "logits_at must be a .*torch.float32"),
        ([1, 2, 3], r"logits_at must be a .*\[1, 2, 3\]"),
        (torch.tensor([0, 7, 2]), r"logits_at holds positions 0 \.\. 7; input_ids has 7 positions"),
        (torch.tensor([-1, 0, 2]), r"logits_at holds positions -1 \.\. 2"),
    ]:
        fresh = AdaptiveDecoder(m, 3, 7, Exit(criterion="kl", threshold=0.05))
        with pytest.raises(ValueError, match=match):
            fresh(ids, logits_at=bad)
        assert fresh.cache.seqlen == 0  # refused before the prompt ran
    with pytest.raises(ValueError, match="runs at full depth"):
        runner.decoder.prefill(runner.decoder.new_part(7, rows=3), ids, 1, exit=spec, at=at)


def test_echo_without_generation_needs_no_row(engine_of):
    """``max_tokens = 0`` with prompt logprobs (lm-eval's loglikelihood request): the prompt's logprobs, no token,
    finish 'length' — even while every row is busy."""
    m = _model()
    prompts = _prompts(2)
    eng = engine_of(m, max_batch=1)
    busy = Collect()
    eng.submit(prompts[0], SamplingParams(max_tokens=40, temperature=0), busy)
    c = _run(eng, [prompts[1]], SamplingParams(max_tokens=0, logprobs=0, prompt_logprobs=True))[0]
    assert c.tokens == [] and c.finish.reason == "length" and c.finish.completion_tokens == 0
    assert len(c.prompt.token_logprobs) == len(prompts[1]) and all(x <= 0 for x in c.prompt.token_logprobs[1:])
    busy.wait()


# ------------------------------------------------------------------------------------------------ sampling
def test_a_seed_fixes_a_sample_whatever_the_batch(engine_of):
    """A sampled request with a seed draws from its own generator: its tokens equal ``model.generate`` alone with a
    generator of that seed, with or without other requests beside it; another seed gives another sample."""
    m = _model()
    N = 16
    prompts = _prompts(4)
    sp = SamplingParams(max_tokens=N, temperature=1.0, top_k=50, top_p=0.95, seed=7)
    ref = m.generate(
        torch.tensor([prompts[0]]),
        N,
        do_sample=True,
        temperature=1.0,
        top_k=50,
        top_p=0.95,
        generator=torch.Generator().manual_seed(7),
    )[0, len(prompts[0]) :].tolist()
    eng = engine_of(m, max_batch=4, exit="kl:0.004")
    m2 = _model()  # (the reference under the exit, on a model the engine does not hold)
    ref_exit = m2.generate(
        torch.tensor([prompts[0]]),
        N,
        do_sample=True,
        temperature=1.0,
        top_k=50,
        top_p=0.95,
        exit="kl:0.004",
        generator=torch.Generator().manual_seed(7),
    )[0, len(prompts[0]) :].tolist()
    alone = _run(eng, prompts[:1], sp)[0].tokens
    others = [SamplingParams(max_tokens=N, temperature=0.8, seed=s) for s in (1, 2, 3)]
    together = _run(eng, prompts, [sp] + others)
    assert alone == together[0].tokens == ref_exit
    assert (
        together[1].tokens != _run(eng, prompts[1:2], SamplingParams(max_tokens=N, temperature=0.8, seed=99))[0].tokens
    )
    full = engine_of(_model(), max_batch=2)
    assert _run(full, prompts[:1], sp)[0].tokens == ref


# ------------------------------------------------------------------------------------------------ the KV budget
@pytest.mark.parametrize(
    "exit,schedule,prefill",
    [
        (None, "depth", "full"),
        ("kl:0.004", "depth", "full"),
        ("kl:0.004", "token", "full"),
        ("kl:0.004", "depth", "exit"),
        ("kl:0.004", "depth", "batched"),
    ],
)
def test_preemption_under_a_tiny_budget_keeps_every_output_exact(engine_of, exit, schedule, prefill):
    """Six requests through four rows under a budget that admits two or three of them: the running ones outgrow
    it, the youngest are preempted, prefilled again and replay the tokens they had made at the depths they ran;
    every request's greedy tokens and depths still equal ``model.generate`` alone, a seeded sample equals its
    sample alone, and the cache tokens held never pass the budget (checked at every token, in the engine's
    thread). ``batched``: prompts prefilled together where they wait together (chunks of 64 tokens)."""
    m = _model()
    K, N = m.config.n_loops, 12
    prompts = _prompts(6)
    ref_exit = (
        exit if prefill != "exit" else {"criterion": "kl", "threshold": 0.004, "prefill": "exit"}
    )  # (prompts at adaptive depth)
    refs = [_alone(m, p, N, ref_exit) for p in prompts]
    sp = SamplingParams(max_tokens=N, temperature=1.0, top_k=50, seed=5)
    ref_s = (
        _model()
        .generate(
            torch.tensor([prompts[1]]),
            N,
            do_sample=True,
            temperature=1.0,
            top_k=50,
            exit=ref_exit,
            generator=torch.Generator().manual_seed(5),
        )[0, len(prompts[1]) :]
        .tolist()
    )
    budget = (max(map(len, prompts)) + N + 10) * K  # cache tokens (kv='copy' keeps K loop slots per token)
    eng = engine_of(
        m,
        max_batch=4,
        exit=exit,
        exit_schedule=schedule,
        prefill_chunk={"full": 4, "batched": 64}.get(prefill),
        prefill="full" if prefill == "batched" else prefill,
        kv_budget=budget,
    )
    assert eng.stats()["kv_budget_tokens"] == budget and eng.stats()["kv_slots"] == K
    held, batches = [], []
    real = eng.runner.prefill_batch
    eng.runner.prefill_batch = lambda rids, ps: batches.append(len(rids)) or real(rids, ps)
    cs = [Collect(then=lambda c: held.append(eng.scheduler.kv_tokens_used())) for _ in prompts]
    eng.submit_group(
        [
            (p, sp if i == 1 else SamplingParams(max_tokens=N, temperature=0), c)
            for i, (p, c) in enumerate(zip(prompts, cs))
        ]
    )
    for c in cs:
        c.wait()
    assert bool(batches) == (prefill == "batched")  # (the group arrives at once: the first three fit the budget)
    for i, ((toks, depths), c) in enumerate(zip(refs, cs)):
        assert c.finish.reason == "length" and c.finish.completion_tokens == N
        if i == 1:
            assert c.tokens == ref_s
            continue
        assert c.tokens == toks, i
        if exit is not None:
            assert c.depths[1:] == depths, i
    s = eng.stats()
    assert s["preempted"] > 0, "the budget was meant to preempt"
    assert max(held) <= budget
    assert s["generation_tokens_total"] == 6 * N  # replayed tokens are not counted again
    assert s["prompt_tokens_total"] == sum(map(len, prompts))
    deadline = time.monotonic() + WAIT_S  # (the gauges follow at the end of the engine's tick)
    while eng.stats()["kv_tokens_used"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.stats()["kv_tokens_used"] == 0 and eng.stats()["running"] == 0


def test_the_budget_refuses_what_it_cannot_hold_and_reads_memory_sizes(engine_of):
    """A request whose prompt + max_tokens need more cache tokens than the budget is refused, naming the field;
    a budget in memory is what is left after the rows' Mamba-2 states, in cache tokens (at most the block);
    bad budgets are named before any work."""
    m = _model()
    K = m.config.n_loops
    eng = engine_of(m, max_batch=2, kv_budget=40 * K)
    errs = eng.check([1] * 10, SamplingParams(max_tokens=31))
    assert [e.field for e in errs] == ["max_tokens"] and "at most 30 tokens" in errs[0].message
    assert eng.check([1] * 10, SamplingParams(max_tokens=30)) == []
    assert [e.field for e in eng.check([1] * 41, SamplingParams(max_tokens=0))] == ["prompt"]
    full = engine_of(m, max_batch=2)
    per = full.stats()["kv_bytes_capacity"] / full.stats()["kv_tokens_capacity"]  # bytes per cache token
    assert full.stats()["kv_budget_tokens"] == full.stats()["kv_tokens_capacity"] == 2 * m.config.max_seq_len * K
    small = engine_of(m, max_batch=2, kv_budget="64KiB")
    assert small.stats()["kv_budget_tokens"] == int(65536 // per)
    big = engine_of(m, max_batch=2, kv_budget="64GiB")  # more than the block: the block
    assert big.stats()["kv_budget_tokens"] == big.stats()["kv_tokens_capacity"]
    hyb = _model("tiny-hybrid")  # Mamba-2 layers: their states come off a memory budget first
    h = engine_of(hyb, max_batch=2)
    ssm = h.runner.ssm_bytes
    assert ssm > 0
    hb = engine_of(hyb, max_batch=2, kv_budget=f"{ssm + 8192}B")
    assert hb.stats()["kv_budget_tokens"] == int(
        8192 // (h.stats()["kv_bytes_capacity"] / h.stats()["kv_tokens_capacity"])
    )
    with pytest.raises(ValueError, match="Mamba-2 states"):
        Engine(hyb, EngineConfig(max_batch=2, kv_budget=f"{ssm}B")).start()
    with pytest.raises(ValueError, match="fewer than one request"):
        Engine(m, EngineConfig(kv_budget=1)).start()
    with pytest.raises(ValueError) as e:
        EngineConfig(kv_budget="2 parsecs", max_batch=0)
    assert "kv_budget" in str(e.value) and "parsecs" in str(e.value) and "max_batch" in str(e.value)
    for bad in (0, -5, True, 1.5, "0GiB", "lots"):
        with pytest.raises(ValueError, match="kv_budget"):
            EngineConfig(kv_budget=bad)


def test_stop_tokens_and_eos_end_a_request():
    m = _model()
    prompt = _prompts(1)[0]
    ref = _alone(m, prompt, 10)[0]
    i = next(i for i in range(1, 10) if ref[i] not in ref[:i])  # a token that first appears at i > 0
    eng = Engine(m, EngineConfig(max_batch=2), eos_token_id=ref[i]).start()
    try:
        c = _run(eng, [prompt], SamplingParams(max_tokens=10, temperature=0))[0]
        assert c.tokens == ref[: i + 1] and c.stops == [False] * i + [True] and c.finish.reason == "stop"
        c = _run(eng, [prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
        assert c.tokens == ref and not any(c.stops) and c.finish.reason == "length"
        c = _run(
            eng, [prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=(ref[0],))
        )[0]
        assert c.tokens == ref[:1] and c.stops == [True] and c.finish.reason == "stop"
    finally:
        eng.shutdown()


# ------------------------------------------------------------------------------------------------ rows, queue, end
def test_an_abort_frees_its_row_at_once(engine_of):
    """One row: a long request aborted after 3 tokens finishes 'abort', and the waiting request takes the row and
    decodes exactly."""
    m = _model()
    prompts = _prompts(2)
    ref = _alone(m, prompts[1], 8, "kl:0.004")[0]
    eng = engine_of(m, max_batch=1, exit="kl:0.004")
    handle = {}

    def stop_at_3(c):
        if len(c.tokens) == 3:
            handle["h"].abort()

    long = Collect(then=stop_at_3)
    handle["h"] = eng.submit(prompts[0], SamplingParams(max_tokens=50, temperature=0), long)
    nxt = Collect()
    eng.submit(prompts[1], SamplingParams(max_tokens=8, temperature=0), nxt)
    assert long.wait().finish.reason == "abort" and 3 <= len(long.tokens) <= 4  # (a token in flight may still land)
    assert nxt.wait().tokens == ref
    deadline = time.monotonic() + WAIT_S
    while eng.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.stats()["running"] == 0 and eng.stats()["kv_tokens_used"] == 0


def test_the_bounded_queue_refuses_with_queue_full(engine_of):
    """One row, one waiting place: while the engine is held inside a callback, a second request waits and a third
    is refused with QueueFull; after the release both finish."""
    m = _model()
    eng = engine_of(m, max_batch=1, max_waiting=1)
    hold, held = threading.Event(), threading.Event()

    def block(c):
        if len(c.tokens) == 1:
            held.set()
            hold.wait(WAIT_S)

    first = Collect(then=block)
    sp = SamplingParams(max_tokens=4, temperature=0)
    eng.submit([1, 2, 3], sp, first)
    assert held.wait(WAIT_S)
    second = Collect()
    eng.submit([4, 5], sp, second)
    with pytest.raises(QueueFull, match="max_waiting=1"):
        eng.submit([6, 7], sp, Collect())
    hold.set()
    assert first.wait().finish.reason == "length" and second.wait().finish.reason == "length"


def test_a_group_is_admitted_all_at_once_or_not_at_all(engine_of):
    """``submit_group`` (a request's ``n`` samples): a group larger than the server ever holds is refused as a bad
    field ``n``, one that does not fit now with QueueFull, one with a bad field with every bad field named once —
    each before anything is queued, so an ordinary request right after it runs; a group that fits runs whole."""
    m = _model()
    eng = engine_of(m, max_batch=2, max_waiting=2)
    sp = SamplingParams(max_tokens=3, temperature=0)
    hold, held = threading.Event(), threading.Event()

    def block(c):
        if len(c.tokens) == 1:
            held.set()
            hold.wait(WAIT_S)

    never = Collect()
    with pytest.raises(RequestError) as e:  # 5 > max_batch 2 + max_waiting 2: never
        eng.submit_group([([1, 2, 3], sp, never)] * 5)
    assert [f.field for f in e.value.errors] == ["n"] and "at most 4" in str(e.value)
    with pytest.raises(RequestError) as e:  # the third sample's field is bad: none is queued
        eng.submit_group([([1, 2], sp, never), ([3, 4], sp, never), ([5], SamplingParams(max_tokens=-1), never)])
    assert [f.field for f in e.value.errors] == ["max_tokens"]
    first = Collect(then=block)
    eng.submit([1, 2, 3], sp, first)
    assert held.wait(WAIT_S)  # the engine is held: 1 request in, room for 3
    with pytest.raises(QueueFull, match="4 more do not fit"):
        eng.submit_group([([4, 5], sp, never)] * 4)
    group = [Collect() for _ in range(3)]
    handles = eng.submit_group([([4, 5], sp, c) for c in group])  # 3 fit: all of them
    assert len({h.id for h in handles}) == 3
    with pytest.raises(QueueFull):  # now full: an ordinary request waits its turn
        eng.submit([6], sp, never)
    hold.set()
    ref = _alone(m, [4, 5], 3)[0]
    assert first.wait().finish.reason == "length" and [c.wait().tokens for c in group] == [ref] * 3
    assert never.finish is None and not never.tokens  # nothing refused ever ran
    assert eng.stats()["requests_finished"] == 4
    c = _run(eng, [[6, 7]], sp)[0]  # capacity is back
    assert c.finish.reason == "length"


def test_a_prefilling_request_counts_once_against_the_queue(engine_of):
    """Capacity: a request whose prompt is being prefilled holds a row and does not also count as waiting. Two rows,
    one waiting place: while the first request decodes and the second is still prefilling its long prompt (two
    tokens a step), a third request waits for a row; a fourth is refused."""
    m = _model()
    eng = engine_of(m, max_batch=2, max_waiting=1, prefill_chunk=2)
    sp = SamplingParams(max_tokens=3, temperature=0)
    hold, held = threading.Event(), threading.Event()

    def block(c):
        if len(c.tokens) == 2:
            held.set()
            hold.wait(WAIT_S)

    first, long_ = Collect(then=block), Collect()
    long_prompt = _prompts(1, lens=(60,))[0]
    eng.submit([1, 2, 3], sp, first)
    eng.submit(long_prompt, sp, long_)
    assert held.wait(WAIT_S)
    assert [r.prompt for r in eng.scheduler.prefilling] == [long_prompt]
    assert eng.stats()["running"] == 2 and eng.stats()["waiting"] == 0
    third = Collect()
    eng.submit([4, 5], sp, third)  # (refused before: the prefilling request counted as waiting too)
    with pytest.raises(QueueFull):
        eng.submit([6], sp, Collect())
    hold.set()
    assert third.wait().tokens == _alone(m, [4, 5], 3)[0]
    assert long_.wait().tokens == _alone(m, long_prompt, 3)[0] and first.wait().finish.reason == "length"


def test_shutdown_finishes_in_grace_and_ends_the_rest(engine_of):
    """A short request finishes within the grace period; a long one is ended with an abort that says why; the
    engine then takes no request."""
    m = _model()
    prompts = _prompts(2)
    eng = engine_of(m, max_batch=2)
    short, long = Collect(), Collect()
    eng.submit(prompts[0], SamplingParams(max_tokens=3, temperature=0), short)
    eng.submit(prompts[1], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True), long)
    t0 = time.monotonic()
    eng.shutdown(grace_s=0.5)
    assert time.monotonic() - t0 < WAIT_S
    assert short.wait().finish.reason == "length" and len(short.tokens) == 3
    assert long.wait().finish.reason == "abort" and "shutting down" in long.finish.error
    with pytest.raises(EngineClosed):
        eng.submit(prompts[0], SamplingParams(), Collect())


def test_an_engine_error_fails_the_running_requests_and_the_next_one_runs(engine_of, monkeypatch):
    m = _model()
    prompts = _prompts(2)
    eng = engine_of(m, max_batch=2)
    boom = {"n": 0}
    real = eng.runner.step

    def failing(*a, **kw):
        boom["n"] += 1
        if boom["n"] == 3:
            raise RuntimeError("injected")
        return real(*a, **kw)

    eng.runner.step = failing
    c = _run(eng, prompts[:1], SamplingParams(max_tokens=8, temperature=0))[0]
    assert c.finish.reason == "error" and "injected" in c.finish.error
    ref = _alone(m, prompts[1], 5)[0]
    assert _run(eng, prompts[1:], SamplingParams(max_tokens=5, temperature=0))[0].tokens == ref  # (a fresh decoder)


# ------------------------------------------------------------------------------------------------ refusals
def test_check_names_every_bad_field_before_any_work(engine_of):
    m = _model()
    eng = engine_of(m, max_batch=1, exit="kl:0.01")
    sp = SamplingParams(
        max_tokens=-1,
        temperature=-0.5,
        top_p=1.5,
        top_k=-3,
        seed=-1,
        logprobs=21,
        stop_token_ids=(10**6,),
        exit="gate:0.5",
        loops=7,
        kv_policy="shared",
        speculative=2,
    )
    names = {e.field for e in eng.check([1, 2], sp)}
    assert names == {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "logprobs",
        "stop_token_ids",
        "looplm.exit",
        "looplm.loops",
        "looplm.kv_policy",
        "looplm.speculative",
    }
    with pytest.raises(RequestError) as e:
        eng.submit([1, 2], sp, Collect())
    assert len(e.value.errors) == 11 and "max_tokens" in str(e.value)
    ctx = eng.max_model_len
    assert [e.field for e in eng.check(list(range(ctx + 1)), SamplingParams(max_tokens=1))] == ["prompt"]
    assert [e.field for e in eng.check([1] * (ctx - 2), SamplingParams(max_tokens=5))] == ["max_tokens"]
    assert [e.field for e in eng.check([], SamplingParams())] == ["prompt"]
    assert [e.field for e in eng.check([1], SamplingParams(exit="kl:abc"))] == ["looplm.exit"]
    assert eng.check([1], SamplingParams(exit="kl:0.5", loops=m.config.n_loops, kv_policy="copy")) == []
    assert eng.stats()["prompt_tokens_total"] == 0  # nothing ran
    full = engine_of(_model(), max_batch=1)
    assert "full depth" in full.check([1], SamplingParams(exit="kl:0.1"))[0].message
    assert full.check([1], SamplingParams(exit="none")) == []


def test_engine_config_and_unservable_models_are_refused_before_any_work():
    with pytest.raises(ValueError) as e:
        EngineConfig(max_batch=0, exit_schedule="static", prefill_chunk=1, max_waiting=-1)
    for name in ("max_batch", "exit_schedule", "prefill_chunk", "max_waiting"):
        assert name in str(e.value)
    m = _model()
    with pytest.raises(ValueError, match="max_model_len=100000"):
        Engine(m, EngineConfig(max_model_len=100000))
    with pytest.raises(ValueError, match="replay"):
        Engine(m, EngineConfig(exit="replay:2"))
    with pytest.raises(ValueError, match="cannot run this model.*learned exit gate"):  # a gate the model lacks
        Engine(m, EngineConfig(exit="gate:0.5"))
    with pytest.raises(EngineClosed):  # not started
        Engine(m).submit([1], SamplingParams(), Collect())
    with pytest.raises(ValueError, match="prefill='exit' needs an exit criterion"):
        EngineConfig(prefill="exit", prefill_chunk=None)
    with pytest.raises(ValueError, match=r"set prefill_chunk=None \(got 256\)"):
        EngineConfig(exit="kl:0.01", prefill="exit")
    with pytest.raises(ValueError, match="prefill must be 'full'.*got 'half'"):
        EngineConfig(prefill="half")
    with pytest.raises(ValueError, match="cannot run this model.*kv policy 'shared'"):
        Engine(m, EngineConfig(exit="kl:0.01", kv_policy="shared", prefill="exit", prefill_chunk=None))


def test_a_prepared_request_is_checked_once(engine_of):
    """``Engine.prepare`` is the one validation pass: ``submit_group`` queues its requests without checking them
    again (the server prepares each prompt once, in its worker thread, and submits on the event loop); a request
    another engine prepared is refused; ``with_seed`` (a prompt's other samples) checks the seed only."""
    m = _model()
    eng, other = engine_of(m, max_batch=2), engine_of(m, max_batch=2)
    sp = SamplingParams(max_tokens=3, temperature=0)
    calls = []
    check = eng.check
    eng.check = lambda *a: calls.append(a) or check(*a)
    pr, errs = eng.prepare([1, 2, 3], sp)
    assert errs == [] and pr.prompt_ids == (1, 2, 3) and len(calls) == 1
    bad, errs = eng.prepare([1, 2, 10**9], SamplingParams(max_tokens=-1))
    assert bad is None and {f.field for f in errs} == {"prompt", "max_tokens"}
    assert "token id 1000000000 is not in the model's vocabulary" in str(RequestError(errs))
    calls.clear()
    a, b = Collect(), Collect()
    eng.submit_group([(pr, a), (pr.with_seed(7), b)])
    assert calls == []  # not checked again
    assert a.wait().tokens == b.wait().tokens == _alone(m, [1, 2, 3], 3)[0]  # greedy: the seed changes nothing
    with pytest.raises(RequestError, match=r"seed: must be an int in \[0, 2\^63\), got -1"):
        pr.with_seed(-1)
    with pytest.raises(TypeError, match="PreparedRequest made by this engine's prepare"):
        other.submit_group([(pr, Collect())])
    with pytest.raises(TypeError, match="got tuple"):
        eng.submit_group([(([1], sp), Collect())])
