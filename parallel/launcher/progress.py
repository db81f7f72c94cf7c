"""What a job tells its launcher for a restart: the last logged and the last saved iteration.

`gigatron launch --max_restarts N` names a folder in GIGATRON_LAUNCH_PROGRESS_DIR; the
training loop notes each log line and each finished checkpoint save there (local rank 0,
one small JSON file, replaced atomically), so that when a rank dies the launcher can say
how many iterations the restart loses. The folder outlives the attempts: a restarted job
that has not saved yet still resumes from the checkpoint the previous attempt noted.

Also the fault a restart test injects: GIGATRON_KILL_RANK_AT=RANK:ITERATION makes that rank
SIGKILL itself as it starts that iteration, on the first attempt only.
"""
from __future__ import annotations

import json
import os
import signal
from typing import Dict, Mapping, Optional

from gigatron.parallel.world import restart_count

PROGRESS_DIR_ENV = "GIGATRON_LAUNCH_PROGRESS_DIR"
KILL_ENV = "GIGATRON_KILL_RANK_AT"
PROGRESS_FILE = "progress.json"

_noted: Dict[str, int] = {}  # this process's record, written whole each time


def read_progress(folder: Optional[str]) -> Dict[str, int]:
    """{'logged': N, 'saved': M} as last noted in `folder` (keys absent when not noted)."""
    if not folder:
        return {}
    try:
        with open(os.path.join(folder, PROGRESS_FILE)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: int(v) for k, v in data.items() if k in ("logged", "saved")} \
        if isinstance(data, dict) else {}


def note_progress(logged: Optional[int] = None, saved: Optional[int] = None) -> None:
    """Record a logged iteration or a finished save for the launcher (local rank 0 of a
    `gigatron launch` job only; a no-op otherwise)."""
    folder = os.environ.get(PROGRESS_DIR_ENV)
    if not folder or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    if not _noted:
        _noted.update(read_progress(folder))  # a restart keeps the previous attempt's save
    for key, value in (("logged", logged), ("saved", saved)):
        if value is not None:
            _noted[key] = value
    path = os.path.join(folder, PROGRESS_FILE)
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(_noted, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # the launcher's folder is gone (or on another node): the report says less


def iterations_lost(progress: Mapping[str, int]) -> str:
    """'4 iterations lost (last logged iteration 9, checkpoint at iteration 5)'."""
    logged, saved = progress.get("logged"), progress.get("saved")
    if logged is None:
        return "no iteration was logged"
    if saved is None:
        return (f"last logged iteration {logged}, no checkpoint saved since the launch "
                f"(the run starts again from --load, or from scratch)")
    lost = max(logged - saved, 0)
    return (f"{lost} iteration{'s' if lost != 1 else ''} lost (last logged iteration "
            f"{logged}, checkpoint at iteration {saved})")


def inject_fault(iteration: int, env: Optional[Mapping[str, str]] = None) -> None:
    """SIGKILL this rank as it starts `iteration` if GIGATRON_KILL_RANK_AT=RANK:ITERATION
    names it, on the job's first attempt only (restart tests)."""
    env = os.environ if env is None else env
    spec = env.get(KILL_ENV)
    if not spec or restart_count(env) > 0:
        return
    rank, _, at = spec.partition(":")
    if rank == env.get("RANK") and at == str(iteration):
        os.kill(os.getpid(), signal.SIGKILL)
