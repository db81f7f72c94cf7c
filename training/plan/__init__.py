"""`gigatron plan`: per-stage memory and step time of a layout, before a GPU is rented.

training/observe/devices.py  the one table of device figures (also the training log's MFU peak)
parameters.py  each stage's parameters, read from GPTModel built on meta at the layout's tp
memory/      model state as ZeRO lays it out (exact), activations (Korthikanti et al.), per stage
cost.py      FLOPs, compute, tp/pp/dp communication, the bubble from the schedule simulator
gemm.py      a GEMM's time from its shape: tile and wave quantisation on the SMs, kernel gaps
experts.py   an MoE layer beyond a dense one: router/expert matmuls, the token exchange
context.py   context parallelism: the cp attention's tensors and traffic per comm type
allocator.py what the caching allocator reserves and the device holds beyond the tensors
planner.py   one layout's plan; search.py: every layout ranked; report.py: text and JSON
schedules.py the pipeline schedules a plan reads, built once per shape
sc21.py      the Megatron-LM SC21 table and the plan's prediction of it
published.py published H100/H200 runs (torchtitan, Megatron-Core, our H200) and the plan's
             predictions of them
docs/PLAN.md explains the model, its constants and their sources.
"""
