"""How the work is split across ranks: topology, collectives, tensor/pipeline/data parallelism."""
