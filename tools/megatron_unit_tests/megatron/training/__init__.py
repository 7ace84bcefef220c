"""A stand-in for the parts of Megatron-LM's ``megatron.training`` that its unit tests import (CPU harness).

Megatron-LM's ``megatron/training`` needs Python 3.12 and many modules outside Megatron-Core, so the
harness provides only what the unit tests of ``tests/unit_tests`` touch, built on ``megatron_core``:
``arguments.parse_args``, ``training.get_args``/``get_model``, ``checkpointing`` (its entry points
skip the test: the training loop's checkpoint format is not part of Megatron-Core).
"""
