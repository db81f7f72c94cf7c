"""Configuration: one typed table of settings, Megatron's flags and DeepSpeed's JSON read into it, validation."""
