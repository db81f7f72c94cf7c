"""Multi-latent attention (DeepSeek-V2/V3) and YaRN RoPE, a kind of the one attention module."""
