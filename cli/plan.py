"""Predict memory per pipeline stage and step time of a layout before renting the GPUs."""
from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from gigatron.data.tokenizer import Tokenizer
    from gigatron.training.config.run_config import RunConfig

PROG = "gigatron plan"


def plan_parser() -> argparse.ArgumentParser:
    """The plan's own flags; every other flag is pretrain_gpt.py's, validated as the run
    validates them."""
    from gigatron.training.observe.devices import PLAN_KEYS

    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Predict per-stage memory and the step time of a pretrain_gpt.py run "
                    "on NUM_GPUS devices of one type, from the run's own flags (every flag "
                    "of `gigatron pretrain --help` is accepted and validated as the run "
                    "does). docs/PLAN.md: the model, its constants and sources.",
        epilog="example: gigatron plan --gpu h100-sxm --num-gpus 512 --model gpt3-175b "
               "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 "
               "--micro-batch-size 1 --global-batch-size 1536 --bf16 (settings only "
               "training reads, e.g. --lr, --train-iters, data, need not be given)")
    parser.add_argument("--gpu", default="h100-sxm",
                        help=f"device type, a row of the hardware table: "
                             f"{', '.join(PLAN_KEYS)}")
    parser.add_argument("--num-gpus", type=int, default=None,
                        help="world size (None: tensor x pipeline parallel size, dp 1)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="devices per node (None: the table's, 8 for GPUs)")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="override the device memory (GiB)")
    parser.add_argument("--hbm-bandwidth", type=float, default=None,
                        help="override the memory bandwidth (GB/s)")
    parser.add_argument("--intra-node-bandwidth", type=float, default=None,
                        help="override the per-device bandwidth inside a node (GB/s)")
    parser.add_argument("--inter-node-bandwidth", type=float, default=None,
                        help="override the per-device network bandwidth (GB/s)")
    parser.add_argument("--assume-overlap", action="append", default=[],
                        choices=("tp-comm", "param-gather"),
                        help="model an overlap as if its flag were given (tp-comm: "
                             "--tp-comm-overlap; param-gather: --overlap-param-gather); the "
                             "plan reads those flags themselves, so this is only for a layout "
                             "whose flags are not given, e.g. to compare with a Megatron-Core "
                             "run; repeat for both")
    parser.add_argument("--search", action="store_true",
                        help="rank every valid layout (tp, pp, dp, ZeRO stage, recompute, "
                             "micro-batch) for this model and GPU count")
    parser.add_argument("--top", type=int, default=10,
                        help="with --search: how many ranked layouts the text shows")
    parser.add_argument("--verbose", action="store_true",
                        help="with --search: list every refused layout (default: one line "
                             "per reason, with its count and an example)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    return parser


def _hardware(opts: argparse.Namespace, peak_tflops: Optional[float]):
    from gigatron.training.observe.devices import hardware, with_overrides

    return with_overrides(hardware(opts.gpu), {
        "peak_tflops": peak_tflops, "memory_gib": opts.gpu_memory_gib,
        "hbm_gbps": opts.hbm_bandwidth, "intra_node_gbps": opts.intra_node_bandwidth,
        "inter_node_gbps": opts.inter_node_bandwidth, "gpus_per_node": opts.gpus_per_node})


def _check_plan_options(opts: argparse.Namespace) -> None:
    from gigatron.training.config.validation import ConfigError

    problems = []
    for flag, value in (("--num-gpus", opts.num_gpus), ("--gpus-per-node", opts.gpus_per_node),
                        ("--gpu-memory-gib", opts.gpu_memory_gib),
                        ("--hbm-bandwidth", opts.hbm_bandwidth),
                        ("--intra-node-bandwidth", opts.intra_node_bandwidth),
                        ("--inter-node-bandwidth", opts.inter_node_bandwidth),
                        ("--top", opts.top)):
        if value is not None and value <= 0:
            problems.append(f"{flag} must be > 0, got {value}")
    if problems:
        raise ConfigError(problems)


def configure(argv: Sequence[str]) -> Tuple[argparse.Namespace, argparse.Namespace,
                                             "RunConfig", Optional["Tokenizer"], int]:
    """(plan options, pretrain flags, validated RunConfig, its tokenizer, world size):
    pretrain_gpt's own parse and validation, with the world size from --num-gpus."""
    from gigatron.training.config.arguments import build_run, parse_flags, with_other_problems
    from gigatron.training.config.table import ParseProblems, build_settings
    from gigatron.training.plan.planner import fill_plan_flags

    opts, rest = plan_parser().parse_known_args(list(argv))
    _check_plan_options(opts)
    try:
        flags = parse_flags(rest, PROG)
    except ParseProblems as err:
        raise with_other_problems(err, opts.num_gpus or 1) from None
    fill_plan_flags(flags, opts.search)
    settings = build_settings(flags)
    world = opts.num_gpus or settings.parallel.tp * settings.parallel.pp
    run, tokenizer = build_run(settings, world)
    return opts, flags, run, tokenizer, world


PROGRESS_EVERY_S = 2.0
"""Off a terminal, a long search prints a progress line this often (on one, it is redrawn
after every layout)."""


def _search_progress() -> Callable[[int, int], None]:
    """`search`'s progress(done, total) on stderr: redrawn in place on a terminal, else a
    line every PROGRESS_EVERY_S once the search has run that long."""
    from gigatron.training.observe.logger import LoopProgress

    tty = sys.stderr.isatty()
    shown: List[LoopProgress] = []

    def update(done: int, total: int) -> None:
        if not shown:
            shown.append(LoopProgress("gigatron plan --search", total,
                                      lambda line: print(line, file=sys.stderr, flush=True),
                                      sys.stderr if tty else None, PROGRESS_EVERY_S,
                                      unit="layouts"))
        shown[0].update(done)
        if tty and done == total:
            print(file=sys.stderr)

    return update


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`gigatron plan [--gpu KEY] [--num-gpus N] [--search] [--json] PRETRAIN_FLAGS`."""
    from gigatron.training.plan import report
    from gigatron.training.plan.planner import plan_run
    from gigatron.training.plan.search import search

    args: List[str] = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        plan_parser().print_help()
        return 0
    try:
        opts, flags, run, tokenizer, world = configure(args)
        hw = _hardware(opts, run.logging.peak_tflops)
        if opts.search:
            assert run.train.global_batch_size is not None
            ranked, refused = search(flags, world, run.train.global_batch_size, tokenizer, hw,
                                     frozenset(opts.assume_overlap), _search_progress())
            text = json.dumps(report.search_dict(ranked, refused), indent=1) if opts.json \
                else report.describe_search(ranked, refused, opts.top, opts.verbose)
        else:
            plan = plan_run(run, hw, frozenset(opts.assume_overlap))
            text = json.dumps(report.plan_dict(plan), indent=1) if opts.json \
                else report.describe(plan)
    except ValueError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0
