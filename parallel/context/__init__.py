"""Context parallelism: the sequence split over cp ranks (split.py: Megatron-Core's causal
load balance), attention of the local queries over every rank's keys/values by ring
(ring.py), all-gather (all_gather.py), all-to-all (ulysses.py) or all-to-all within and ring
across sub-groups (hierarchical.py), chosen in attention.py, each block through torch's fused
kernels merged by log-sum-exp (kernels.py)."""
