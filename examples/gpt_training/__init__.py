"""Pieces of ``examples/pretrain_gpt.py``: flags, model presets, data, logging, checkpoint glue, the loop."""
