"""State-space-model building blocks (Megatron-Core's ``ssm``): the Mamba-2 mixer and layer, the MLP-only
layer, hybrid layer patterns and the hybrid layer stack."""
