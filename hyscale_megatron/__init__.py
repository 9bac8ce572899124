"""HyScale: a Megatron-Core plugin for long-context DSA training."""
