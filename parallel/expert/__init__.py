"""Expert parallelism (issue 27): the expert view of the ranks and token dispatch."""
