"""Fused element-wise kernels (Megatron-Core's ``megatron.core.fusions``), written in plain PyTorch.

Each function has a hand-written backward (an ``autograd.Function``) like Megatron's, so the saved
activations are the inputs only; the ``jit_fuser`` decorator ``torch.compile``s them on accelerators.
"""
