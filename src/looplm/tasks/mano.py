"""Mano: knowledge manipulation over F_23 (Looped-Mamba paper, §4.1 and Appendix C; Allen-Zhu 2025).

An instance is a tree-structured arithmetic expression with ``ℓ`` binary operations from {+, −, *}
over the field F_23, written in prefix notation, followed by its value::

    <bos> <len_3> - * a b + c d <ans> ans

Vocabulary (App. C): the numbers 0..22, the three operators, ``<bos>``, ``<ans>``, ``<eos>``,
``<pad>`` and ``<len_i>`` for ``i ∈ [0, L]``. Token ids: number ``v`` -> ``v``; ``+ - *`` -> 23, 24, 25;
``<bos> <ans> <eos> <pad>`` -> 26..29; ``<len_i>`` -> ``30 + i`` (so ``vocab_size = 31 + L``).

* Training draws ``ℓ ~ U{1..L}`` and packs many instances into one ``seq_len``-token chunk (1024 in
  the paper). Instances are whole: a chunk takes instances while they fit and is padded with
  ``<pad>`` after the last one (our reading: the paper does not say how a chunk ends).
* Evaluation uses ``ℓ = L`` only, one instance per row (no packing), ``count`` (2000) deterministic
  instances from a fixed seed; exact match on the single answer token after ``<ans>``.

Tree shape (the paper does not specify the distribution; our choice): a tree with ``ℓ`` operations
gives its left subtree ``k ~ U{0..ℓ−1}`` operations and its right subtree the other ``ℓ−1−k``;
operators and leaves are uniform. Randomness comes from :class:`random.Random` seeded with a string
(``"mano:<split>:<L>:<seed>"``), so the same seed gives the same instances on every platform.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

P = 23  # the field F_23
OPS = ("+", "-", "*")
SPECIALS = ("<bos>", "<ans>", "<eos>", "<pad>")


@dataclass
class ManoInstance:
    tokens: list[str]  # <bos> <len_ℓ> prefix expression <ans> answer
    length: int  # ℓ: binary operations in the expression
    answer: int  # value in F_23


class ManoVocab:
    """Token strings <-> ids for maximum length ``L`` (see the module docstring for the layout)."""

    def __init__(self, max_length: int):
        if max_length < 1:
            raise ValueError(f"Mano max_length L must be >= 1, got {max_length}")
        self.max_length = max_length
        self.itos = (
            [str(v) for v in range(P)] + list(OPS) + list(SPECIALS) + [f"<len_{i}>" for i in range(max_length + 1)]
        )
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.bos, self.ans, self.eos, self.pad = (self.stoi[s] for s in SPECIALS)

    @property
    def size(self) -> int:
        return len(self.itos)

    def encode(self, tokens: list[str]) -> list[int]:
        try:
            return [self.stoi[t] for t in tokens]
        except KeyError as e:
            raise ValueError(f"token {e.args[0]!r} is not in the Mano vocabulary for L={self.max_length}") from None

    def decode(self, ids) -> list[str]:
        return [self.itos[int(i)] for i in ids]


def _apply(op: str, a: int, b: int) -> int:
    if op == "+":
        return (a + b) % P
    if op == "-":
        return (a - b) % P
    return (a * b) % P


def _expression(rng: random.Random, n_ops: int) -> tuple[list[str], int]:
    """A random prefix expression with ``n_ops`` binary operations and its value in F_23."""
    if n_ops == 0:
        v = rng.randrange(P)
        return [str(v)], v
    op = OPS[rng.randrange(3)]
    k = rng.randrange(n_ops)  # operations in the left subtree
    left, a = _expression(rng, k)
    right, b = _expression(rng, n_ops - 1 - k)
    return [op, *left, *right], _apply(op, a, b)


def evaluate_prefix(tokens: list[str]) -> int:
    """Value of a prefix expression (the task's reference semantics; raises on malformed input)."""
    pos = 0

    def rec() -> int:
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError("prefix expression ends early")
        t = tokens[pos]
        pos += 1
        if t in OPS:
            a = rec()
            b = rec()
            return _apply(t, a, b)
        v = int(t)
        if not 0 <= v < P:
            raise ValueError(f"number {v} is not in F_23")
        return v

    value = rec()
    if pos != len(tokens):
        raise ValueError("prefix expression has trailing tokens")
    return value


def make_instance(rng: random.Random, length: int) -> ManoInstance:
    """One instance with exactly ``length`` operations."""
    expr, value = _expression(rng, length)
    return ManoInstance(["<bos>", f"<len_{length}>", *expr, "<ans>", str(value)], length, value)


def _rng(split: str, max_length: int, seed: int) -> random.Random:
    return random.Random(f"mano:{split}:{max_length}:{seed}")


def generate(split: str, count: int, max_length: int, seed: int = 0) -> list[ManoInstance]:
    """``count`` instances: ``train`` draws ``ℓ ~ U{1..L}``, ``eval`` uses ``ℓ = L`` (App. C)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    ManoVocab(max_length)  # validates L
    rng = _rng(split, max_length, seed)
    out = []
    for _ in range(count):
        length = max_length if split == "eval" else rng.randint(1, max_length)
        out.append(make_instance(rng, length))
    return out


def instance_record(inst: ManoInstance, vocab: ManoVocab) -> dict:
    """The JSONL record of ``looplm task mano export``."""
    return {"tokens": inst.tokens, "length": inst.length, "answer": inst.answer, "ids": vocab.encode(inst.tokens)}


# ------------------------------------------------------------------------------------------------
# batches
# ------------------------------------------------------------------------------------------------
def answer_labels(ids: list[int], vocab: ManoVocab) -> list[int]:
    """Labels aligned with ``ids``: the answer token only (the model's loss shifts targets inside,
    so the logit at ``<ans>`` is trained to predict the label at the answer's position)."""
    labels = [-100] * len(ids)
    for i in range(1, len(ids)):
        if ids[i - 1] == vocab.ans:
            labels[i] = ids[i]
    return labels


class ManoStream:
    """Online training batches: instances with ``ℓ ~ U{1..L}`` packed into ``seq_len``-token chunks.

    ``loss_on``: ``"all"`` (every real token of the chunk, language-model style; our default reading
    of "sequence packing") or ``"answer"`` (only the answer tokens). Padding is never a target.
    """

    def __init__(self, max_length: int, seq_len: int = 1024, seed: int = 0, loss_on: str = "all"):
        if loss_on not in ("all", "answer"):
            raise ValueError(f"loss_on must be 'all' or 'answer', got {loss_on!r}")
        self.vocab = ManoVocab(max_length)
        longest = 2 * max_length + 1 + 4  # <bos> <len> (2ℓ+1 expression tokens) <ans> ans
        if seq_len < longest:
            raise ValueError(f"seq_len={seq_len} cannot hold one instance of length L={max_length} ({longest} tokens)")
        self.max_length, self.seq_len, self.loss_on = max_length, seq_len, loss_on
        self.rng = _rng("train", max_length, seed)
        self._next: list[int] | None = None

    def _draw(self) -> list[int]:
        if self._next is None:
            inst = make_instance(self.rng, self.rng.randint(1, self.max_length))
            self._next = self.vocab.encode(inst.tokens)
        return self._next

    def chunk(self) -> tuple[list[int], list[int]]:
        """One packed chunk ``(ids, labels)`` of exactly ``seq_len`` tokens."""
        ids: list[int] = []
        labels: list[int] = []
        while len(ids) + len(self._draw()) <= self.seq_len:
            inst = self._draw()
            self._next = None
            ids += inst
            labels += list(inst) if self.loss_on == "all" else answer_labels(inst, self.vocab)
        if self.loss_on == "all":
            labels[0] = -100  # nothing predicts the first token of the chunk
        pad = self.seq_len - len(ids)
        return ids + [self.vocab.pad] * pad, labels + [-100] * pad

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)``, both ``[batch_size, seq_len]``."""
        rows = [self.chunk() for _ in range(batch_size)]
        return torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])


def eval_batch(instances: list[ManoInstance], vocab: ManoVocab) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpacked evaluation rows, right-padded: ``(input_ids [N, T], answer_pos [N], answers [N])``.

    ``answer_pos`` is the position of ``<ans>``: its logits predict the answer (exact match there).
    Right padding never changes a causal model's logits at earlier positions.
    """
    seqs = [vocab.encode(i.tokens) for i in instances]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), vocab.pad, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
    pos = torch.tensor([len(s) - 2 for s in seqs])
    answers = torch.tensor([vocab.stoi[str(i.answer)] for i in instances])
    return ids, pos, answers
