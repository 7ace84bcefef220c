"""Reliability checks: hang bound, desync diagnosis and run-to-run determinism."""
