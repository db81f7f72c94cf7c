"""What a checkpoint holds for one rank, and restoring it so a resumed run continues exactly.

Two formats: torch_dist (the default: layout-free, training/checkpoint/torch_dist/save_load.py) and the
per-rank torch/safetensors shards (training/checkpoint/folders.py), which only the layout that
wrote them loads. A load reads the format from the folder, whatever --ckpt-format says.

Loading happens in two phases because ZeRO copies the model's parameters into its fp32
master shards when it is built: `load_model_weights` (before ZeRO exists) puts the saved
weights into the model chunks; `restore_training_state` (after) loads the optimizer state,
loss scaler, RNG states and the loop's progress.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from gigatron.training.checkpoint import folders as files
from gigatron.training.checkpoint import non_persistent, rank_copies, recorded_paths
from gigatron.training.checkpoint.torch_dist import module_state, save_load
from gigatron.training.checkpoint.torch_dist import resume as dist_resume
from gigatron.training.checkpoint.torch_dist import state as dist_state
from gigatron.training.checkpoint.integrity import job_gather, raise_if_any_failed
from gigatron.training.checkpoint.rng import generator_states, restore_generators
from gigatron.training.checkpoint.shapes import check_model_shapes
from gigatron.training.config.run_config import RunConfig
from gigatron.training.checkpoint.torch_dist.async_save import AsyncSaver, SavedCheckpoint

if TYPE_CHECKING:
    from gigatron.training.config.run_config import LRScheduleConfig
    from gigatron.parallel.topology import ProcessGroups
    from gigatron.parallel.zero.optimizer import ZeroOptimizer


@dataclass
class TrainProgress:
    """The loop's position: everything besides weights and optimizer that resume needs."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    lr_steps: int = 0  # samples of successful updates: the lr schedule's position (Megatron)
    skipped_iterations: int = 0


def rng_state(chunks: List[torch.nn.Module], device: torch.device) -> Dict[str, Any]:
    """Every generator a step draws from: python, numpy, torch (+ accelerator), TP tracker."""
    return {**generator_states(device),
            "tracker": [[[name, dev, s] for (name, dev), s in _tracker(c).get_states().items()]
                        for c in chunks]}


def restore_rng(state: Dict[str, Any], chunks: List[torch.nn.Module],
                device: torch.device) -> None:
    """Put back what `rng_state` saved."""
    restore_generators(state, device)
    for chunk, saved in zip(chunks, state["tracker"]):
        _tracker(chunk).set_states({(name, _this_device(dev, device)): s
                                      for name, dev, s in saved})


def _tracker(chunk: torch.nn.Module) -> Any:
    """The chunk's tensor-parallel RNG tracker (a plain attribute nn.Module's typing hides)."""
    return getattr(chunk, "rng_tracker")


def _this_device(saved: str, device: torch.device) -> str:
    """A tracker stream saved on another GPU index continues on this rank's GPU (a resumed
    rank may sit on another local GPU; an unmatched key would silently reseed the stream)."""
    if device.index is not None and torch.device(saved).type == device.type:
        return str(device)
    return saved


def layout(run: RunConfig, num_chunks: int) -> Dict[str, int]:
    """The sizes a per-rank (torch format) checkpoint is tied to (an MoE model's expert
    boxes also to ep and etp)."""
    p = run.parallel
    sizes = {"tp": p.tp, "pp": p.pp, "dp": p.dp, "cp": p.context_parallel_size,
             "virtual_chunks": num_chunks}
    if run.model is not None and run.model.num_moe_experts is not None:
        sizes.update(ep=p.ep, etp=p.tp if p.etp is None else p.etp)
    return sizes


def _metadata(run: RunConfig, progress: TrainProgress, num_chunks: int) -> Dict[str, Any]:
    """metadata.json's description of the run that saved (both formats): its flags with
    absolute paths, and the tokenizer files to store with it (recorded_paths.py)."""
    flags = recorded_paths.recorded_flags(run.flags)
    return {**layout(run, num_chunks), "zero_stage": run.zero.zero_stage,
            "world_size": run.parallel.world_size, "consumed_train_samples":
            progress.consumed_train_samples, "model_name": run.model_name,
            "flags": flags, **recorded_paths.tokenizer_record(flags)}


class Checkpointer:
    """Saves a run's checkpoints: synchronously, or (--async-save) staged to CPU memory and
    written in the background while training goes on (training/checkpoint/torch_dist/async_save.py);
    persistent ones, or non-persistent ones (training/checkpoint/non_persistent.py)."""

    def __init__(self) -> None:
        self._async = AsyncSaver()
        self._copies: Optional[rank_copies.RankCopies] = None

    def save(self, run: RunConfig, groups: "ProcessGroups", progress: TrainProgress,
             chunks: List[torch.nn.Module], zero: "ZeroOptimizer",
             device: torch.device, persistent: bool = True) -> List[SavedCheckpoint]:
        """Collective: save iteration `progress.iteration`; returns the saves that finished
        (the previous background one, waited for first, and this one unless it runs in the
        background). A failed save raises the same ValueError on every rank."""
        started = time.perf_counter()
        finished = [saved for saved in [self.wait()] if saved is not None]
        if not persistent and run.checkpoint.non_persistent_ckpt_type in rank_copies.KINDS:
            where = self._save_rank_copy(run, groups, progress, chunks, zero, device)
            return finished + [SavedCheckpoint(progress.iteration, where,
                                               time.perf_counter() - started)]
        root, published = non_persistent.destination(run, groups.rank, progress.iteration,
                                                      persistent)
        if not run.checkpoint.async_save:
            folder = save(run, groups, progress, chunks, zero, device, root)
            published()
            return finished + [SavedCheckpoint(progress.iteration, folder,
                                               time.perf_counter() - started)]
        if run.checkpoint.ckpt_format != save_load.FORMAT:
            raise ValueError("--async-save needs --ckpt-format torch_dist")
        group = self._async.group(run.parallel.distributed_timeout_minutes)
        _, state, coords, meta = _dist_save_state(run, groups, progress, chunks, zero, device)
        # an offloaded run's masters and optimizer state are written from where they are:
        # the next optimizer step waits for the write instead of the host holding a copy
        live = dist_state.host_optimizer_storages(zero) if zero.offload is not None else set()
        state = dist_state.staged(state, live)

        def write() -> str:
            folder = save_load.save(root, progress.iteration, state, coords, meta, group)
            published()
            return folder
        self._async.start(progress.iteration, started, write)
        if live:
            zero.hold_step(self._async.join)
        return finished

    def _save_rank_copy(self, run: RunConfig, groups: "ProcessGroups",
                        progress: TrainProgress, chunks: List[torch.nn.Module],
                        zero: "ZeroOptimizer", device: torch.device) -> str:
        """A local / in_memory non-persistent checkpoint: each rank keeps its own state."""
        ck = run.checkpoint
        assert ck.save is not None and ck.non_persistent_ckpt_type is not None
        if self._copies is None:
            self._copies = rank_copies.RankCopies(ck.non_persistent_ckpt_type,
                                                  run.parallel.distributed_timeout_minutes)
        state = _rank_state(run, progress, chunks, zero, device, with_model=True)
        meta = {"iteration": progress.iteration, "layout": copy_layout(run, len(chunks))}
        job = non_persistent.copies_dir(ck, ck.save)
        self._copies.save(job, state, meta, groups.rank, run.parallel.world_size, device)
        return f"{job} ({ck.non_persistent_ckpt_type} non-persistent)"

    def wait(self) -> Optional[SavedCheckpoint]:
        """The pending background save, once it finished (None: none was pending)."""
        return self._async.wait()


def save(run: RunConfig, groups: "ProcessGroups", progress: TrainProgress,
         chunks: List[torch.nn.Module], zero: "ZeroOptimizer",
         device: torch.device, root: Optional[str] = None) -> str:
    """Collective: write this rank's part of iteration `progress.iteration` in the
    --ckpt-format to `root` (default --save); a failed save (say, a full disk on any rank)
    raises the same ValueError on every rank."""
    root = root or run.checkpoint.save
    if root is None:
        raise ValueError("saving a checkpoint needs --save DIR")
    if run.checkpoint.ckpt_format == save_load.FORMAT:
        _, dist_state_dict, coords, meta = _dist_save_state(run, groups, progress, chunks,
                                                             zero, device)
        return save_load.save(root, progress.iteration, dist_state_dict, coords, meta)
    # cp ranks hold the same weights: cp rank 0 writes them
    state = _rank_state(run, progress, chunks, zero, device,
                        with_model=groups.coords.get("cp", 0) == 0)
    return files.save_checkpoint(root, progress.iteration, state,
                                 groups.coords, _metadata(run, progress, len(chunks)),
                                 job_gather(device), groups.rank == 0,
                                 run.checkpoint.ckpt_format)


def _rank_state(run: RunConfig, progress: TrainProgress, chunks: List[torch.nn.Module],
                zero: "ZeroOptimizer", device: torch.device, with_model: bool
                ) -> Dict[str, Any]:
    """Everything this rank resumes from, on the host: its chunks' weights (ZeRO 3 gathers
    them), its optimizer shard, RNG states, progress and lr schedule."""
    with zero.gathered_parameters():
        model = [{k: v.detach().cpu().clone() for k, v in c.state_dict().items()}
                 for c in chunks]
    state: Dict[str, Any] = {"progress": asdict(progress)}
    if with_model:
        state["model"] = model
    if run.lr_schedule is not None:  # checked against the flags on resume
        state["lr_schedule"] = asdict(run.lr_schedule)
    if not run.checkpoint.no_save_optim:
        state["optimizer"] = zero.state_dict()
    if not run.checkpoint.no_save_rng:
        state["rng"] = rng_state(chunks, device)
    return state


def copy_layout(run: RunConfig, num_chunks: int) -> Dict[str, Any]:
    """What a rank's own state is tied to: the layout, the world and the ZeRO stage."""
    return {**layout(run, num_chunks), "world_size": run.parallel.world_size,
            "zero_stage": run.zero.zero_stage}


def _dist_save_state(run: RunConfig, groups: "ProcessGroups", progress: TrainProgress,
                     chunks: List[torch.nn.Module], zero: "ZeroOptimizer",
                     device: torch.device
                     ) -> Tuple[str, Dict[str, Any], Dict[str, int], Dict[str, Any]]:
    """(root, this rank's torch_dist state, coordinates, metadata.json's content)."""
    ck, coords = run.checkpoint, groups.coords
    if ck.save is None:
        raise ValueError("saving a checkpoint needs --save DIR")
    with_optimizer = not ck.no_save_optim
    replica = groups.index("dp-cp")  # which copy of the model: dp and cp ranks hold the same
    values, scalars = dist_state.zero_state_to_save(zero, chunks, coords["tp"], run.parallel.tp,
                                                    replica, with_optimizer)
    state: Dict[str, Any] = dict(values)
    # persistent buffers (an MoE router's expert bias) are the same on every tp, cp, dp rank
    state.update(module_state.buffers_to_save(chunks, replica == 0 and coords["tp"] == 0))
    if groups.rank == 0:
        common: Dict[str, Any] = {"progress": asdict(progress)}
        if run.lr_schedule is not None:
            common["lr_schedule"] = asdict(run.lr_schedule)
        if with_optimizer:
            common["optimizer"] = dist_state.optimizer_common(zero, scalars)
        state[dist_state.COMMON] = common
    if not ck.no_save_rng and replica == 0:  # the same seeds on every dp and cp rank
        state[dist_state.rng_key(coords["tp"], coords["pp"])] = rng_state(chunks, device)
    meta = {**_metadata(run, progress, len(chunks)),
            "params_dtype": str(zero.param_dtype).replace("torch.", "")}
    return ck.save, state, coords, meta


def load_model_weights(run: RunConfig, groups: "ProcessGroups",
                       chunks: List[torch.nn.Module]) -> Optional[Dict[str, Any]]:
    """Phase 1 of --load: weights into the chunks; returns this rank's shard (None: none)."""
    from gigatron.training.checkpoint.from_megatron import resolve_load

    ck = run.checkpoint
    if ck.load is None:
        return None
    root = resolve_load(ck.load, None if run.model is None else run.model.vocab_size,
                        not (ck.no_load_optim or ck.finetune), groups.rank)
    newer = non_persistent.newer_checkpoint(run, groups.rank, copy_layout(run, len(chunks)))
    if isinstance(newer, dict):
        return _load_rank_copy(run, chunks, newer)
    folder = newer or files.find_checkpoint(root, run.checkpoint.ckpt_step)[1]
    if folder is None:
        for flag, wanted in (("--finetune", run.checkpoint.finetune),
                             ("--exit-on-missing-checkpoint",
                              run.checkpoint.exit_on_missing_checkpoint)):
            if wanted:
                raise ValueError(f"{flag}: no checkpoint in --load {root} "
                                 f"({files.TRACKER} missing)")
        return None
    meta = files.read_metadata(folder)  # the same file for every rank: all fail alike
    fmt = save_load.checkpoint_format(meta)
    if fmt != save_load.FORMAT:
        files.check_layout(meta, layout(run, len(chunks)), folder)
    failure: Optional[ValueError] = None
    shard: Dict[str, Any] = {}
    try:
        shard = dist_resume.load_weights(run, groups, chunks, folder, meta) \
            if fmt == save_load.FORMAT else \
            _load_shard(run, groups.coords, chunks, folder, meta, fmt)
    except ValueError as err:  # one rank's shard may be damaged: all ranks stop together
        failure = err
    raise_if_any_failed(job_gather(_device_of(chunks)), failure, lambda ranks: (
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} could not load "
        f"{'their parts' if len(ranks) > 1 else 'its part'} of checkpoint {folder} (the "
        f"error line of rank {ranks[0]} names the file and the fix): this rank stops too"))
    shard.update({"_folder": folder, "_format": fmt, "_zero_stage": meta.get("zero_stage")})
    return shard


def _load_shard(run: RunConfig, coords: Dict[str, int], chunks: List[torch.nn.Module],
                folder: str, meta: Dict[str, Any], fmt: str) -> Dict[str, Any]:
    """This rank's shard, checksum verified, its weights checked against and put into the
    chunks."""
    shard = files.read_shard(files.rank_file(folder, coords, fmt), fmt, meta)
    if coords.get("cp", 0):  # the weights are in the shard of cp rank 0 (see `save`)
        first = files.read_shard(files.rank_file(folder, {**coords, "cp": 0}, fmt), fmt, meta)
        shard["model"] = first["model"]
    _put_weights(run, chunks, shard["model"], folder, meta.get("flags"))
    return shard


def _put_weights(run: RunConfig, chunks: List[torch.nn.Module],
                 model: List[Dict[str, torch.Tensor]], folder: str,
                 saved_flags: Optional[Dict[str, Any]]) -> None:
    """A per-rank checkpoint's weights into this rank's chunks, checked first."""
    check_model_shapes(model, chunks, saved_flags, run.flags, folder)
    for chunk, weights in zip(chunks, model):
        try:
            chunk.load_state_dict(weights, strict=True)
        except RuntimeError as err:  # shapes and names were checked: say what is left
            raise ValueError(f"checkpoint {folder} does not load into this run's model: "
                             f"{str(err).strip().splitlines()[-1].strip()}") from None


def _load_rank_copy(run: RunConfig, chunks: List[torch.nn.Module],
                    shard: Dict[str, Any]) -> Dict[str, Any]:
    """Phase 1 from this rank's local / in_memory state (all ranks fail alike)."""
    failure: Optional[ValueError] = None
    try:
        _put_weights(run, chunks, shard["model"], shard["_folder"], None)
    except ValueError as err:
        failure = err
    raise_if_any_failed(job_gather(_device_of(chunks)), failure, lambda ranks: (
        f"ranks {', '.join(map(str, ranks))} could not load their state from "
        f"{shard['_folder']} (their error lines say why): this rank stops too"))
    return shard


def _device_of(chunks: List[torch.nn.Module]) -> torch.device:
    for chunk in chunks:
        for param in chunk.parameters():
            return param.device
    return torch.device("cpu")


def resumed_schedule(run: RunConfig, shard: Optional[Dict[str, Any]]
                     ) -> Tuple[Optional["LRScheduleConfig"], Optional[str]]:
    """The lr schedule a resumed run follows (the checkpoint's and the flags' must agree
    unless --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler says which
    wins), and a line to log when they differ. Fresh, --finetune and --no-load-optim runs
    follow the flags, as in Megatron."""
    from gigatron.training.lr.megatron import resume_schedule

    ck = run.checkpoint
    rng_note = None if shard is None or ck.finetune or ck.no_load_rng else \
        dist_resume.rng_note(shard)
    if shard is None or ck.finetune or ck.no_load_optim or run.lr_schedule is None:
        return run.lr_schedule, rng_note
    schedule, note = resume_schedule(shard.get("lr_schedule"), run.lr_schedule,
                                     ck.override_opt_param_scheduler,
                                     ck.use_checkpoint_opt_param_scheduler, shard["_folder"])
    return schedule, "; ".join(n for n in (note, rng_note) if n) or None


def restore_training_state(run: RunConfig, shard: Optional[Dict[str, Any]],
                           chunks: List[torch.nn.Module], zero: "ZeroOptimizer",
                           device: torch.device) -> TrainProgress:
    """Phase 2 of --load: optimizer shard, scaler, RNG and progress (per the --no-load-*
    and --finetune flags); a fresh TrainProgress without a checkpoint."""
    ck = run.checkpoint
    if shard is None or ck.finetune:
        return TrainProgress()
    if shard["_format"] == save_load.FORMAT:
        return _restore_dist(run, shard, chunks, zero, device)
    if not ck.no_load_optim:
        if shard["_zero_stage"] != run.zero.zero_stage:
            raise ValueError(f"{shard['_folder']} was saved with --zero-stage "
                             f"{shard['_zero_stage']}, this run has {run.zero.zero_stage}: "
                             f"use the saved stage, or --no-load-optim to keep only the weights")
        if "optimizer" not in shard:
            raise ValueError(f"{shard['_folder']} holds no optimizer state (saved with "
                             f"--no-save-optim): add --no-load-optim")
        zero.load_state_dict(shard["optimizer"])
    if not ck.no_load_rng:
        if "rng" not in shard:
            raise ValueError(f"{shard['_folder']} holds no RNG state (saved with "
                             f"--no-save-rng): add --no-load-rng")
        restore_rng(shard["rng"], chunks, device)
    return TrainProgress(**shard["progress"])


def _restore_dist(run: RunConfig, shard: Dict[str, Any], chunks: List[torch.nn.Module],
                  zero: "ZeroOptimizer", device: torch.device) -> TrainProgress:
    """Phase 2 of a torch_dist checkpoint, in any layout (all ranks fail alike)."""
    ck = run.checkpoint
    failure: Optional[ValueError] = None
    install = None
    try:
        if not ck.no_load_optim:
            install = dist_resume.read_optimizer(run, shard, chunks, zero)
    except ValueError as err:
        failure = err
    raise_if_any_failed(job_gather(device), failure, lambda ranks: (
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} could not load "
        f"the optimizer state of checkpoint {shard['_folder']} (the error line of rank "
        f"{ranks[0]} names the cause): this rank stops too"))
    if install is not None:
        install()
    if not ck.no_load_rng and shard.get("_rng_note") is None:
        if shard.get("rng") is None:
            raise ValueError(f"{shard['_folder']} holds no RNG state (saved with "
                             f"--no-save-rng, or weights only): add --no-load-rng")
        restore_rng(shard["rng"], chunks, device)
    return TrainProgress(**shard["progress"])
