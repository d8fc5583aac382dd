"""The models ``looplm bench adaptive`` trains and measures, and the held-out text it scores.

* ``lm`` — the looped LM of ``configs/bench/adaptive-lm.yaml`` (:func:`train_lm`, :func:`load_lm`);
* ``phop`` — p-hop on a 1⊗4 looped Transformer with the two-stage exit gate (:func:`train_phop`, its
  stage 2 by :func:`gate_stage`);
* :func:`_held_out` — rows of the LM's validation documents (never trained on).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


def _repo_file(rel: str) -> Path:
    from ...train.cli import find_config

    return find_config(rel)


LM_CONFIG = "configs/bench/adaptive-lm.yaml"


def train_lm(runs: Path, data: str, steps: int | None = None, config: str = LM_CONFIG) -> Path:
    from ...train.config import load_train_config
    from ...train.trainer import Trainer

    out = runs / "lm"
    ov = [f"data.paths=[{data}]"] + ([f"train.max_steps={steps}"] if steps else [])
    Trainer(load_train_config(_repo_file(config), ov), out, resume=True, quiet=True).fit()
    return out


def load_lm(runs: Path, device="cpu"):
    from ...checkpoint_io import load_model_for_inference

    model, tok = load_model_for_inference(runs / "lm", device=device)
    return model.eval(), tok


def train_phop(runs: Path, stage1_steps: int = 1000, stage2_steps: int = 400, quiet: bool = True) -> Path:
    """The base (final-loop loss, the task trainer), then the exit gate's stage 1 and stage 2 (App. B)."""
    from ...tasks.train import load_task_config, train_task

    cfg = load_task_config(_repo_file("configs/bench/adaptive-phop-gate.yaml"), task="phop")
    base = runs / "phop-base"
    if not (base / "results.json").exists():
        train_task(cfg, base, quiet=quiet)
    s1 = gate_stage(base, runs / "phop-gate1", stage=1, steps=stage1_steps, lr=1e-3)
    return gate_stage(s1, runs / "phop-gate2", stage=2, steps=stage2_steps, lr=3e-3)


def gate_stage(run: Path, out: Path, stage: int, steps: int, lr: float, seed: int = 1) -> Path:
    """Continue a task run with the exit gate (App. B): ``stage`` 1 trains every parameter on the
    entropy-regularised expected loss (β = 0.25) from the run's weights (a new gate, bias −2); stage 2 only
    ``rule.gate`` on the improvement-target BCE (κ = 50, γ = 0.005), everything else frozen. AdamW, cosine
    to 0.1 of ``lr``; writes a task run (``model.safetensors``, ``config.json``) at ``out``."""
    from safetensors.torch import load_file, save_file

    from ...dataclass_util import to_dict
    from ...tasks.train import build_task_model, load_task_run

    if (out / "model.safetensors").exists():
        return out
    _, cfg = load_task_run(run)
    d = Path(run)
    if (d / "results.json").exists() and not (d / "model.safetensors").exists():
        d = d / f"seed_{json.loads((d / 'results.json').read_text())['best_seed']}"
    cfg.model_overrides = {
        **cfg.model_overrides,
        "rule": {"name": "exit_gate", "options": {"stage": stage, "beta": 0.25, "bias_init": -2.0}},
    }
    torch.manual_seed(seed)
    model = build_task_model(cfg)
    missing, _ = model.load_state_dict(load_file(str(d / "model.safetensors")), strict=False)
    assert set(missing) <= {"rule.gate.weight", "rule.gate.bias"}, missing
    model.train()
    params = [p for n, p in model.named_parameters() if stage == 1 or n.startswith("rule.gate")]
    for n, p in model.named_parameters():
        p.requires_grad_(stage == 1 or n.startswith("rule.gate"))
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / max(1, steps)))
    )
    stream = cfg.task.stream(seed)
    for _ in range(steps):
        ids, labels = stream.next_batch(cfg.train.batch_size)
        model(ids, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(
        json.dumps({"task_run": to_dict(cfg), "model": to_dict(model.config), "seed": seed}, indent=2)
    )
    return out


def _held_out(tok, data: str, n: int, length: int, seed: int = 0) -> torch.Tensor:
    """``[n, length]`` rows of the LM's validation documents (every 50th speech of the corpus, never trained
    on), ``seed`` picking which of the first ``4n`` rows."""
    from ...data.config import DataConfig
    from ...data.pipeline import iter_val_batches

    if not Path(data).exists():
        raise FileNotFoundError(f"--data {data!r}: the LM's corpus is not there (a text file; the LM trains on it)")
    cfg = DataConfig(
        source="files", paths=[data], split_mode="blank_lines", seq_len=length, tokenizer="byte", shuffle_buffer=0
    )
    rows = torch.cat(list(iter_val_batches(cfg, tok, None, 64)))[: 4 * n]
    g = torch.Generator().manual_seed(seed)
    return rows[torch.randperm(rows.shape[0], generator=g)[:n]]
