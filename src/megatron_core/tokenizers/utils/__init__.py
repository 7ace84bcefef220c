"""Helpers for building tokenizers from training arguments."""
