"""Horovod's API (`gigatron.horovod`): collectives, compression, DistributedOptimizer."""
