"""Megatron-LM's flags: the catalog of names, and the rules that turn model, FP8 and schedule flags into settings."""
