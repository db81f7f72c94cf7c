"""The training loop, arguments, optimizer wrapper, lr schedules, checkpoints, metrics."""
