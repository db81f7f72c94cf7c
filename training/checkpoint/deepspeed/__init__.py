"""Reading checkpoints that DeepSpeed wrote (`engine.save_checkpoint`, `ds_to_universal`) into
whole tensors under the module's parameter names: the engine continues them
(engine/deepspeed/ds_format.py) and `gigatron convert deepspeed-to-gigatron` converts them."""
