"""What a run shows: logging sinks, FLOP arithmetic, timers, profiling, plots, the device table."""
