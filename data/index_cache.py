"""Build sample indices once, on one rank, and share them through `.npy` files.

Files are named by a hash of everything the indices depend on (document sizes, split range,
sequence length, seed, epochs, format version), so a stale cache is never read. Rank 0 of the
given process group builds what is missing and writes each file under a temporary name before
renaming it into place; the other ranks wait at a barrier and then memory-map the files. The
group's ranks must share the cache folder's filesystem (pass a per-node group otherwise).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Callable, Dict, Optional, Sequence

import numpy as np
from gigatron.parallel.comm import Group

INDEX_FORMAT_VERSION = 1


def description_hash(description: dict) -> str:
    text = json.dumps(description, sort_keys=True)
    return hashlib.md5(text.encode("utf-8")).hexdigest()


def array_digest(array: np.ndarray) -> str:
    """Content hash of an array (the document sizes a split's indices depend on)."""
    return hashlib.md5(np.ascontiguousarray(array).tobytes()).hexdigest()


def _umask_mode() -> int:
    """The mode a plain open() gives a new file (0666 minus the umask): mkstemp's 0600 would
    lock other users of a shared cache out."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _save_atomic(path: str, array: np.ndarray) -> None:
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npy", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _build_and_save(base: str, paths: Dict[str, str], build: Callable,
                    description: dict) -> None:
    arrays = build()
    for name, path in paths.items():
        _save_atomic(path, arrays[name])
    with open(base + "_description.json", "w", encoding="utf-8") as f:
        json.dump(description, f, indent=1, sort_keys=True)  # for humans; never read back


def cached_indices(names: Sequence[str], build: Callable[[], Dict[str, np.ndarray]],
                   description: dict, cache_dir: Optional[str], file_prefix: str,
                   group: Group = None) -> Dict[str, np.ndarray]:
    """The arrays `build()` returns, from the cache when present (built by group rank 0)."""
    if cache_dir is None:
        return build()
    from gigatron.parallel import comm  # torch only where ranks exist (tools stay light)

    description = dict(description, index_format_version=INDEX_FORMAT_VERSION)
    base = os.path.join(cache_dir, f"{file_prefix}_{description_hash(description)}")
    paths = {n: f"{base}_{n}.npy" for n in names}
    error: Optional[BaseException] = None
    if comm.group_rank(group) == 0 and not all(os.path.exists(p) for p in paths.values()):
        try:
            os.makedirs(cache_dir, exist_ok=True)
            _build_and_save(base, paths, build, description)
        except OSError as err:  # still reach the barrier so other ranks do not hang
            error = OSError(f"cannot write sample indices to {cache_dir} ({err}); set "
                            f"--data-cache-path to a writable folder shared by the ranks")
        except BaseException as err:
            error = err
    comm.barrier(group)
    if error is not None:
        raise error
    missing = [p for p in paths.values() if not os.path.exists(p)]
    if missing:
        raise RuntimeError(f"index files {missing} are missing after rank 0 of the group built "
                           f"them: do all ranks of the group share the filesystem of "
                           f"{cache_dir}? (set --data-cache-path to a shared folder)")
    return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}
