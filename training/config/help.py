"""pretrain_gpt.py's two helps: `--help`, the commonly used flags of each group, and
`--help-all`, every flag (docs/FLAGS.md has them all too, with their DeepSpeed keys).

The groups are the config table's concerns (`table.CONCERNS`), as Megatron's argument groups;
which flags the short help shows is presentation, not a setting: `COMMON` names them, and
tests/test_help.py checks that each is a flag of the table. Nothing here imports torch.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Any, List, NoReturn, Optional, Sequence

# the flags a first run reaches for, shown by --help (in the table's order within a group)
COMMON = frozenset("""
    --model --num-layers --hidden-size --ffn-hidden-size --num-attention-heads
    --num-query-groups --seq-length --max-position-embeddings --position-embedding-type
    --normalization --swiglu --untie-embeddings-and-output-weights --recompute-granularity
    --recompute-method --recompute-num-layers
    --num-experts --moe-ffn-hidden-size --moe-router-topk --moe-aux-loss-coeff
    --moe-grouped-gemm --moe-token-dispatcher-type
    --tensor-model-parallel-size --pipeline-model-parallel-size --context-parallel-size
    --cp-comm-type --expert-model-parallel-size --sequence-parallel
    --num-layers-per-virtual-pipeline-stage --pipeline-schedule
    --bf16 --fp16 --zero-stage --use-distributed-optimizer --optimizer-cpu-offload
    --fp8-format
    --optimizer --lr --min-lr --lr-decay-style --lr-decay-iters --lr-warmup-iters
    --weight-decay --clip-grad
    --data-path --split --mock-data --tokenizer-type --tokenizer-model --vocab-file
    --merge-file
    --train-iters --micro-batch-size --global-batch-size --seed --eval-interval --eval-iters
    --save --load --save-interval --finetune
    --log-interval --metrics-file --tensorboard-dir --wandb-project --timeline
    --profile
    --deepspeed-config
""".split())
FLAGS_DOC = "docs/FLAGS.md"
LEFT = 34  # columns of the flag before its summary
_VALUES = {"int": "N", "float": "X", "str": "S"}


def _is_common(action: argparse.Action) -> bool:
    return any(flag in COMMON for flag in action.option_strings)


def _groups(parser: argparse.ArgumentParser) -> List[Any]:
    """The parser's argument groups of table rows (not argparse's positionals/options)."""
    return [g for g in parser._action_groups
            if g._group_actions and g is not parser._optionals and
            g is not parser._positionals]


def _count(actions: Sequence[argparse.Action]) -> int:
    return sum(1 for a in actions if a.option_strings)


def _invocation(action: argparse.Action) -> str:
    """'--lr X', '--zero-stage {0,1,2,3}', '-h, --help': the flags and a short value."""
    flags = ", ".join(action.option_strings[:2] if action.option_strings[0].startswith("-h")
                      else action.option_strings[:1])
    if action.nargs == 0:
        return flags
    value = action.metavar or ""
    if not value or len(value) > 32:  # a long list of choices: --help-all shows it
        value = _VALUES.get(getattr(action.type, "__name__", ""), "VALUE")
    return f"{flags} {value}"


def _summary(action: argparse.Action) -> str:
    """The help text's first clause, and the default when there is one to show."""
    text = (action.help or "").split(" (default: ")[0]
    for stop in ("; ", " ("):
        text = text.split(stop)[0]
    if action.default not in (None, False, argparse.SUPPRESS):
        text += f" (default {action.default})"
    return text


def _flag_lines(actions: Sequence[argparse.Action], width: int) -> List[str]:
    """One line per flag: its invocation, then its summary (cut to `width` columns)."""
    lines = []
    for action in actions:
        left = _invocation(action)
        line = f"  {left:<{LEFT}} {_summary(action)}" if len(left) <= LEFT else \
            f"  {left}  {_summary(action)}"
        lines.append(line if len(line) <= width else line[:width - 3] + "...")
    return lines


def short_help(parser: argparse.ArgumentParser, width: int = 100) -> str:
    """--help: usage, what the program does, then per group its common flags (one line
    each) and how many more there are."""
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, [], [])
    formatter.add_text(parser.description)
    groups = _groups(parser)
    total = sum(_count(g._group_actions) for g in groups)
    formatter.add_text(f"The commonly used flags of each group, one line each. All {total} "
                       f"flags with their whole help: {parser.prog} --help-all, or "
                       f"{FLAGS_DOC} (with defaults and DeepSpeed keys).")
    lines, rest = [formatter.format_help().rstrip("\n")], []
    for group in groups:
        common = [a for a in group._group_actions if _is_common(a)]
        count = _count(group._group_actions)
        if not common:
            rest.append(f"{group.title} ({count})")
            continue
        lines += ["", f"{group.title}: {_count(common)} of {count}"] + \
            _flag_lines(common, width)
    lines += [""] + textwrap.wrap(f"Only in --help-all (flags): {'; '.join(rest)}.",
                                  width) + ["", "help:"] + _flag_lines([a for a in parser._optionals._group_actions
                                      if isinstance(a, ShortHelp)], width)
    return "\n".join(lines) + "\n"


class ShortHelp(argparse.Action):
    """-h/--help: the short help."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: Any = argparse.SUPPRESS, help: Optional[str] = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: Optional[str] = None) -> NoReturn:
        sys.stdout.write(short_help(parser))
        parser.exit()


class FullHelp(ShortHelp):
    """--help-all: every flag, by group."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: Optional[str] = None) -> NoReturn:
        parser.print_help()
        parser.exit()


def add_help_flags(parser: argparse.ArgumentParser) -> None:
    """-h/--help (the common flags) and --help-all (every flag) on a parser made with
    add_help=False; the usage line stays one line instead of listing every flag."""
    parser.usage = "%(prog)s [FLAGS ...]"
    parser.add_argument("-h", "--help", action=ShortHelp,
                        help="the commonly used flags of each group, and exit")
    parser.add_argument("--help-all", action=FullHelp, dest="help",
                        help=f"every flag of every group, and exit (also in {FLAGS_DOC})")
