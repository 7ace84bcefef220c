"""``megatron.training.utils`` of the stand-in: only what Megatron-LM's ``tests/unit_tests/test_utils.py`` imports."""
