"""The Hugging Face modelling files that ``looplm export hf`` copies next to the weights.

``configuration_looplm.py`` and ``modeling_looplm.py`` are ordinary modules of this package (so they
are imported and tested here) and are also the ``trust_remote_code`` files of every export: they
import only ``transformers``, ``torch`` and ``looplm`` (absolute imports) and each other (relative).
"""
