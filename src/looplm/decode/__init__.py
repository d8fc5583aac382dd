"""Decoding (placeholder docstring; written below)."""
