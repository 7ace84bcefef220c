"""Optional backends (Megatron-Core's ``megatron.core.extensions``).

:mod:`.transformer_engine` holds Megatron's Transformer Engine wrapper names; importing it never
needs Transformer Engine, using one of its layers does (``pip install 'megatron-core-lite[te]'``).
"""
