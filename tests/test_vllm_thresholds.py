"""Per-request exit thresholds for the vLLM plugin, their pure parts (looplm.vllm.thresholds): no vLLM needed.

The request field and its refusals, the row bookkeeping against a model of vLLM's persistent batch (requests
removed, added into the lowest freed rows, condensed, swapped: the ``BatchUpdate`` vLLM hands a logits
processor), rows -> tokens, and the load-time checks. The processor and model inside vLLM are tested against
looplm by tests_vllm/test_exit_thresholds.py (vLLM's venv)."""

from __future__ import annotations

import math
import random
import sys

import pytest
import torch

from looplm.vllm.thresholds import (
    FIELD,
    PROCESSOR,
    RowThresholds,
    install,
    installed,
    processor_listed,
    request_threshold,
    server_refusal,
    token_thresholds,
)


def test_importing_the_thresholds_imports_no_vllm():
    assert "vllm" not in sys.modules


@pytest.mark.parametrize(
    "extra, want",
    [
        (None, None),
        ({}, None),
        ({"other": 1}, None),  # another extension's field: not ours
        ({FIELD: 0.01}, 0.01),
        ({FIELD: 2}, 2.0),
        ({FIELD: 0}, 0.0),
        ({FIELD: 0.0}, 0.0),
        ({FIELD: "none"}, 0.0),
        ({FIELD: " None "}, 0.0),
        ({FIELD: "full"}, 0.0),
    ],
)
def test_request_threshold(extra, want):
    assert request_threshold(extra) == want


@pytest.mark.parametrize(
    "value, says",
    [
        (-0.1, "finite number >= 0"),
        (-1, "finite number >= 0"),
        (math.nan, "finite number >= 0"),
        (math.inf, "finite number >= 0"),
        (True, "(bool) is not a threshold"),
        ("fast", "'fast' is not a threshold"),
        ("0.01", "'0.01' is not a threshold"),  # a string, not a number: refused, not guessed
        ("kl:0.01", "is not a threshold"),
        ([0.1], "(list) is not a threshold"),
        ({"threshold": 0.1}, "(dict) is not a threshold"),
        (None, "(NoneType) is not a threshold"),
    ],
)
def test_request_threshold_refuses(value, says):
    with pytest.raises(ValueError) as e:
        request_threshold({FIELD: value})
    msg = str(e.value)
    assert says in msg and FIELD in msg and "'none'" in msg, msg  # names the value, says what to give


def test_request_threshold_refuses_unknown_looplm_fields():
    with pytest.raises(ValueError, match=r"unknown looplm request field\(s\) \['looplm_exits'\]"):
        request_threshold({"looplm_exits": 0.1})
    with pytest.raises(ValueError, match="looplm_loops"):
        request_threshold({FIELD: 0.1, "looplm_loops": 2})


def test_row_thresholds_update_order():
    """removed, then added (replacing the row), then moved (one-way: the target's entry dropped) and swapped."""
    r = RowThresholds()
    r.update([], [(0, 0.1), (1, None), (2, 0.3), (3, 0.4)], [])
    assert r.values(4, 9.0) == [0.1, 9.0, 0.3, 0.4]
    r.update([0], [(0, None)], [])  # a request without a threshold takes the freed row: the server's there
    assert r.values(4, 9.0) == [9.0, 9.0, 0.3, 0.4]
    r.update([1], [], [(3, 1, False)])  # condense: row 3 slides into the freed row 1
    assert r.values(3, 9.0) == [9.0, 0.4, 0.3] and 3 not in r.rows
    r.update([], [], [(0, 2, True)])  # swap
    assert r.values(3, 9.0) == [0.3, 0.4, 9.0]
    r.update([], [(2, 0.0)], [(2, 0, True)])  # added, then moved in the same update
    assert r.values(3, 9.0) == [0.0, 0.4, 0.3]


class _PersistentBatch:
    """A model of vLLM's persistent batch (``vllm/v1/worker/gpu_input_batch.py``: ``remove_request``,
    ``add_request`` into the lowest freed row else at the end, ``condense`` moving the last request into the
    lowest hole, ``swap_states``) and the ``BatchUpdate`` its ``BatchUpdateBuilder`` hands the processors."""

    def __init__(self):
        self.rows: list = []  # request id per row (None: a hole)

    @property
    def num_reqs(self) -> int:
        return sum(r is not None for r in self.rows)

    def step(self, remove, add, swaps):
        """-> (removed, added, moved) as the processor gets them; ``add``: (request, its value)."""
        removed, added, moved = [], [], []
        for req in remove:
            i = self.rows.index(req)
            self.rows[i] = None
            removed.append(i)
        for req, value in add:
            if removed:
                i = min(removed)
                removed.remove(i)
            else:
                i = self.num_reqs
            if i == len(self.rows):
                self.rows.append(None)
            self.rows[i] = req
            added.append((i, value))
        if removed:  # condense
            last = self.num_reqs + len(removed) - 1
            while removed:
                while last in removed:
                    last -= 1
                empty = min(removed)
                if empty >= last:
                    break
                removed.remove(empty)
                self.rows[empty], self.rows[last] = self.rows[last], None
                moved.append((last, empty, False))
                last -= 1
        del self.rows[self.num_reqs :]
        for a, b in swaps:
            self.rows[a], self.rows[b] = self.rows[b], self.rows[a]
            moved.append((a, b, True))
        return removed, added, moved


@pytest.mark.parametrize("seed", range(5))
def test_row_thresholds_follow_the_persistent_batch(seed):
    """Random steps of requests finishing, pausing (unscheduled: removed, re-added later), arriving and being
    reordered: after each update the rows' thresholds are those of the requests in them."""
    rng = random.Random(seed)
    batch, reg = _PersistentBatch(), RowThresholds()
    value = {}  # request -> its threshold (None: the server's)
    next_id, default, paused = 0, -1.0, []
    for _ in range(200):
        live = [r for r in batch.rows if r is not None]
        remove = rng.sample(live, rng.randint(0, min(3, len(live))))
        add = []
        for _ in range(rng.randint(0, 3)):
            if len(live) - len(remove) + len(add) >= 12:
                break
            if paused and rng.random() < 0.3:  # an unscheduled request is scheduled again (same params)
                req = paused.pop(rng.randrange(len(paused)))
            else:
                req, next_id = next_id, next_id + 1
                value[req] = rng.choice([None, 0.0, 0.01, 0.3, 2.0])
            add.append((req, value[req]))
        paused += [r for r in remove if rng.random() < 0.5]  # the others finished
        removed, added, moved = batch.step(remove, add, [])
        n = batch.num_reqs
        swaps = [tuple(rng.sample(range(n), 2)) for _ in range(rng.randint(0, 2))] if n >= 2 else []
        for a, b in swaps:
            batch.rows[a], batch.rows[b] = batch.rows[b], batch.rows[a]
            moved.append((a, b, True))
        reg.update(removed, added, moved)
        want = [default if value[r] is None else value[r] for r in batch.rows]
        assert reg.values(n, default) == want
        assert all(i < n for i in reg.rows), "an entry left past the batch"


def test_token_thresholds_follow_query_start_loc():
    r = RowThresholds()
    r.update([], [(0, 0.5), (2, 0.0)], [])
    qsl = torch.tensor([0, 3, 4, 5, 6], dtype=torch.int32)  # a 3-token prompt, then three decode tokens
    t = token_thresholds(r, qsl, 8, 0.1)  # 2 padding tokens
    assert t.dtype == torch.float32
    assert t.tolist() == pytest.approx([0.5, 0.5, 0.5, 0.1, 0.0, 0.1, 0.1, 0.1])
    assert token_thresholds(r, qsl, 4, 0.1).tolist() == pytest.approx([0.5, 0.5, 0.5, 0.1])


def test_float32_threshold_compares_as_the_scalar():
    """A float32 tensor threshold gives the comparisons the criteria make with the server's Python float."""
    g = torch.Generator().manual_seed(0)
    d = torch.rand(4096, generator=g, dtype=torch.float32)
    for eps in (0.1, 0.3, 0.55, 0.6, 1 / 3):
        d[0] = eps  # at the boundary too
        assert torch.equal(d < eps, d < torch.full_like(d, eps))


def test_install_replaces_the_process_registry():
    a = install()
    assert installed() is a
    b = install()
    assert installed() is b and b is not a


def test_processor_listed():
    class Marked:
        looplm_exit_thresholds = True

    assert processor_listed([PROCESSOR]) and processor_listed([" " + PROCESSOR])
    assert processor_listed(["x.y:Other", Marked])
    assert not processor_listed(None) and not processor_listed([]) and not processor_listed(["x.y:Other", int])


def test_server_refusal():
    assert server_refusal({"criterion": "kl", "threshold": 0.01}) is None
    assert server_refusal({"criterion": "convergence", "threshold": 0.0}) is None
    full = server_refusal(None)
    assert "runs full depth" in full and "looplm_exit" in full and PROCESSOR in full
    gate = server_refusal({"criterion": "gate", "threshold": 0.5})
    assert "gate criterion" in gate and "q=0.5" in gate and PROCESSOR in gate
