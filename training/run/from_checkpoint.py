"""A run rebuilt from its checkpoint, for inference: `gigatron generate` and `gigatron evaluate`.

The checkpoint's metadata.json records the training run's flags. They rebuild the model,
tokenizer and data, so `--load DIR` needs no model flags; the command's own settings come
next (say, no metrics file of the training run is appended to), and the Megatron flags given
on the command line last (a moved tokenizer file, another data split, another layout): the
settings `arguments.build_run` validates as pretraining's. The model is then built per rank
as pretraining builds it and the weights loaded through `orchestrator.load_model_weights`
(from the tracked iteration, or --ckpt-step's).
"""
from __future__ import annotations

import argparse
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

if TYPE_CHECKING:
    from gigatron.parallel.topology import ProcessGroups
    from gigatron.training.checkpoint.orchestrator import TrainProgress
    from gigatron.training.config.run_config import RunConfig
    from gigatron.training.config.table import Settings

# flags of the training run that an inference command must not reuse: its outputs
NOT_INHERITED: Dict[str, Any] = {
    "save": None, "metrics_file": None, "tensorboard_dir": None, "wandb_project": None,
    "timeline": None, "deepspeed_config": None, "exit_signal_handler": False, "finetune": False,
    "ckpt_step": None,  # the step a resumed run loaded is not the one to load now
    "non_persistent_ckpt_type": None,  # evaluate and generate load the persistent checkpoint
}
# the layout of the training run: a layout-free (torch_dist) checkpoint loads into any, so
# an inference command starts from one rank's layout (the flags of its command line choose
# another); a per-rank (torch) checkpoint keeps the layout that wrote it
LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
          "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
          "decoder_first_pipeline_num_layers",
          "decoder_last_pipeline_num_layers", "sequence_parallel", "context_parallel_size")
# training settings a converted checkpoint (Hugging Face, Megatron-LM) does not record: the
# run config needs them, inference never uses them (micro-batch: evaluate's default)
TRAINING_ONLY = {"micro_batch_size": 1, "lr": 1.0e-4, "train_iters": 1}
DATA_SOURCES = ("data_path", "train_data_path", "valid_data_path", "test_data_path",
                "mock_data")


def fill_training_only(flags: Dict[str, Any], skip: Sequence[str] = ()) -> None:
    """Give each `TRAINING_ONLY` setting `flags` leave unset its stand-in value (except
    those in `skip`): the one rule for commands that build a run config but never train
    (`gigatron generate`/`evaluate` of a converted checkpoint, `gigatron plan`)."""
    for name, value in TRAINING_ONLY.items():
        if name in skip or flags.get(name) is not None or \
                (name == "train_iters" and flags.get("train_samples")):
            continue
        flags[name] = value


def saved_flags(load: str, step: Optional[int] = None) -> Tuple[str, Dict[str, Any]]:
    """(the iteration folder, the flags recorded in its metadata.json) of the checkpoint
    `load` tracks (of iteration `step`: --ckpt-step): the default layout in place of the
    saved one when the checkpoint is layout-free, the tokenizer flags naming the copy of
    the tokenizer's files it holds (training/checkpoint/recorded_paths.py)."""
    from gigatron.training.checkpoint import folders as files
    from gigatron.training.checkpoint.recorded_paths import stored_tokenizer_flags
    from gigatron.training.config.arguments import make_parser
    from gigatron.training.checkpoint.torch_dist.save_load import checkpoint_format

    _, folder = files.find_checkpoint(load, step)
    if folder is None:
        raise ValueError(f"--load {load}: no checkpoint there ({files.TRACKER} missing): "
                         f"give the --save folder of a training run")
    metadata = files.read_metadata(folder)
    flags = metadata.get("flags")
    if not isinstance(flags, dict):
        raise ValueError(f"{folder}/{files.METADATA} records no flags: it was not written by "
                         f"gigatron pretrain")
    flags = {**flags, **stored_tokenizer_flags(folder, metadata)}
    if checkpoint_format(metadata) == "torch_dist":
        parser = make_parser()
        flags = {**flags, **{dest: parser.get_default(dest) for dest in LAYOUT}}
    return folder, flags


def inference_settings(argv: Sequence[str], load: str, prog: str,
                       overrides: Dict[str, Any]) -> "Settings":
    """The checkpoint's flags, then `overrides`, then the Megatron flags of `argv`, as typed
    settings for `arguments.build_run`; a data source given in argv replaces the saved ones
    (they are exclusive). A tokenizer file or data prefix the checkpoint names that is gone
    (and not given) is an error naming the flag to give."""
    from gigatron.training.checkpoint.recorded_paths import missing_recorded_paths
    from gigatron.training.config.arguments import given_dests, make_parser
    from gigatron.training.config.table import build_settings
    from gigatron.training.config.validation import ConfigError

    step = make_parser(prog).parse_known_args(list(argv))[0].ckpt_step
    folder, saved = saved_flags(load, step)
    base = {**saved, **NOT_INHERITED, **overrides, "load": load}
    fill_training_only(base)
    given = given_dests(argv, prog)
    if given & set(DATA_SOURCES):
        base.update({name: None for name in DATA_SOURCES}, mock_data=False)
    missing = missing_recorded_paths(base, given, folder)
    if missing:
        raise ConfigError(missing)
    # argparse fills only the attributes the namespace lacks: flags newer than the checkpoint
    return build_settings(make_parser(prog).parse_args(list(argv),
                                                       namespace=argparse.Namespace(**base)))


def load_model(run: "RunConfig", rank: int,
               device: torch.device) -> Tuple["ProcessGroups", List[torch.nn.Module]]:
    """This rank's process groups and model chunks (eval mode) holding the checkpoint's
    weights (collective over the job)."""
    groups, chunks, _ = load_model_and_progress(run, rank, device)
    return groups, chunks


def load_model_and_progress(run: "RunConfig", rank: int, device: torch.device
                            ) -> Tuple["ProcessGroups", List[torch.nn.Module],
                                       Optional["TrainProgress"]]:
    """`load_model`, and the training loop's position saved with the weights (None for a
    converted checkpoint): where its validation had got to, for `gigatron evaluate`."""
    from gigatron.training.run import builders
    from gigatron.training.checkpoint import orchestrator

    p = run.parallel
    groups = builders.build_process_groups(run, rank,
                                           timeout=timedelta(minutes=p.distributed_timeout_minutes))
    chunks = builders.build_model_chunks(run, groups, device)
    shard = orchestrator.load_model_weights(run, groups, chunks)
    if shard is None:
        raise ValueError(f"--load {run.checkpoint.load}: no checkpoint there")
    for chunk in chunks:
        chunk.eval()
    saved = shard.get("progress")
    return groups, chunks, orchestrator.TrainProgress(**saved) if saved else None
