"""Convert weights between Hugging Face (GPT-2, Llama) and gigatron folders."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

DIRECTIONS = ("hf-to-gigatron", "gigatron-to-hf")


def build_parser() -> argparse.ArgumentParser:
    """`gigatron convert hf-to-gigatron --hf DIR --out DIR` or
    `gigatron convert gigatron-to-hf --checkpoint DIR --out DIR`."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("direction", choices=DIRECTIONS,
                        help="hf-to-gigatron: a Hugging Face folder (config.json + "
                             "safetensors) -> a gigatron folder (tp=1, pp=1); gigatron-to-hf: "
                             "the reverse")
    parser.add_argument("--hf", default=None, help="Hugging Face folder to read "
                        "(hf-to-gigatron)")
    parser.add_argument("--checkpoint", default=None, help="gigatron folder to read: "
                        "config.json + model.safetensors (gigatron-to-hf)")
    parser.add_argument("--out", required=True, help="folder to write")
    parser.add_argument("--family", choices=("auto", "gpt2", "llama"), default="auto",
                        help="Hugging Face architecture to write (gigatron-to-hf); auto: "
                             "llama for RoPE models, else gpt2")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one conversion; a config or tensor that cannot be mapped is one error line."""
    from gigatron.models.hf_convert import ConversionError, gigatron_to_hf, hf_to_gigatron

    parser = build_parser()
    args = parser.parse_args(argv)
    source = "--hf" if args.direction == "hf-to-gigatron" else "--checkpoint"
    if getattr(args, source[2:]) is None:
        parser.error(f"{args.direction} needs {source} DIR")
    try:
        if args.direction == "hf-to-gigatron":
            config = hf_to_gigatron(args.hf, args.out)
            print(f"wrote {args.out}: {config.num_layers} layers, hidden {config.hidden_size}, "
                  f"vocab {config.vocab_size} (padded {config.padded_vocab_size(1)})")
        else:
            hf_config = gigatron_to_hf(args.checkpoint, args.out,
                                       "" if args.family == "auto" else args.family)
            print(f"wrote {args.out}: {hf_config['architectures'][0]}")
    except ConversionError as err:
        print(f"gigatron convert: {err}", file=sys.stderr)
        return 1
    return 0
