"""Evaluate a checkpoint's loss and perplexity on a dataset split, in any tp/pp/dp layout."""
from __future__ import annotations

import argparse
from typing import Optional, Sequence, Tuple, cast

PROG = "gigatron evaluate"
SPLITS = ("train", "valid", "test")


def build_parser() -> argparse.ArgumentParser:
    """The command's own flags; every other flag is Megatron's and overrides the
    checkpoint's (--data-path, --split, --eval-iters, batch sizes, the layout)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Megatron flags (docs/FLAGS.md) override the checkpoint's: the data (--data-path "
               "with --split, or --train/valid/test-data-path), --eval-iters (batches of "
               "--global-batch-size samples), --micro-batch-size, --tensor-model-parallel-size "
               "and --pipeline-model-parallel-size (dp: the rest of the world size). Without "
               "them, the training run's data, split and sizes are used. --ckpt-step N "
               "evaluates iteration N instead of the latest. Samples (the split built as "
               "training builds it): valid, those of the run's validation at the "
               "checkpoint's iteration (the next validation's at an iteration without one), "
               "so the loss is the one the run logged (to rounding in another layout); "
               "test, the first --eval-iters batches, as the run's final test; train, the "
               "first training batches.")
    parser.add_argument("--load", required=True, help="checkpoint folder (a run's --save)")
    parser.add_argument("--eval-split", choices=SPLITS, default="valid",
                        help="which split of the data to evaluate (Megatron's --split "
                             "shares, or the --<split>-data-path)")
    return parser


def _run(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from gigatron.parallel.world import init_distributed, read_launch_env
    from gigatron.training.config.arguments import build_run
    from gigatron.training.run.from_checkpoint import (inference_settings,
                                                       load_model_and_progress)

    launch = read_launch_env()
    settings = inference_settings(rest, args.load, PROG, {})
    run, tokenizer = build_run(settings, launch.world_size)
    launch, device = init_distributed(run.parallel.distributed_timeout_minutes)
    groups, chunks, progress = load_model_and_progress(run, launch.rank, device)
    loss = _evaluate(run, tokenizer, groups, chunks, device, args.eval_split, progress)
    if loss is None:
        raise ValueError(f"the {args.eval_split} split has no data: give it a --split share, "
                         f"a --{args.eval_split}-data-path, or --eval-iters > 0")
    return 0 if loss == loss else 1  # a NaN loss fails the command


def _window(run, split: int, progress, size: int) -> Tuple[int, str]:
    """(first sample, why those): the samples training evaluated at the checkpoint."""
    from gigatron.training.run.loop import logged_validation_start

    samples = run.train.eval_iters * run.train.global_batch_size
    if split != 1:
        return 0, "the run's test evaluation" if split == 2 else "the first training samples"
    if progress is None:
        return 0, "the first ones: the checkpoint records no training progress"
    start = logged_validation_start(progress, run.train)
    ran = start != progress.consumed_valid_samples
    why = f"the run's validation at iteration {progress.iteration}" if ran else \
        f"where the run's next validation after iteration {progress.iteration} starts"
    if start + samples > size:  # other data or sizes given on the command line
        return max(size - samples, 0), "the last ones: fewer than the run's validation used"
    return start, why


def _evaluate(run, tokenizer, groups, chunks, device, split_name: str,
              progress) -> Optional[float]:
    """The split's mean lm loss over --eval-iters global batches, through the trainer's
    `evaluate` (same schedule, micro-batches and loss reduction as validation in training)
    on the samples training evaluated: the split built as training builds it (Megatron's
    sample counts), from where the run's validation at the checkpoint's iteration started
    (test: the start, as the run's final test). The console line and --metrics-file record
    carry loss and perplexity."""
    from dataclasses import replace

    from gigatron.data.builder import build_train_valid_test_datasets
    from gigatron.parallel.pipeline.interfaces import GradSync
    from gigatron.parallel.zero import ZeroOptimizer
    from gigatron.training.run import builders
    from gigatron.training.checkpoint import folders
    from gigatron.training.observe.logger import MetricsLogger
    from gigatron.training.run.loop import Session, evaluate
    from gigatron.training.observe.timers import Timers

    split = SPLITS.index(split_name)
    iterations, batch = run.train.eval_iters, run.train.global_batch_size
    counts = [0, 0, 0]
    counts[split] = builders.sample_counts(run)[split]
    data = replace(run.data, eod=tokenizer.eod, vocab_size=tokenizer.vocab_size)
    datasets = build_train_valid_test_datasets(data, counts)
    pipeline = builders.build_pipeline(run, groups, chunks, None, device)
    log = run.logging
    logger = MetricsLogger(groups.rank == 0, 0, log.metrics_file, None, log.progress)
    # evaluation never steps or reduces gradients: no optimizer is built for it
    session = Session(run, groups, device, chunks, cast(ZeroOptimizer, None),
                      cast(GradSync, None), pipeline, datasets, logger, Timers(), 0.0, None)
    dataset, samples = datasets[split], iterations * batch
    size = len(dataset) if dataset is not None else 0
    first, why = _window(run, split, progress, size)
    loss = evaluate(session, split, first, iterations, f"{split_name} evaluation")
    if loss is not None:
        iteration = progress.iteration if progress is not None else folders.find_checkpoint(
            run.checkpoint.load or "", run.checkpoint.ckpt_step)[0]
        logger.print(f"{split_name} split: {samples} samples ({iterations} batches of "
                     f"{batch}), {samples * run.model.seq_length} tokens: samples {first} to "
                     f"{first + samples - 1} of {size}, {why}")
        logger.evaluation({"split": split_name, "iteration": iteration, "lm loss": loss,
                           "samples": samples, "first_sample": first})
    logger.close()
    return loss


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`gigatron evaluate --load CKPT [--eval-split valid] [Megatron flags]`."""
    from gigatron.cli.generate import run_command

    args, rest = build_parser().parse_known_args(None if argv is None else list(argv))
    return run_command(PROG, lambda: _run(args, rest))
