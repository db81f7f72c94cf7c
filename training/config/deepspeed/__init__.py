"""DeepSpeed's JSON config: its keys, "auto" values, optimizer and scheduler sections, read into typed settings."""
