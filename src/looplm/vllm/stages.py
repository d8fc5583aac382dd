"""Pipeline parallelism for the plugin: which parts of a looped model each pipeline rank holds (pure; no vLLM).

vLLM's pipeline parallelism (``--pipeline-parallel-size P``) runs a model as ``P`` stages, one per rank, each
handing its last hidden state to the next in one pass per step. A looped core runs its ``s`` blocks ``r`` times
and feeds each loop's output back into the first: a stage boundary inside the core would need the pass to go back
to an earlier rank ``r − 1`` times per step, which vLLM's pipeline does not do. So the core is one unit, on one
rank, and the stages split only between the model's parts::

    units     prelude 0 … prelude p−1 | core (s blocks × r loops, the rule) | coda 0 … coda c−1
    cost      1 each                  | r·s                                  | 1 each

:func:`pipeline_stages` cuts the units into ``P`` contiguous, non-empty stages that minimise the largest stage's
cost (block calls per token); the core's rank also holds the rule and its own attention slots. A model with
fewer units than ranks is refused (:func:`pipeline_refusal`) — in particular every model without a prelude and a
coda (Ouro, the BaseLoop presets): its whole depth is the looped core.

Between stages vLLM sends ``hidden_states [N, d]`` (the prelude's output before the core, the rule's ``finish``
after it) and ``embeds [N, d]`` (``E``, which injection rules read inside the core).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig

__all__ = ["Stage", "pipeline_refusal", "pipeline_stages"]


@dataclass(frozen=True)
class Stage:
    """What pipeline rank ``rank`` holds: physical prelude layers ``prelude``, the core (``core``: its blocks
    over every loop and the rule) or not, physical coda layers ``coda``; ``first`` embeds the tokens, ``last``
    holds the final norm and the head."""

    rank: int
    prelude: tuple[int, ...]
    core: bool
    coda: tuple[int, ...]
    first: bool
    last: bool

    def holds(self, part: str, layer: int | None) -> bool:
        """Whether this rank runs block ``layer`` of ``part`` (``prelude`` / ``core`` / ``coda``; ``rule``: the
        rule's own attention, on the core's rank)."""
        if part in ("core", "rule"):
            return self.core
        return layer in (self.prelude if part == "prelude" else self.coda)


def _units(cfg: ModelConfig, num_loops: int) -> list[tuple[str, int | None, int]]:
    """``(part, physical layer, cost)`` of the model's pipeline units, in order."""
    p, s, c = cfg.n_prelude, cfg.n_core, cfg.n_coda
    return (
        [("prelude", i, 1) for i in range(p)]
        + [("core", None, num_loops * s)]
        + [("coda", p + s + i, 1) for i in range(c)]
    )


def pipeline_refusal(cfg: ModelConfig, num_loops: int, pp: int, exit: dict | None = None) -> str | None:
    """Why ``cfg`` cannot run on ``pp`` pipeline ranks, or ``None``."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pipeline-parallel size must be a positive int, got {pp!r}")
    if pp == 1:
        return None
    n = len(_units(cfg, num_loops))
    if n < pp:
        return (
            f"pipeline-parallel size {pp}: the stages split only between the prelude's blocks, the looped core (whole "
            f"on one rank: each loop feeds the next) and the coda's blocks — {n} unit(s) here "
            f"(p = {cfg.n_prelude}, c = {cfg.n_coda}); serve at pipeline-parallel size <= {n}, or with tensor "
            "parallelism"
        )
    if exit is not None:
        return f"per-token exit (looplm_exit) at pipeline-parallel size {pp}: not checked against looplm there"
    if any(cfg.mixer_of(i) != "attention" for i in range(cfg.n_physical)):
        return f"Mamba-2 blocks at pipeline-parallel size {pp}: not checked against looplm there"
    if cfg.rule.name == "ponderlm":
        return f"PonderLM at pipeline-parallel size {pp}: its loops read out through the head, on the last rank"
    return None


def pipeline_stages(cfg: ModelConfig, num_loops: int, pp: int) -> tuple[Stage, ...]:
    """The ``pp`` stages of ``cfg`` served at ``num_loops`` loops: contiguous runs of its units minimising the
    largest stage cost (ties: the earliest cut), each rank at least one unit. Raises ``ValueError`` when
    :func:`pipeline_refusal` refuses the size."""
    why = pipeline_refusal(cfg, num_loops, pp)
    if why is not None:
        raise ValueError(why)
    units = _units(cfg, num_loops)
    n, cost = len(units), [u[2] for u in units]
    pre = [0]
    for w in cost:
        pre.append(pre[-1] + w)
    # best[j][k]: the smallest largest-stage cost of units[:j] in k stages, and the cut before the last stage
    INF = float("inf")
    best = [[(INF, 0)] * (pp + 1) for _ in range(n + 1)]
    best[0][0] = (0, 0)
    for k in range(1, pp + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                v = max(best[i][k - 1][0], pre[j] - pre[i])
                if v < best[j][k][0]:
                    best[j][k] = (v, i)
    cuts, j = [], n
    for k in range(pp, 0, -1):
        i = best[j][k][1]
        cuts.append((i, j))
        j = i
    out = []
    for rank, (i, j) in enumerate(reversed(cuts)):
        mine = units[i:j]
        out.append(
            Stage(
                rank=rank,
                prelude=tuple(layer for part, layer, _ in mine if part == "prelude"),
                core=any(part == "core" for part, _, _ in mine),
                coda=tuple(layer for part, layer, _ in mine if part == "coda"),
                first=rank == 0,
                last=rank == pp - 1,
            )
        )
    return tuple(out)
