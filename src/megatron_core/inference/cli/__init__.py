"""Command-line tools: ``megatron-generate`` and ``megatron-serve``."""
