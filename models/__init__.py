"""What is trained: transformer config, GPT models, the model zoo."""
