"""Checkpoints: the orchestrator (what a rank saves and restores), folders and trackers, integrity, converters."""
