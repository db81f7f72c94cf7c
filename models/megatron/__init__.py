"""Megatron-LM checkpoints in: the legacy `torch` format (legacy.py, files.py), Megatron-Core's
`torch_dist` format (torch_dist.py; the distributed optimizer's gradient buckets: buckets.py;
mixtures of experts: moe.py), and the saved args -> TransformerConfig (args.py)."""
