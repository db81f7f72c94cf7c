"""The torch_dist checkpoint: one layout-free folder per iteration, written through
torch.distributed.checkpoint (DCP), that any tp / pp / virtual stages / dp / ZeRO stage loads.

    SAVE/latest_checkpointed_iteration.txt    "10" (Megatron's tracker)
    SAVE/iter_0000010/metadata.json           gigatron's: format, iteration, the layout that
                                              wrote it, flags, every file's sha256 and size
    SAVE/iter_0000010/.metadata               DCP's: every global tensor's shape, dtype and
                                              the boxes it was written in
    SAVE/iter_0000010/__<rank>_0.distcp       what each rank wrote

Tensors are global: named as the single-device model names its parameters, shaped as the
single-device tensor (the vocabulary without tp padding). Each rank writes only the boxes
of those tensors it owns and a load reads exactly the boxes it needs, whatever layout wrote
them (training/checkpoint/torch_dist/state.py says who writes what, training/checkpoint/torch_dist/layout.py does the box
arithmetic, training/checkpoint/torch_dist/planner.py tells DCP about the boxes).

Why boxes and not DTensor: a tensor-parallel slice of SwiGLU's [gate; up] (or of unequal q,
k, v blocks) is several boxes of the global tensor, not the one shard DTensor's Shard
placement describes, and a ZeRO shard is a range of flattened elements, not a box at all.
Cut into boxes, both go to DCP as they are: no gather over dp at save (every rank writes
about 1/world of the checkpoint, with no communication but DCP's planning), and at load
each rank reads into its own ZeRO shard directly.

Saves are atomic as the torch format's (training/checkpoint/folders.py): DCP writes into
`iter_XXXXXXX.tmp/`; every rank hashes its share of the files written; rank 0 writes
metadata.json with the checksums, renames the folder and only then replaces the tracker.
A failure on any rank (a full disk) fails the save on every rank with one message, and
leaves the tracker and the previous checkpoint untouched. Loading checks every file's
sha256 first (each rank its share), so a corrupt file is one error naming it.

`save_global_model` / `load_global_model` write and read the model weights of such a
folder as one single-device state dict in a single process (converters, generation).
"""
from __future__ import annotations

import contextlib
import errno
import os
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from gigatron.training.checkpoint import integrity
from gigatron.training.checkpoint import folders as files
from gigatron.training.checkpoint.integrity import Gather, StepReport
from gigatron.training.checkpoint.torch_dist.planner import ShardedLoadPlanner, ShardedSavePlanner
from gigatron.training.checkpoint.torch_dist.state import COMMON, MODEL

FORMAT = "torch_dist"
DCP_METADATA = ".metadata"


def checkpoint_format(metadata: Dict[str, Any]) -> str:
    """The format of a checkpoint folder, from its metadata.json (whatever --ckpt-format
    says): torch_dist, torch or safetensors (older folders name it by their shards only)."""
    if "ckpt_format" in metadata:
        return str(metadata["ckpt_format"])
    shards = metadata.get("shards") or {}
    return "safetensors" if any(str(k).endswith(".safetensors") for k in shards) else "torch"


# ---- collectives of a save (on DCP's process group, which an async save runs apart) ------
def object_gather(group: Optional[Any]) -> Gather:
    """A Gather over `group` (None: every rank) that works from any thread: rows travel as
    objects, so the group may be a CPU (gloo) group whatever device the job trains on."""
    def gather(row: List[int]) -> List[List[int]]:
        return all_objects(list(row), group)
    return gather


def all_objects(obj: Any, group: Optional[Any]) -> List[Any]:
    """Every rank's `obj`, in rank order ([obj] without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _rank_and_size(group: Optional[Any]) -> Tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


# ---- saving ----------------------------------------------------------------------------
def save(root: str, iteration: int, state: Dict[str, Any], coords: Dict[str, int],
         metadata: Dict[str, Any], group: Optional[Any] = None,
         single_process: bool = False) -> str:
    """Collective over `group` (None: every rank): write `state` (a flat dict of
    ShardedValue, tensors and picklable objects) as iteration `iteration` of `root`;
    returns the final folder. A failure on any rank raises the same ValueError on all."""
    from gigatron.training.checkpoint.torch_dist.state import nbytes

    rank, world = (0, 1) if single_process else _rank_and_size(group)
    gather = integrity.single_process_gather if single_process else object_gather(group)
    final = files.iteration_dir(root, iteration)
    tmp = final + ".tmp"
    job = files.SaveJob(root, iteration, gather, rank == 0, StepReport(dict(coords),
                                                                       nbytes(state)))
    if rank == 0:
        job.attempt(tmp, lambda: files.prepare_folder(root, tmp))
    job.agree("create the folder", lambda c: tmp)
    job.attempt(tmp, lambda: _write(tmp, state, rank, group, single_process))
    job.agree("write its part of", lambda c: tmp)
    digests: Dict[str, Dict[str, Any]] = {}
    job.attempt(tmp, lambda: digests.update(_hash_share(tmp, rank, world)))
    job.agree("hash its files in", lambda c: tmp)
    every = digests if single_process else \
        {k: v for share in all_objects(digests, group) for k, v in share.items()}
    if rank == 0:
        job.attempt(final, lambda: files.publish(root, iteration, tmp, final, {
            **metadata, "ckpt_format": FORMAT, "files": every}))
    job.agree("publish", lambda c: final)
    return final


def _write(folder: str, state: Dict[str, Any], rank: int, group: Optional[Any],
           single_process: bool) -> None:
    """DCP's save; its own failure on another rank is that rank's to report."""
    from torch.distributed.checkpoint.api import CheckpointException

    writer = dcp.FileSystemWriter(folder, single_file_per_rank=True, sync_files=True)
    alone = single_process or not (dist.is_available() and dist.is_initialized())
    try:
        with _quiet() if alone else contextlib.nullcontext():
            dcp.save(state, storage_writer=writer, planner=ShardedSavePlanner(),
                     process_group=group, no_dist=single_process)
    except CheckpointException as err:
        mine = err.failures.get(rank)
        if mine is None:
            return  # another rank failed: the agreement that follows names it
        raise _os_reason(mine[0] if isinstance(mine, tuple) else mine, folder) from None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without DCP's warning that a process alone is "assuming the intent is to save (load)
    in a single process": that is the intent here. (Only around single-process calls: the
    warnings filters are process-wide, and an async save runs beside training.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        yield


def _os_reason(err: BaseException, folder: str) -> BaseException:
    """torch's writer reports a full disk as its own RuntimeError: name the OS's reason."""
    if isinstance(err, OSError) or integrity.free_bytes(folder) != 0:
        return err
    return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (the writer said: "
                                 f"{integrity.first_sentence(err)})")


def _hash_share(folder: str, rank: int, world: int) -> Dict[str, Dict[str, Any]]:
    """sha256 and size of this rank's share of the files in `folder` (every world-th)."""
    names = sorted(os.listdir(folder))
    out = {}
    for name in names[rank::world]:
        sha, size = integrity.file_sha256(os.path.join(folder, name))
        out[name] = {integrity.CHECKSUM: sha, "bytes": size}
    return out


# ---- loading -----------------------------------------------------------------------------
def verify_files(folder: str, metadata: Dict[str, Any], rank: int = 0, world: int = 1) -> None:
    """Check this rank's share of the files against metadata.json's checksums (DCP's
    .metadata on every rank: each reads it); an error names the file and the fallback."""
    recorded = metadata.get("files")
    meta_path = os.path.join(folder, files.METADATA)
    if not isinstance(recorded, dict) or DCP_METADATA not in recorded:
        raise ValueError(f"{meta_path} lists no checksums of the torch_dist files: the "
                         f"metadata does not belong to this checkpoint; "
                         f"{files.fallback_hint(folder)}")
    names = sorted(recorded)
    share = names[rank::world]
    for name in ([DCP_METADATA] if DCP_METADATA not in share else []) + share:
        _verify_file(folder, name, recorded[name], meta_path)


def _verify_file(folder: str, name: str, entry: Dict[str, Any], meta_path: str) -> None:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint file {path} is missing: the checkpoint is incomplete; "
                         f"{files.fallback_hint(folder)}")
    actual, size = integrity.file_sha256(path)
    if actual != entry.get(integrity.CHECKSUM) or size != entry.get("bytes", size):
        raise ValueError(integrity.checksum_mismatch(
            path, _iteration(folder), meta_path, str(entry.get(integrity.CHECKSUM)), actual,
            int(entry.get("bytes", size)), size) + f"; {files.fallback_hint(folder)}")


def _iteration(folder: str) -> Optional[int]:
    name = os.path.basename(os.path.normpath(folder))
    return int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None


def entries(folder: str) -> Dict[str, Any]:
    """Every entry of the checkpoint: name -> DCP's metadata (for a tensor its global shape,
    dtype and saved boxes; BytesStorageMetadata for a pickled object)."""
    try:
        metadata = dcp.FileSystemReader(folder).read_metadata()
    except Exception as err:  # pickle, EOF, OS errors: the file is damaged
        raise ValueError(f"{os.path.join(folder, DCP_METADATA)} cannot be read "
                         f"({integrity.first_sentence(err)}): the file is truncated or "
                         f"damaged; {files.fallback_hint(folder)}") from None
    return dict(metadata.state_dict_metadata)


def read(folder: str, state: Dict[str, Any]) -> Dict[str, Any]:
    """Fill `state` from the checkpoint in this process alone: ShardedValue pieces and
    tensors are written in place, other keys (None) receive the saved objects."""
    with _quiet():
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(folder),
                     planner=ShardedLoadPlanner(), no_dist=True)
        except Exception as err:  # DCP wraps the reason: name the folder and the fix
            raise ValueError(f"checkpoint {folder} cannot be read: "
                             f"{_reason(err)}; {files.fallback_hint(folder)}") from None
    return state


def _reason(err: BaseException) -> str:
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        err = first[0] if isinstance(first, tuple) else first
    return integrity.first_sentence(err)


def read_common(folder: str) -> Dict[str, Any]:
    """The checkpoint's small picklable state (progress, lr schedule, scaler, ...)."""
    return read(folder, {COMMON: None})[COMMON] or {}


# ---- single-device model state dicts (converters, generation) ----------------------------
def save_global_model(state_dict: Dict[str, torch.Tensor], root: str, iteration: int,
                      metadata: Optional[Dict[str, Any]] = None) -> str:
    """Write a single-device model state dict (GPTModel names, tp=1 shapes; the vocabulary
    rows without padding) as iteration `iteration` of `root` in the torch_dist format, in a
    single process; `--load root` of any layout accepts it (with --finetune, or with
    --no-load-optim --no-load-rng: it holds weights only). Returns the folder."""
    state: Dict[str, Any] = {MODEL + name: t.detach().cpu() for name, t in state_dict.items()}
    state[COMMON] = {"progress": {"iteration": iteration}}
    meta = {"iteration": iteration, "tp": 1, "pp": 1, "dp": 1, "virtual_chunks": 1,
            "world_size": 1, "has_optimizer": False, **(metadata or {})}
    return save(root, iteration, state, {"tp": 0, "pp": 0, "dp": 0}, meta,
                single_process=True)


def load_global_model(root_or_folder: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """The model weights of a torch_dist checkpoint (a --save root: its tracked iteration;
    or an iter_XXXXXXX folder) as one single-device state dict, and its metadata.json."""
    folder = _folder_of(root_or_folder)
    metadata = files.read_metadata(folder)
    if checkpoint_format(metadata) != FORMAT:
        raise ValueError(f"{folder} is a {checkpoint_format(metadata)} checkpoint, not "
                         f"torch_dist: its weights are tied to the layout that saved them; "
                         f"load it with that layout and save it again with --ckpt-format "
                         f"torch_dist")
    verify_files(folder, metadata)
    saved = {k[len(MODEL):]: md for k, md in entries(folder).items()
             if k.startswith(MODEL) and isinstance(md, TensorStorageMetadata)}
    state: Dict[str, Any] = {MODEL + name: torch.empty(tuple(md.size),
                                                       dtype=md.properties.dtype)
                             for name, md in saved.items()}
    read(folder, state)
    return {name: state[MODEL + name] for name in saved}, metadata


def _folder_of(path: str) -> str:
    if os.path.isfile(os.path.join(path, files.TRACKER)):
        _, folder = files.find_checkpoint(path)
        assert folder is not None  # the tracker exists
        return folder
    if os.path.isfile(os.path.join(path, files.METADATA)):
        return path
    raise ValueError(f"{path} holds no checkpoint: give a --save directory (with "
                     f"{files.TRACKER}) or one of its iter_XXXXXXX folders")

