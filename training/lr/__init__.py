"""Learning-rate schedules: Megatron's (pretrain_gpt.py) and DeepSpeed's schedulers (gigatron.initialize)."""
