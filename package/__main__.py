"""`python -m gigatron ...`: the same console as the `gigatron` command."""
import sys

from gigatron.cli import main

sys.exit(main())
