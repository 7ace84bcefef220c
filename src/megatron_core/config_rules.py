"""Value rules shared by the configs, kept as tables: each failure names the field, the value and the rule.

Python's comparisons let ``nan`` and ``True`` through most range checks (``nan < 0`` is false,
``True`` is an ``int``), so every rule here rejects booleans where numbers are expected and
non-finite floats explicitly. The checks are plain ``if``/``raise`` (never ``assert``), so they
hold under ``python -O`` too.
"""

from __future__ import annotations

import math
from typing import Any

# TransformerConfig: (field, allowed None, rule)
TRANSFORMER_RULES: tuple[tuple[str, bool, str], ...] = (
    ("num_layers", False, "positive int"),
    ("hidden_size", False, "positive int"),
    ("num_attention_heads", False, "positive int"),
    ("ffn_hidden_size", True, "positive int"),
    ("kv_channels", True, "positive int"),
    ("num_query_groups", True, "positive int"),
    ("init_method_std", False, "positive float"),
    ("embedding_init_method_std", True, "positive float"),
    ("layernorm_epsilon", False, "positive float"),
    ("hidden_dropout", False, "probability"),
    ("attention_dropout", False, "probability"),
)

# OptimizerConfig: every float field must be finite; these must also be >= 0 or > 0.
OPTIMIZER_RULES: tuple[tuple[str, bool, str], ...] = (
    ("lr", True, "non-negative float"),
    ("min_lr", True, "non-negative float"),
    ("decoupled_lr", True, "non-negative float"),
    ("decoupled_min_lr", True, "non-negative float"),
    ("weight_decay", False, "non-negative float"),
    ("clip_grad", False, "non-negative float"),
    ("adam_beta1", False, "probability"),
    ("adam_beta2", False, "probability"),
    ("adam_eps", False, "positive float"),
    ("sgd_momentum", False, "non-negative float"),
    ("loss_scale", True, "positive float"),
    ("initial_loss_scale", False, "positive float"),
    ("min_loss_scale", False, "positive float"),
    ("loss_scale_window", False, "positive float"),
    ("muon_momentum", False, "probability"),
    ("muon_num_ns_steps", False, "positive int"),
    ("muon_extra_scale_factor", False, "positive float"),
    ("lion_beta1", False, "probability"),
    ("lion_beta2", False, "probability"),
    ("adaptive_muon_beta2", False, "probability"),
    ("adaptive_muon_eps", False, "positive float"),
)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_value(owner: str, name: str, value: Any, rule: str, allow_none: bool = False) -> None:
    """Raise ``ValueError`` naming ``owner.name``, ``value`` and ``rule`` unless the value obeys it."""
    if value is None and allow_none:
        return
    if rule == "positive int":
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    elif not _is_number(value) or not math.isfinite(value):
        ok = False
    elif rule == "positive float":
        ok = value > 0
    elif rule == "non-negative float":
        ok = value >= 0
    elif rule == "probability":
        ok = 0 <= value < 1
    else:
        raise ValueError(f"unknown rule {rule!r}")
    if not ok:
        wanted = {"probability": "a finite number in [0, 1)"}.get(rule, f"a finite {rule}" if "float" in rule
                                                                 else f"a {rule} (not a bool)")
        none = " or None" if allow_none else ""
        raise ValueError(f"{owner}: {name} ({value!r}) must be {wanted}{none}")


def apply_rules(owner: str, config: Any, rules: tuple[tuple[str, bool, str], ...]) -> None:
    """Check every ``(field, allow_none, rule)`` row present on ``config``."""
    for name, allow_none, rule in rules:
        if hasattr(config, name):
            check_value(owner, name, getattr(config, name), rule, allow_none)


def check_timeout_minutes(name: str, value: Any) -> None:
    """A process-group timeout must be a positive, finite number of minutes."""
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} ({value!r}) must be a positive number of minutes")


def check_model_sizes(vocab_size: Any, max_sequence_length: Any) -> None:
    """A language model's vocabulary size and maximum sequence length are positive ints."""
    check_value("GPTModel", "vocab_size", vocab_size, "positive int")
    check_value("GPTModel", "max_sequence_length", max_sequence_length, "positive int")


def check_sequence_fits(seq_len: int, max_sequence_length: int) -> None:
    """Inputs longer than ``max_sequence_length`` are rejected (also with RoPE, where nothing else would)."""
    if seq_len > max_sequence_length:
        raise ValueError(f"input sequence length {seq_len} exceeds the model's max_sequence_length "
                         f"{max_sequence_length}")
