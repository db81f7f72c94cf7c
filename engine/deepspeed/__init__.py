"""DeepSpeed's engine API: `gigatron.initialize`, the engine, its checkpoints and data loader."""
