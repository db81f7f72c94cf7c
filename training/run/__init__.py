"""A training run: built from the config, the loop, and the features of a step."""
