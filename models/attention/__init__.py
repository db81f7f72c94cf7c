"""Attention pieces every attention kind shares: the rotary tables and the attention core."""
