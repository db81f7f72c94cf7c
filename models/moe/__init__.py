"""Mixture of experts (issue 27, in progress): Megatron-Core's router and the routed experts."""
