"""Checkpoint files: one folder per iteration, every rank's shard, an atomically updated tracker.

    SAVE/latest_checkpointed_iteration.txt    "10"  (Megatron's tracker name and content)
    SAVE/iter_0000010/metadata.json           iteration, layout (tp, pp, dp, zero stage), flags,
                                              each shard's sha256 and size
    SAVE/iter_0000010/mp_rank_TT_PPP_DDD/model_optim_rng.pt   one per rank (tp, pp, dp)

Saving is crash-safe: ranks write into `iter_XXXXXXX.tmp/` (each file under a temporary
name, then renamed), hashing each shard as it is written; all ranks then exchange a small
report (ok?, checksum), rank 0 writes metadata.json, renames the folder to its final name,
and only then replaces the tracker (write a temporary file + os.replace). A crash at any
point leaves the tracker naming the previous, complete checkpoint. A write that fails (a
full disk) fails the save on every rank with one message; rank 0 removes the partial folder.

Loading checks a shard's checksum before deserialising it; an unreadable or corrupt file is
an error naming it, its iteration and the older checkpoint to fall back on.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
from typing import IO, Any, Callable, Dict, List, Optional, Tuple, cast

import torch

from gigatron.training.checkpoint import integrity, recorded_paths
from gigatron.training.checkpoint.integrity import Gather, StepReport, single_process_gather

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
FORMAT_VERSION = 2  # 2: metadata.json lists every shard's sha256 and size; 1 did not
_FOLDER = re.compile(r"iter_(\d+)$")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_file(folder: str, coords: Dict[str, int], fmt: str = "torch") -> str:
    """This rank's shard inside an iteration folder (a context-parallel rank other than the
    first adds its cp index: the cp ranks of one (tp, pp, dp) position hold distinct ZeRO
    shards)."""
    name = f"mp_rank_{coords['tp']:02d}_{coords['pp']:03d}_{coords['dp']:03d}"
    if coords.get("cp", 0):
        name += f"_cp{coords['cp']:02d}"
    ext = "safetensors" if fmt == "safetensors" else "pt"
    return os.path.join(folder, name, f"model_optim_rng.{ext}")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to `path` so readers see the old or the new content, never a mix."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def read_tracker(root: str) -> Optional[int]:
    """The last complete checkpoint's iteration, or None when `root` has none."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path, encoding="utf-8").read().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"checkpoint tracker {path} holds {text!r}, not an iteration number: "
                         f"fix or delete it") from None


def write_shard(path: str, state: Dict[str, Any], fmt: str = "torch") -> Tuple[str, int]:
    """Write one rank's state under a temporary name, then rename it into place; returns the
    file's (sha256, size), hashed as it was written."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.part"
    if fmt == "safetensors":
        from gigatron.training.checkpoint.safetensors_io import write_state
        checksum = integrity.write_hashed(tmp, lambda f: write_state(state, f.write))
    else:
        checksum = integrity.write_hashed(tmp, lambda f: torch.save(state, cast(IO[bytes], f)))
    os.replace(tmp, path)
    return checksum


def read_shard(path: str, fmt: str = "torch",
               metadata: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """This rank's shard; with the checkpoint's `metadata`, its checksum is checked first."""
    folder = os.path.dirname(os.path.dirname(path))
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint shard {path} is missing: the checkpoint is incomplete or "
                         f"was saved with a different layout or --ckpt-format; "
                         f"{fallback_hint(folder)}")
    if metadata is not None:
        verify_shard(path, folder, metadata)
    try:
        if fmt == "safetensors":
            from gigatron.training.checkpoint.safetensors_io import load_state
            return load_state(path)
        # mapped, not read: an offloaded run's shard (12 B/param) is not held in memory a
        # second time beside the live masters while it is loaded
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # torch, pickle, zip and safetensors each raise their own
        raise ValueError(f"checkpoint shard {path} of iteration {_iteration_of(folder)} cannot "
                         f"be read ({integrity.first_sentence(err)}): the file is truncated or "
                         f"damaged; {fallback_hint(folder)}") from None


def verify_shard(path: str, folder: str, metadata: Dict[str, Any]) -> None:
    """Refuse a shard whose size or sha256 differs from what metadata.json recorded (nothing
    to check in a checkpoint saved before checksums were recorded)."""
    shards = metadata.get("shards")
    if shards is None:
        return
    name = os.path.relpath(path, folder).replace(os.sep, "/")
    meta_path = os.path.join(folder, METADATA)
    entry = shards.get(name) if isinstance(shards, dict) else None
    if not isinstance(entry, dict) or integrity.CHECKSUM not in entry:
        raise ValueError(f"{meta_path} records no checksum for {name}: the metadata does not "
                         f"belong to this checkpoint; {fallback_hint(folder)}")
    actual, size = integrity.file_sha256(path)
    if actual != entry[integrity.CHECKSUM] or size != entry.get("bytes", size):
        raise ValueError(integrity.checksum_mismatch(
            path, _iteration_of(folder), meta_path, entry[integrity.CHECKSUM], actual,
            entry.get("bytes", size), size) + f"; {fallback_hint(folder)}")


def save_checkpoint(root: str, iteration: int, state: Dict[str, Any], coords: Dict[str, int],
                    metadata: Dict[str, Any], gather: Gather = single_process_gather,
                    is_first: bool = True, fmt: str = "torch") -> str:
    """Collective: every rank passes its state; returns the final iteration folder.

    `gather` exchanges a small report with every rank of the job (it is also what keeps the
    ranks in step); `is_first` is true on exactly one rank, which prepares the folder,
    publishes it and updates the tracker. A failure on any rank raises the same ValueError
    on every rank, and leaves the tracker and the previous checkpoint untouched.
    """
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    job = SaveJob(root, iteration, gather, is_first, StepReport(
        dict(coords), integrity.state_nbytes(state)))
    if is_first:
        job.attempt(tmp, lambda: prepare_folder(root, tmp))
    job.agree("create the folder", lambda c: tmp)
    path = rank_file(tmp, coords, fmt)
    job.attempt(path, lambda: job.wrote(*write_shard(path, state, fmt)))
    reports = job.agree("write its shard", lambda c: rank_file(tmp, c, fmt))
    if is_first:
        shards = {os.path.relpath(rank_file(tmp, r.coords, fmt), tmp).replace(os.sep, "/"):
                  {integrity.CHECKSUM: r.sha256, "bytes": r.file_bytes} for r in reports}
        job.attempt(final, lambda: publish(root, iteration, tmp, final,
                                           {**metadata, "ckpt_format": fmt,
                                            "shards": shards}))
    job.agree("publish", lambda c: final)
    return final


def prepare_folder(root: str, tmp: str) -> None:
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed save of this iteration
    os.makedirs(tmp)


class SaveJob:
    """One save's steps: each rank attempts its part, then all ranks agree on the outcome."""

    def __init__(self, root: str, iteration: int, gather: Gather, is_first: bool,
                 report: StepReport) -> None:
        self.root, self.iteration, self.gather = root, iteration, gather
        self.is_first, self.report = is_first, report

    def attempt(self, where: str, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception as err:  # a full disk, a permission, a storage error: all fail alike
            self.report.fail(err, where)

    def wrote(self, sha256: str, nbytes: int) -> None:
        self.report.sha256, self.report.file_bytes = sha256, nbytes

    def agree(self, step: str, path_of: Callable[[Dict[str, int]], str]) -> List[StepReport]:
        """Every rank's report; if any rank failed, rank 0 removes the partial folder and
        every rank raises the same error."""
        reports = integrity.exchange(self.gather, self.report)
        failed = [rank for rank, r in enumerate(reports) if r.failed]
        if not failed:
            return reports
        tmp = iteration_dir(self.root, self.iteration) + ".tmp"
        if self.is_first:
            shutil.rmtree(tmp, ignore_errors=True)
        rank = failed[0]
        raise ValueError(self._message(reports, rank, step, path_of(reports[rank].coords), tmp))

    def _message(self, reports: List[StepReport], rank: int, step: str, path: str,
                 tmp: str) -> str:
        bad = reports[rank]
        own = self.report.error if bad.coords == self.report.coords else None
        previous = _tracked(self.root)
        kept = (f"{os.path.join(self.root, TRACKER)} still names iteration {previous}, which "
                f"stays loadable" if previous is not None
                else f"there is no earlier checkpoint in {self.root}")
        fix = integrity.what_to_do(bad, self.root)
        return (f"could not save checkpoint iteration {self.iteration} to "
                f"{iteration_dir(self.root, self.iteration)}: rank {rank} could not {step} "
                f"{path}: {integrity.failure_reason(rank, bad, own)}; "
                f"{integrity.space_sentence(reports, bad, self.root)}. The partial folder {tmp} "
                f"was removed and {kept}: {fix}, then resume with --load {self.root}")


def publish(root: str, iteration: int, tmp: str, final: str, metadata: Dict[str, Any]) -> None:
    metadata = recorded_paths.store_tokenizer(tmp, metadata)  # the tokenizer's files, if named
    with open(os.path.join(tmp, METADATA), "w", encoding="utf-8") as f:
        json.dump({"format_version": FORMAT_VERSION, "iteration": iteration, **metadata}, f,
                  indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    old = None
    if os.path.exists(final):  # re-saving an iteration: move the old copy aside first
        old = f"{final}.old.{os.getpid()}"
        os.replace(final, old)
    try:
        os.replace(tmp, final)
        _fsync_dir(root)
        atomic_write_text(os.path.join(root, TRACKER), f"{iteration}\n")
    except BaseException:
        if old is not None:  # the tracker may name this iteration: its old copy comes back
            shutil.rmtree(final, ignore_errors=True)
            os.replace(old, final)
        elif _tracked(root) != iteration:  # untracked: as if this save never happened
            shutil.rmtree(final, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _tracked(root: str) -> Optional[int]:
    """The tracker's iteration, or None when it is missing or unreadable."""
    try:
        return read_tracker(root)
    except (OSError, ValueError):
        return None


def read_metadata(folder: str) -> Dict[str, Any]:
    """The checkpoint's metadata.json; a missing or damaged one names the file and fallback."""
    path = os.path.join(folder, METADATA)
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing: {folder} is not a complete gigatron checkpoint; "
                         f"{fallback_hint(folder)}")
    try:
        with open(path, encoding="utf-8") as f:
            metadata = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} of checkpoint iteration {_iteration_of(folder)} is not valid "
                         f"JSON ({err}): the file is truncated or damaged; "
                         f"{fallback_hint(folder)}") from None
    if not isinstance(metadata, dict):
        raise ValueError(f"{path} of checkpoint iteration {_iteration_of(folder)} holds a "
                         f"{type(metadata).__name__}, not an object: the file is damaged; "
                         f"{fallback_hint(folder)}")
    return metadata


def _iteration_of(folder: str) -> Optional[int]:
    match = _FOLDER.match(os.path.basename(os.path.normpath(folder)))
    return int(match.group(1)) if match else None


def complete_iterations(root: str) -> List[int]:
    """Iterations of the checkpoint folders in `root` that hold a readable metadata.json."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        match = _FOLDER.match(name)
        path = os.path.join(root, name, METADATA)
        if match and os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    json.load(f)
            except (OSError, ValueError):
                continue
            found.append(int(match.group(1)))
    return sorted(found)


def fallback_hint(folder: str) -> str:
    """How to resume from the newest complete checkpoint older than `folder`, if any."""
    root, iteration = os.path.dirname(os.path.normpath(folder)), _iteration_of(folder)
    older = [i for i in complete_iterations(root) if iteration is None or i < iteration]
    if not older:
        return f"no older checkpoint in {root} to fall back on"
    tracker = os.path.join(root, TRACKER)
    return (f"an older checkpoint exists, iteration {older[-1]} "
            f"({iteration_dir(root, older[-1])}): to resume from it, write {older[-1]} into "
            f"{tracker} (echo {older[-1]} > {tracker})")


# sizes a checkpoint written before they were recorded was saved with
LAYOUT_DEFAULTS = {"cp": 1}


def check_layout(metadata: Dict[str, Any], layout: Dict[str, int], folder: str) -> None:
    """A per-rank (torch or safetensors) checkpoint loads only into the layout that wrote
    it: say so clearly, with the way out."""
    saved = {k: metadata.get(k, LAYOUT_DEFAULTS.get(k)) for k in layout}
    if saved != layout:
        got = " ".join(f"{k}={v}" for k, v in saved.items())
        want = " ".join(f"{k}={v}" for k, v in layout.items())
        raise ValueError(
            f"checkpoint {folder} was saved with {got} but this run has {want}: a per-rank "
            f"(--ckpt-format torch or safetensors) checkpoint loads only into the layout that "
            f"saved it; relaunch with the saved sizes, adding --ckpt-format torch_dist to "
            f"write a checkpoint any layout loads at the next save")


def find_checkpoint(root: str, step: Optional[int] = None
                    ) -> Tuple[Optional[int], Optional[str]]:
    """(iteration, folder) of the tracked checkpoint in `root` (of iteration `step` instead,
    Megatron's --ckpt-step), or (None, None)."""
    if step is not None:
        folder = iteration_dir(root, step)
        if not os.path.isdir(folder):
            held = ", ".join(map(str, complete_iterations(root))) or "none"
            raise ValueError(f"--ckpt-step {step}: {folder} does not exist (iterations in "
                             f"{root}: {held}): give one of them")
        return step, folder
    iteration = read_tracker(root)
    if iteration is None:
        return None, None
    folder = iteration_dir(root, iteration)
    if not os.path.isdir(folder):
        # a crash while re-saving this iteration, between moving the old copy aside and
        # publishing the new one: the old copy is complete
        aside = sorted(glob.glob(f"{folder}.old.*"))
        if aside:
            os.replace(aside[-1], folder)
            return iteration, folder
        raise ValueError(f"{os.path.join(root, TRACKER)} names iteration {iteration} but "
                         f"{folder} does not exist; {fallback_hint(folder)}")
    return iteration, folder
