"""Retrofitting recurrence into a pretrained model: a layer map and a loop-count schedule.

A pretrained stack of ``L`` layers (e.g. a Llama imported with ``looplm import hf``, which has
``(p, s, K, c) = (0, L, 1, 0)``) becomes a looped ``(p, s, K, c)`` model by choosing which pretrained
layers become the prelude, which the shared core (their weights copied into the ``s`` core blocks)
and which the coda; every other layer is dropped. Embedding, final norm and head are copied; the
recurrence rule's parameters keep their initialisation. In a training config::

    model: runs/smol/model.yaml            # the imported model's config (written by `looplm import hf`)
    model_overrides: {n_prelude: 2, n_core: 4, n_loops: 3, n_coda: 2}
    train:
      init_from: runs/smol                  # the pretrained checkpoint
      init_map: {prelude: [0, 1], core: [10, 11, 12, 13], coda: [28, 29]}
      loop_schedule: [[0, 1], [100, 2], [200, 3]]    # [step, loops]: r from that step on

``loop_schedule`` raises the loop count during training (start near the pretrained depth, then
loop more) — a curriculum in the spirit of the recurrence paper's depth-extrapolation findings; its
exact shape is our choice. The map and the schedule are part of the training config, so every
checkpoint of the run records them (``config.json`` -> ``train.init_map``).

Indices are physical layer indices of the *source* checkpoint (``0 .. p+s+c-1`` over its prelude,
core and coda).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["apply_layer_map", "even_core_map", "layer_prefix", "loops_at", "retrofit_summary", "validate_retrofit"]

PARTS = ("prelude", "core", "coda")


def layer_prefix(cfg, i: int) -> str:
    """State-dict prefix of physical layer ``i`` of a model with config ``cfg`` (prelude, core, coda)."""
    p, s = cfg.n_prelude, cfg.n_core
    if i < p:
        return f"prelude.blocks.{i}."
    if i < p + s:
        return f"core.stack.blocks.{i - p}."
    return f"coda.blocks.{i - p - s}."


def validate_retrofit(tc, mcfg) -> list[str]:
    """Messages for a bad ``train.init_map`` / ``train.loop_schedule`` given the model config ``mcfg``."""
    errs = []
    m = tc.init_map
    if m is not None:
        if not tc.init_from:
            errs.append("train.init_map: needs train.init_from (the pretrained checkpoint the layers come from)")
        unknown = [k for k in m if k not in PARTS]
        if unknown:
            errs.append(f"train.init_map: unknown part(s) {unknown}; use {list(PARTS)}")
        want = {"prelude": mcfg.n_prelude, "core": mcfg.n_core, "coda": mcfg.n_coda}
        for part in PARTS:
            layers = m.get(part, [])
            if not isinstance(layers, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers
            ):
                errs.append(f"train.init_map.{part}: must be a list of pretrained layer indices >= 0, got {layers!r}")
            elif len(layers) != want[part]:
                errs.append(
                    f"train.init_map.{part}: lists {len(layers)} layer(s) but the model has n_{part}"
                    f"={want[part]} {part} block(s)"
                )
    sched = tc.loop_schedule
    if sched is not None:
        ok = (
            isinstance(sched, list)
            and sched
            and all(
                isinstance(e, (list, tuple))
                and len(e) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in e)
                for e in sched
            )
        )
        if not ok:
            errs.append(f"train.loop_schedule: must be a non-empty list of [step, loops] pairs, got {sched!r}")
        else:
            steps = [s for s, _ in sched]
            if steps[0] != 0 or steps != sorted(set(steps)):
                errs.append(f"train.loop_schedule: steps must start at 0 and increase, got {steps}")
            if any(r < 1 for _, r in sched):
                errs.append(f"train.loop_schedule: loop counts must be >= 1, got {[r for _, r in sched]}")
        if getattr(tc, "random_loops", None) is not None:
            errs.append("train.loop_schedule: cannot be combined with train.random_loops")
    return errs


def loops_at(schedule: list, step: int) -> int:
    """The loop count of update ``step`` (0-based): the last entry whose step is <= ``step``."""
    r = schedule[0][1]
    for s, loops in schedule:
        if s <= step:
            r = loops
    return r


def even_core_map(n_src: int, p: int, s: int, c: int) -> dict[str, list[int]]:
    """A default map: the first ``p`` layers -> prelude, the last ``c`` -> coda, and ``s`` core layers
    spread evenly over the middle (the rest dropped)."""
    middle = list(range(p, n_src - c))
    if s > len(middle):
        raise ValueError(f"the core needs {s} layers but only {len(middle)} lie between prelude and coda")
    core = (
        [middle[round(j * (len(middle) - 1) / max(1, s - 1))] for j in range(s)]
        if s > 1
        else [middle[len(middle) // 2]]
    )
    return {"prelude": list(range(p)), "core": core, "coda": list(range(n_src - c, n_src))}


def apply_layer_map(model, source: str | Path, init_map: dict) -> str:
    """Copy the pretrained weights of checkpoint ``source`` into ``model`` through ``init_map``.

    Every block parameter of ``model`` is filled (prelude, core and coda blocks from their mapped
    source layers), plus ``embed`` / ``norm`` / ``lm_head``; only recurrence-rule parameters keep
    their initialisation. Returns a one-line summary for the training log.
    """
    from ..checkpoint_io import CheckpointError, load_json, load_tensors, resolve_checkpoint, verify_or_warn
    from ..config import ModelConfig

    ckpt = resolve_checkpoint(source)
    verify_or_warn(ckpt)
    src_cfg = ModelConfig.from_dict(load_json(ckpt / "config.json")["model"])
    src = load_tensors(ckpt / "model.safetensors")
    n_src = src_cfg.n_physical
    cfg = model.config
    dst = model.state_dict()
    new = {}
    for part, first in (("prelude", 0), ("core", cfg.n_prelude), ("coda", cfg.n_prelude + cfg.n_core)):
        for j, i in enumerate(init_map.get(part, [])):
            if not 0 <= i < n_src:
                raise CheckpointError(
                    f"train.init_map.{part}[{j}] = {i}: the pretrained model has layers 0..{n_src - 1}"
                )
            sp, dp = layer_prefix(src_cfg, i), layer_prefix(cfg, first + j)
            names = [k for k in dst if k.startswith(dp)]
            for k in names:
                sk = sp + k[len(dp) :]
                if sk not in src:
                    raise CheckpointError(f"pretrained layer {i} has no {sk!r} for {k!r}: the block kinds differ")
                if src[sk].shape != dst[k].shape:
                    raise CheckpointError(
                        f"{k!r} <- {sk!r}: shape {tuple(dst[k].shape)} vs pretrained {tuple(src[sk].shape)}"
                    )
                new[k] = src[sk]
    for k in ("embed.weight", "norm.weight", "lm_head.weight"):
        if k in dst and k in src:
            if src[k].shape != dst[k].shape:
                raise CheckpointError(f"{k!r}: shape {tuple(dst[k].shape)} vs pretrained {tuple(src[k].shape)}")
            new[k] = src[k]
    missing = [k for k in dst if k not in new and not k.startswith("rule.")]
    if cfg.tie_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing:
        raise CheckpointError(f"train.init_map leaves {missing[:5]} without pretrained weights; map every block")
    model.load_state_dict(new, strict=False)
    kept = sorted(set(init_map.get("prelude", [])) | set(init_map.get("core", [])) | set(init_map.get("coda", [])))
    dropped = [i for i in range(n_src) if i not in kept]
    return (
        f"retrofitted from {ckpt} ({n_src} layers): prelude <- {init_map.get('prelude', [])}, "
        f"core <- {init_map.get('core', [])} (x{cfg.n_loops} loops), coda <- {init_map.get('coda', [])}, "
        f"dropped {dropped}"
    )


def retrofit_summary(checkpoint_config: dict) -> list[str]:
    """Lines describing a run's retrofit (for ``looplm info RUN``): its ``init_from``, layer map and
    loop schedule, read from a checkpoint's ``config.json`` dict; empty when the run was not retrofitted."""
    tc = (checkpoint_config.get("train") or {}).get("train") or {}
    if not tc.get("init_map") and not tc.get("loop_schedule"):
        return []
    m = tc.get("init_map") or {}
    lines = [f"retrofitted from  {tc.get('init_from')}"]
    lines += [f"  {part:8s} <- pretrained layers {m[part]}" for part in PARTS if m.get(part)]
    if tc.get("loop_schedule"):
        lines.append("  loop schedule  " + ", ".join(f"step {s}: r = {r}" for s, r in tc["loop_schedule"]))
    return lines
