"""HyScale kernels (installed as ``hyscale_kernels``): tensors in, tensors out, no Megatron.

One sub-package per op, each with ``reference.py`` (plain PyTorch, the executable spec), the
Triton kernels, and one public function. ``hyscale_megatron.ops`` re-exports the public ops.
"""
