"""A run rebuilt from its checkpoint, for inference: `gigatron generate` and `gigatron evaluate`.

The checkpoint's metadata.json records the training run's flags. They rebuild the model,
tokenizer and data, so `--load DIR` needs no model flags; the command's own settings come
next (say, no metrics file of the training run is appended to), and the Megatron flags given
on the command line last (a moved tokenizer file, another data split, another layout). The
model is then built per rank as pretraining builds it and the weights loaded through
`orchestrator.load_model_weights`.
"""
from __future__ import annotations

import argparse
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

if TYPE_CHECKING:
    from gigatron.data.tokenizer import Tokenizer
    from gigatron.parallel.topology import ProcessGroups
    from gigatron.training.config.run_config import RunConfig

# flags of the training run that an inference command must not reuse: its outputs
NOT_INHERITED: Dict[str, Any] = {
    "save": None, "metrics_file": None, "tensorboard_dir": None, "wandb_project": None,
    "timeline": None, "deepspeed_config": None, "exit_signal_handler": False, "finetune": False,
}
# the layout of the training run: a layout-free (torch_dist) checkpoint loads into any, so
# an inference command starts from one rank's layout (the flags of its command line choose
# another); a per-rank (torch) checkpoint keeps the layout that wrote it
LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
          "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
          "decoder_last_pipeline_num_layers", "sequence_parallel", "context_parallel_size")
# training settings a converted checkpoint (Hugging Face, Megatron-LM) does not record: the
# run config needs them, inference never uses them (micro-batch: evaluate's default)
TRAINING_ONLY = {"micro_batch_size": 1, "lr": 1.0e-4, "train_iters": 1}
DATA_SOURCES = ("data_path", "train_data_path", "valid_data_path", "test_data_path",
                "mock_data")


def saved_flags(load: str) -> Dict[str, Any]:
    """The flags recorded in the metadata.json of the checkpoint `load` tracks (with the
    default layout in place of the saved one when the checkpoint is layout-free)."""
    from gigatron.training.checkpoint import folders as files
    from gigatron.training.config.arguments import make_parser
    from gigatron.training.checkpoint.torch_dist.save_load import checkpoint_format

    _, folder = files.find_checkpoint(load)
    if folder is None:
        raise ValueError(f"--load {load}: no checkpoint there ({files.TRACKER} missing): "
                         f"give the --save folder of a training run")
    metadata = files.read_metadata(folder)
    flags = metadata.get("flags")
    if not isinstance(flags, dict):
        raise ValueError(f"{folder}/{files.METADATA} records no flags: it was not written by "
                         f"gigatron pretrain")
    if checkpoint_format(metadata) == "torch_dist":
        parser = make_parser()
        flags = {**flags, **{dest: parser.get_default(dest) for dest in LAYOUT}}
    return flags


def explicit_dests(argv: Sequence[str], prog: str) -> Set[str]:
    """The dests of the Megatron flags given in `argv`."""
    from gigatron.training.config.arguments import make_parser

    parser = make_parser(prog)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given, _ = parser.parse_known_args(list(argv))
    return set(vars(given))


def inference_flags(argv: Sequence[str], load: str, prog: str,
                    overrides: Dict[str, Any]) -> argparse.Namespace:
    """The checkpoint's flags, then `overrides`, then the Megatron flags of `argv`; a data
    source given in argv replaces the saved ones (they are exclusive)."""
    from gigatron.training.config.arguments import make_parser

    base = {**saved_flags(load), **NOT_INHERITED, **overrides, "load": load}
    for name, value in TRAINING_ONLY.items():
        if base.get(name) is None and not (name == "train_iters" and base.get("train_samples")):
            base[name] = value
    given = explicit_dests(argv, prog)
    if given & set(DATA_SOURCES):
        base.update({name: None for name in DATA_SOURCES}, mock_data=False)
    # argparse fills only the attributes the namespace lacks: flags newer than the checkpoint
    return make_parser(prog).parse_args(list(argv), namespace=argparse.Namespace(**base))


def build_inference_run(flags: argparse.Namespace,
                        world_size: int) -> Tuple["RunConfig", Optional["Tokenizer"]]:
    """Validated RunConfig and tokenizer of inference flags (one ValueError listing every
    problem)."""
    from gigatron.data.tokenizer import tokenizer_type_to_build
    from gigatron.training.config.arguments import build_run_config
    from gigatron.training.run.builders import build_tokenizer

    tokenizer = build_tokenizer(vars(flags)) \
        if tokenizer_type_to_build(vars(flags)) is not None else None
    run = build_run_config(flags, world_size, tokenizer.vocab_size if tokenizer else None)
    if tokenizer is None:
        assert run.model is not None  # build_run_config built it
        tokenizer = build_tokenizer(vars(flags), run.model.vocab_size)
    return run, tokenizer


def load_model(run: "RunConfig", rank: int,
               device: torch.device) -> Tuple["ProcessGroups", List[torch.nn.Module]]:
    """This rank's process groups and model chunks (eval mode) holding the checkpoint's
    weights (collective over the job)."""
    from gigatron.parallel.topology import ProcessGroups, Topology
    from gigatron.training.run import builders
    from gigatron.training.checkpoint import orchestrator

    p = run.parallel
    groups = ProcessGroups(Topology(tp=p.tp, dp=p.dp, pp=p.pp), rank,
                           timeout=timedelta(minutes=p.distributed_timeout_minutes))
    chunks = builders.build_model_chunks(run, groups, device)
    if orchestrator.load_model_weights(run, groups, chunks) is None:
        raise ValueError(f"--load {run.checkpoint.load}: no checkpoint there")
    for chunk in chunks:
        chunk.eval()
    return groups, chunks
