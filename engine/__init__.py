"""gigatron.engine: `gigatron.initialize` for any nn.Module (DeepSpeed's API), built on
parallel/ (ZeRO, groups) and training/ (config reader, checkpoints) -- never a copy of them."""
