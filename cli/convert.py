"""Convert models into and out of gigatron checkpoints (Hugging Face, Megatron-LM, DeepSpeed)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

DIRECTIONS = {
    "hf-to-gigatron": "a Hugging Face folder (config.json + safetensors) -> a gigatron "
                      "checkpoint",
    "gigatron-to-hf": "a gigatron checkpoint (any tp/pp/dp) -> a Hugging Face folder",
    "megatron-to-gigatron": "a Megatron-LM checkpoint (torch_dist, or the legacy torch "
                            "format; any tp/pp) -> a gigatron checkpoint",
    "deepspeed-to-gigatron": "a DeepSpeed checkpoint (save_checkpoint's folder, ZeRO 0-3, any "
                             "dp) of Megatron-DeepSpeed's pretrain_gpt.py -> a gigatron "
                             "checkpoint; of any model with --to safetensors -> "
                             "SAVE/model.safetensors (DeepSpeed's zero_to_fp32)",
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                     argparse.RawDescriptionHelpFormatter):
    """Defaults shown, the directions table kept as written."""


def build_parser() -> argparse.ArgumentParser:
    """`gigatron convert DIRECTION --load SRC --save DST`."""
    parser = argparse.ArgumentParser(
        description=__doc__ + "\nA gigatron checkpoint written here loads with "
        "`pretrain_gpt.py --load DST --finetune`\nat any tp/pp/dp, given the model flags "
        "this command prints.", formatter_class=_HelpFormatter,
        epilog="directions:\n" + "\n".join(f"  {k:22} {v}" for k, v in DIRECTIONS.items()))
    parser.add_argument("direction", choices=list(DIRECTIONS), help="what to convert")
    parser.add_argument("--load", required=True, metavar="SRC",
                        help="folder to read: the Hugging Face folder, or the checkpoint "
                             "folder a run saved to (--save; its tracker names the iteration)")
    parser.add_argument("--save", required=True, metavar="DST", help="folder to write")
    parser.add_argument("--family", choices=("auto", "gpt2", "llama", "mixtral", "qwen3",
                                             "qwen3_moe", "deepseek_v3", "deepseek_v2"),
                        default="auto",
                        help="gigatron-to-hf: the architecture to write (auto: deepseek_v3 / "
                             "deepseek_v2 with --multi-latent-attention, qwen3 / "
                             "qwen3_moe with --qk-layernorm, mixtral for other MoE models, "
                             "llama for other RoPE models, else gpt2)")
    for flag, what in (("--tokenizer-type", "the tokenizer type"),
                       ("--tokenizer-model", "the tokenizer model file"),
                       ("--vocab-file", "GPT-2's vocab.json"),
                       ("--merge-file", "GPT-2's merges.txt")):
        parser.add_argument(flag, default=None,
                            help=f"gigatron-to-hf: {what} (Megatron's flag), in place of the "
                                 f"one the checkpoint's flags name (default: theirs)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="megatron-/deepspeed-to-gigatron: the tokenizer's vocabulary "
                             "size, to drop "
                             "Megatron's padding rows beyond it (not given: the saved "
                             "--vocab-size, else every padded row is kept as a token)")
    parser.add_argument("--to", choices=("gigatron", "safetensors"), default="gigatron",
                        help="deepspeed-to-gigatron: a gigatron checkpoint of the GPT, or the "
                             "module's consolidated fp32 weights as safetensors")
    parser.add_argument("--tag", default=None,
                        help="deepspeed-to-gigatron: the checkpoint tag (default: the one "
                             "--load's `latest` file names)")
    parser.add_argument("--no-load-optim", action="store_true",
                        help="megatron-to-gigatron: leave a torch_dist checkpoint's optimizer "
                             "state out (Megatron's flag); the legacy torch format is always "
                             "converted without it; deepspeed-to-gigatron: the same for "
                             "DeepSpeed's ZeRO optimizer states")
    return parser


def _resume_flag(save: str) -> str:
    """'' when the written checkpoint holds an optimizer state (a run resumes from it), else
    ' --finetune' (weights only: the run starts at iteration 0)."""
    from gigatron.training.checkpoint import folders

    _, folder = folders.find_checkpoint(save)
    return "" if folder and folders.read_metadata(folder).get("has_optimizer") else \
        " --finetune"


def _run(args: argparse.Namespace) -> str:
    """Do the conversion; returns the line to print."""
    from gigatron.training.checkpoint import convert

    if args.direction == "gigatron-to-hf":
        tokenizer = {"tokenizer_type": args.tokenizer_type,
                     "tokenizer_model": args.tokenizer_model, "vocab_file": args.vocab_file,
                     "merge_file": args.merge_file}
        hf, tokenizer_line = convert.gigatron_to_hf(
            args.load, args.save, "" if args.family == "auto" else args.family, tokenizer)
        return f"wrote {args.save}: {hf['architectures'][0]}; {tokenizer_line}"
    if args.direction == "deepspeed-to-gigatron" and args.to == "safetensors":
        from gigatron.training.checkpoint.deepspeed import convert as deepspeed

        return f"wrote {deepspeed.deepspeed_to_safetensors(args.load, args.save, args.tag)}"
    if args.direction == "hf-to-gigatron":
        config = convert.hf_to_gigatron(args.load, args.save)
    elif args.direction == "deepspeed-to-gigatron":
        from gigatron.training.checkpoint.deepspeed import convert as deepspeed

        config = deepspeed.deepspeed_to_gigatron(args.load, args.save, args.vocab_size,
                                                 args.tag, not args.no_load_optim)
    else:
        config = convert.megatron_to_gigatron(args.load, args.save, args.vocab_size,
                                              not args.no_load_optim)
    flags = convert.model_flags(config)
    line = (f"wrote {args.save}: {config.num_layers} layers, hidden {config.hidden_size}, "
            f"vocab {config.vocab_size}\nmodel flags for pretrain_gpt.py --load "
            f"{args.save}{_resume_flag(args.save)}: {' '.join(flags)}")
    missing = convert.unexpressed_fields(
        config, convert.config_from_flags(convert.parse_model_flags(flags)))
    if missing:
        line += f"\nnote: no flag sets {', '.join(missing)}: pretrain_gpt.py builds the model " \
                f"without it"
    return line


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one conversion; a config or tensor that cannot be mapped is one error line."""
    from gigatron.models.hf_common import ConversionError

    args = build_parser().parse_args(argv)
    try:
        print(_run(args))
    except ConversionError as err:
        print(f"gigatron convert: {err}", file=sys.stderr)
        return 1
    return 0
