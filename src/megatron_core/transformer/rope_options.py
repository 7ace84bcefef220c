"""The per-layer rotary and query/key-norm options of ``TransformerConfig`` (Megatron-Core 0.19's fields).

- ``qk_l2_norm``: every self-attention layer normalises each query and key head to unit root-mean-square
  (``transformer.torch_norm.L2Norm``, no weights, ``layernorm_epsilon``) before RoPE, as Llama 4 does.
- ``no_rope_freq``: layers that attend without RoPE. An int ``N`` means every ``N``-th layer (layers ``N``,
  ``2N``, ...; ``num_layers`` must divide by ``N``) and is turned into the per-layer list in ``__post_init__``,
  as Megatron-Core does; a list holds one flag per layer, 1 = no RoPE. ``0`` / ``None`` / ``[]``: RoPE everywhere.
  The flag is looked up by the layer's **global** 1-based number, so pipeline stages agree.
- ``mrope_section``: the temporal / height / width sections of multimodal RoPE (``GPTModel`` with
  ``position_embedding_type="mrope"``); checked against the rotary width when the model is built.

:func:`check_rope_options` validates them (each error names the field, its value and the rule);
:func:`layer_skips_rope` is the lookup attention layers use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_mrope_section", "check_rope_options", "layer_skips_rope"]


def check_rope_options(cfg: Any) -> None:
    """Validate ``qk_l2_norm``, ``no_rope_freq`` (an int becomes the per-layer 0/1 list) and ``mrope_section``."""
    if not isinstance(cfg.qk_l2_norm, bool):
        raise ValueError(f"qk_l2_norm ({cfg.qk_l2_norm!r}) must be a bool")
    if cfg.qk_l2_norm and cfg.multi_latent_attention:
        raise ValueError("qk_l2_norm=True is not supported with multi_latent_attention=True (as in Megatron-Core): "
                         "MLA normalises its latents with qk_layernorm instead")
    _expand_no_rope_freq(cfg)
    if cfg.mrope_section is not None:
        check_mrope_section(cfg.mrope_section)


def _expand_no_rope_freq(cfg: Any) -> None:
    freq = cfg.no_rope_freq
    if isinstance(freq, bool) or not isinstance(freq, (int, list, tuple, type(None))):
        raise ValueError(f"no_rope_freq ({freq!r}) must be None, a positive int N (every N-th layer without RoPE) or a "
                         "list of one 0/1 flag per layer (1 = no RoPE)")
    if not freq:  # None, 0 or []: every layer keeps RoPE (Megatron-Core's truth test)
        return
    if isinstance(freq, int):
        if freq < 0 or cfg.num_layers % freq != 0:
            raise ValueError(f"no_rope_freq ({freq}) must be a positive divisor of num_layers ({cfg.num_layers}): "
                             "every no_rope_freq-th layer attends without RoPE")
        cfg.no_rope_freq = ([0] * (freq - 1) + [1]) * (cfg.num_layers // freq)
    else:
        flags = list(freq)
        if len(flags) != cfg.num_layers or any(isinstance(x, bool) or x not in (0, 1) for x in flags):
            raise ValueError(f"no_rope_freq ({flags}) as a list must hold one 0 (RoPE) or 1 (no RoPE) per layer "
                             f"(num_layers={cfg.num_layers}, got {len(flags)} entries)")
        cfg.no_rope_freq = flags
    if cfg.multi_latent_attention:
        raise ValueError(f"no_rope_freq ({cfg.no_rope_freq}) cannot be used with multi_latent_attention=True: MLA "
                         "rotates its own positional channels in every layer")
    if cfg.flash_decode:
        raise ValueError(f"no_rope_freq ({cfg.no_rope_freq}) cannot be used with flash_decode=True (as in "
                         "Megatron-Core)")


def check_mrope_section(section: Any, rotary_half: int | None = None) -> None:
    """``mrope_section`` is a list of non-negative ints (summing to ``rotary_half`` = rotary width / 2 when given)."""
    if (not isinstance(section, (list, tuple)) or not section
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in section)):
        raise ValueError(f"mrope_section ({section!r}) must be a non-empty list of non-negative ints (the rotary "
                         "frequencies given to the temporal, height and width positions)")
    if rotary_half is not None and sum(section) != rotary_half:
        raise ValueError(f"mrope_section ({list(section)}) must sum to half the rotary width, kv_channels * "
                         f"rotary_percent / 2 = {rotary_half} (got {sum(section)})")


def layer_skips_rope(config: Any, layer_number: int) -> bool:
    """Whether global layer ``layer_number`` (1-based) attends without RoPE (``config.no_rope_freq``'s flag)."""
    flags = getattr(config, "no_rope_freq", None)
    if not flags or isinstance(flags, int) or not 1 <= layer_number <= len(flags):
        return False
    return bool(flags[layer_number - 1])
