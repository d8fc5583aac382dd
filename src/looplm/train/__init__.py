"""Training: configs, Muon + AdamW optimizers, schedules, checkpoints, DDP / FSDP2, the trainer.

>>> from looplm.train import load_train_config, Trainer
>>> summary = Trainer(load_train_config("configs/train/tiny.yaml"), "runs/demo").fit()

The command line (``looplm train / eval ppl / plot / demo``) lives in :mod:`looplm.train.cli`.
"""

from .config import TrainConfig, load_train_config
from .schedule import build_lr_lambda, cosine_lambda, wsd_lambda
from .optim import MultiOptimizer, build_optimizer, plan_param_groups
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from .trainer import Trainer, TrainingDivergedError, train

__all__ = [
    "TrainConfig",
    "load_train_config",
    "build_lr_lambda",
    "cosine_lambda",
    "wsd_lambda",
    "MultiOptimizer",
    "build_optimizer",
    "plan_param_groups",
    "CheckpointError",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "Trainer",
    "TrainingDivergedError",
    "train",
]
