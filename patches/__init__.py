"""Overlays onto megatron-core (installed as ``hyscale_patches``). Knows Megatron, not our kernels."""
