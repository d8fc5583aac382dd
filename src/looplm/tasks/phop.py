"""p-hop induction (Looped-Mamba paper, §4.2 and Appendix D; Sanford et al. 2024).

Given ``v = (v_1, …, v_n)`` over an alphabet of 4, one hop from position ``i`` finds the previous
occurrence of ``v_i`` and moves to the token right after it; ``p`` hops from the last position give
the answer. With 1-based positions (Sanford et al.'s ``find``)::

    find(i)   = max{ j <= i : v_{j−1} = v_i }        (undefined when v_i has no earlier occurrence)
    hop_p(v)  = v_{find^p(n)}

A sample is ``<bos> v_1 … v_n <ans> y <eos>``: ``1 + n + 3`` tokens (260 for ``n = 256``, in a context
of 272). Token ids: the alphabet ``0..3``, then ``<bos> <ans> <eos> <pad>`` (vocabulary 8).
The loss is on the answer token only (the logit at ``<ans>`` predicts ``y``); evaluation is argmax
exact match there on ``count`` (10,000) deterministic samples from a fixed seed.

**Chain-first construction** (App. D): sample the hop positions ``i_0 = n > i_1 > … > i_p`` first,
with the gaps of a random sequence conditioned on a genuine hop (gap ``d = i_k − i_{k+1} >= 1``,
``P(d) ∝ (1 − 1/|Σ|)^d``: the previous occurrence is never the token right before, so the trace never
stands still), and the chain values ``c_k = v_{i_k}`` with ``c_{k+1} ≠ c_k``; pin ``v_{i_k} = c_k`` and
``v_{i_{k+1}−1} = c_k`` (the occurrence hop ``k`` lands after); fill every other position of the
search window ``(i_{k+1}−1, i_k)`` with a symbol ``≠ c_k`` and the positions before the chain freely;
then **verify** that the actual hop trace of the filled sequence is exactly ``(i_0, …, i_p)``, and
draw again if not. The answer is ``c_p``.

**Dense target** (our CPU-scale option, not the paper's): at every position ``t`` the target is
``hop_p`` of the prefix ``v_1..v_t`` (where defined, else ignored), and ``y`` after ``<ans>``.
With it a small looped model learns the task in a few thousand steps on a CPU; with the answer-only
loss small models stayed near chance within 2000 steps in our calibration.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

BOS, ANS, EOS, PAD = "<bos>", "<ans>", "<eos>", "<pad>"


@dataclass
class PhopInstance:
    sequence: list[int]  # v_1..v_n, symbols in 0..alphabet-1
    p: int
    answer: int
    chain: list[int]  # the hop positions i_0 = n-1 > i_1 > ... > i_p (0-based)


class PhopVocab:
    """``0..A−1`` the alphabet, then ``<bos> <ans> <eos> <pad>``."""

    def __init__(self, alphabet: int = 4):
        if alphabet < 2:
            raise ValueError(f"p-hop alphabet must have >= 2 symbols, got {alphabet}")
        self.alphabet = alphabet
        self.itos = [str(a) for a in range(alphabet)] + [BOS, ANS, EOS, PAD]
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.bos, self.ans, self.eos, self.pad = alphabet, alphabet + 1, alphabet + 2, alphabet + 3

    @property
    def size(self) -> int:
        return len(self.itos)

    def encode(self, inst: PhopInstance) -> list[int]:
        return [self.bos, *inst.sequence, self.ans, inst.answer, self.eos]


# ------------------------------------------------------------------------------------------------
# hop semantics
# ------------------------------------------------------------------------------------------------
def previous_occurrence(seq: list[int]) -> list[int]:
    """``prev[i]``: the last ``j < i`` with ``seq[j] == seq[i]`` (``-1`` if none); 0-based."""
    last: dict[int, int] = {}
    prev = []
    for i, v in enumerate(seq):
        prev.append(last.get(v, -1))
        last[v] = i
    return prev


def hop_trace(seq: list[int], p: int, start: int | None = None, prev: list[int] | None = None) -> list[int] | None:
    """Positions ``[i_0, …, i_p]`` visited by ``p`` hops from ``start`` (default: the last position),
    0-based: ``i_{k+1} = prev[i_k] + 1``. ``None`` when some ``v_{i_k}`` has no earlier occurrence."""
    prev = previous_occurrence(seq) if prev is None else prev
    i = len(seq) - 1 if start is None else start
    trace = [i]
    for _ in range(p):
        if prev[i] < 0:
            return None
        i = prev[i] + 1
        trace.append(i)
    return trace


def hop_answer(seq: list[int], p: int) -> int | None:
    """``hop_p(v)`` (``None`` where undefined)."""
    trace = hop_trace(seq, p)
    return None if trace is None else seq[trace[-1]]


def prefix_answers(seq: list[int], p: int) -> list[int | None]:
    """``hop_p(v_1..v_t)`` for every prefix end ``t`` (the dense target), ``None`` where undefined."""
    prev = previous_occurrence(seq)
    out = []
    for t in range(len(seq)):
        trace = hop_trace(seq, p, start=t, prev=prev)
        out.append(None if trace is None else seq[trace[-1]])
    return out


# ------------------------------------------------------------------------------------------------
# chain-first construction
# ------------------------------------------------------------------------------------------------
def _draw_once(rng: random.Random, n: int, p: int, A: int) -> PhopInstance | None:
    stay = 1.0 - 1.0 / A
    pos = [n - 1]
    for _ in range(p):
        d = 1
        while rng.random() < stay:  # P(d) ∝ stay^d, d >= 1
            d += 1
        pos.append(pos[-1] - d)
    if pos[-1] - 1 < 0:  # the last hop must land after an occurrence at position >= 0
        return None
    fixed: dict[int, int] = {pos[0]: rng.randrange(A)}
    chain_vals = [fixed[pos[0]]]
    for k in range(p):
        c = chain_vals[k]
        nxt = pos[k + 1]
        if nxt in fixed:  # pinned earlier as an occurrence (gap 1): must differ from c
            c1 = fixed[nxt]
            if c1 == c:
                return None
        else:
            c1 = (c + 1 + rng.randrange(A - 1)) % A  # uniform over the symbols != c
            fixed[nxt] = c1
        occ = nxt - 1
        if fixed.get(occ, c) != c:
            return None
        fixed[occ] = c
        chain_vals.append(c1)
    seq = [0] * n
    window_of = {}  # position -> the chain value its window must avoid
    for k in range(p):
        for j in range(pos[k + 1], pos[k]):
            window_of[j] = chain_vals[k]
    for j in range(n):
        if j in fixed:
            seq[j] = fixed[j]
        elif j in window_of:
            seq[j] = (window_of[j] + 1 + rng.randrange(A - 1)) % A
        else:
            seq[j] = rng.randrange(A)
    if hop_trace(seq, p) != pos:  # verification: the actual hop trace is the constructed chain
        return None
    return PhopInstance(seq, p, seq[pos[-1]], pos)


def make_instance(rng: random.Random, n: int, p: int, alphabet: int = 4, max_attempts: int = 1000) -> PhopInstance:
    """One verified instance (chain-first, see the module docstring)."""
    if p < 1 or n < 2:
        raise ValueError(f"p-hop needs p >= 1 and n >= 2, got p={p}, n={n}")
    if p > n - 2:
        raise ValueError(f"p={p} hops need a sequence of more than p+1 tokens, got n={n}")
    for _ in range(max_attempts):
        inst = _draw_once(rng, n, p, alphabet)
        if inst is not None:
            return inst
    raise ValueError(
        f"could not build a {p}-hop chain in n={n} tokens over {alphabet} symbols; use a larger n or smaller p"
    )


def _rng(split: str, n: int, p: int, alphabet: int, seed: int) -> random.Random:
    return random.Random(f"phop:{split}:{n}:{p}:{alphabet}:{seed}")


def generate(split: str, count: int, n: int = 256, p: int = 16, alphabet: int = 4, seed: int = 0) -> list[PhopInstance]:
    """``count`` verified instances; ``split`` (``train`` / ``eval``) selects an independent stream."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = _rng(split, n, p, alphabet, seed)
    return [make_instance(rng, n, p, alphabet) for _ in range(count)]


def instance_record(inst: PhopInstance, vocab: PhopVocab) -> dict:
    """The JSONL record of ``looplm task phop export``."""
    return {
        "sequence": inst.sequence,
        "p": inst.p,
        "n": len(inst.sequence),
        "answer": inst.answer,
        "ids": vocab.encode(inst),
    }


# ------------------------------------------------------------------------------------------------
# batches
# ------------------------------------------------------------------------------------------------
def labels_for(inst: PhopInstance, vocab: PhopVocab, dense: bool = False) -> list[int]:
    """Labels aligned with ``vocab.encode(inst)`` (the model shifts them: the label at position
    ``j`` is predicted from position ``j−1``). Answer-only: ``y`` at its own position, so the logit
    at ``<ans>`` predicts it. Dense: additionally ``hop_p(v_1..v_t)`` predicted from ``v_t``."""
    ids = vocab.encode(inst)
    labels = [-100] * len(ids)
    n = len(inst.sequence)
    labels[n + 2] = inst.answer  # ids[n+1] = <ans>, ids[n+2] = y
    if dense:
        for t, a in enumerate(prefix_answers(inst.sequence, inst.p)):
            if a is not None:
                labels[t + 2] = a  # v_t sits at ids[t+1]
    return labels


class PhopStream:
    """Online training batches, one instance per row padded to ``seq_len`` (272 in the paper)."""

    def __init__(
        self,
        n: int = 256,
        p: int = 16,
        alphabet: int = 4,
        seq_len: int | None = None,
        seed: int = 0,
        dense_target: bool = False,
    ):
        self.vocab = PhopVocab(alphabet)
        self.n, self.p, self.alphabet, self.dense = n, p, alphabet, dense_target
        self.seq_len = seq_len or n + 3 + 1
        if self.seq_len < n + 4:
            raise ValueError(f"seq_len={self.seq_len} cannot hold a p-hop sample of 1 + n + 3 = {n + 4} tokens")
        self.rng = _rng("train", n, p, alphabet, seed)

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((batch_size, self.seq_len), self.vocab.pad, dtype=torch.long)
        labels = torch.full((batch_size, self.seq_len), -100, dtype=torch.long)
        for r in range(batch_size):
            inst = make_instance(self.rng, self.n, self.p, self.alphabet)
            seq = self.vocab.encode(inst)
            ids[r, : len(seq)] = torch.tensor(seq)
            labels[r, : len(seq)] = torch.tensor(labels_for(inst, self.vocab, self.dense))
        return ids, labels


def eval_batch(instances: list[PhopInstance], vocab: PhopVocab) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids [N, n+2], answer_pos [N], answers [N])``: ``<bos> v <ans>`` per row, each fed
    independently (no padding: every row has the same length); exact match at ``<ans>``."""
    ids = torch.tensor([[vocab.bos, *i.sequence, vocab.ans] for i in instances])
    pos = torch.full((len(instances),), ids.shape[1] - 1)
    return ids, pos, torch.tensor([i.answer for i in instances])
