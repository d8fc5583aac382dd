"""Evaluation: perplexity (token and word level, :mod:`looplm.eval.ppl`) and more."""
