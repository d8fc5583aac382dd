"""Synthetic reasoning tasks of the Looped-Mamba paper: Mano (App. C) and p-hop induction (App. D).

``looplm task {mano,phop} export|train|eval`` (see :mod:`looplm.tasks.cli`)."""

from . import mano, phop

__all__ = ["mano", "phop"]
