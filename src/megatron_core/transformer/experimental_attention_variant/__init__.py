"""Megatron-Core's experimental attention variants: DeepSeek sparse attention (:mod:`.dsa`) and absorbed
multi-latent attention (:mod:`.absorbed_mla`).

DSA is MLA whose core attention attends only to the keys a small indexer picks per query (DeepSeek-V3.2);
``experimental_attention_variant="dsa"`` builds it, on the absorbed MLA layer, through
:func:`~megatron_core.models.gpt.experimental_attention_variant_module_specs.get_dsa_module_spec_for_backend`.
"""
