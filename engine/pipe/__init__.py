"""DeepSpeed's `deepspeed.pipe`: PipelineModule, layer specs, partition methods and the pipeline engine."""
