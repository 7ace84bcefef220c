"""Per-module quantization recipes (Megatron-Core's ``megatron.core.quantization``).

:mod:`.quant_config` holds the recipe (matchers selecting modules by path, and the settings they name),
:mod:`.utils` Megatron-Core's helpers to load and resolve one, and :mod:`.layer_precision` what a recipe means for
this library's FP8 layers (``TransformerConfig.quant_recipe``, applied by ``fp8.convert_to_float8``).
"""
