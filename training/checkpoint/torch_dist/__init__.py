"""The layout-free format (Megatron's torch_dist): torch.distributed.checkpoint with global tensor metadata."""
