"""Shared test setup: GPU-only tests are skipped (with the reason) where CUDA is absent, and
the longest files run first, so that the README's `pytest -n 2 --dist loadfile` ends with
short files filling in on both workers instead of one long file running alone."""
import gc
import importlib
import os
import sys

# Python's default bytecode cache, even where the environment turns it off (this project's
# 2-core machine sets PYTHONDONTWRITEBYTECODE=1): every rank or command a test starts as a
# process would otherwise compile the ~200 gigatron modules it imports from source again
# (~0.25 s of CPU each; ~10% of the CPU of the files that start processes). The cache lands
# in the checkout's __pycache__ folders, which git ignores and the wheel leaves out.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# Every TCPStore client (a rank joining its rendezvous, the watchdog's client, torchrun's
# workers) has glibc reverse-resolve ::ffff:127.0.0.1 through DNS before it connects (torch
# names the address in its messages). Where DNS drops a query, as on a machine without a
# network when ranks start in quick succession, the resolver waits its default 5 s (1 in ~10
# 8-rank worlds started in a loop; 6 of tests/test_engine.py's 32 tests, 58 -> 35 s for that
# file alone). 1 s and one try bound it; a RES_OPTIONS set outside is kept. Set before this
# process or any rank it starts resolves a name.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

# One OpenMP thread for every process a test starts (torchrun sets this for its workers, but
# a script, a benchmark or torchrun's own agent started by a test would run torch with one
# thread per core, whose spinning only takes CPU from the other worker: bench_train_gpu's
# tiny run 17.8 -> 8.4 CPU-s). A value set outside is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

# What a forked rank of pretrain.main (or of gigatron.initialize) imports, imported once here:
# forked ranks inherit the parent's modules, and a rank that imports them itself pays ~1.5 s
# of CPU (torch._dynamo, which torch.optim loads, and torch.distributed.checkpoint alone ~1 s)
# -- an 8-rank pretraining world measured 15 CPU-s without this, 3 with it. Only modules
# every such rank loads anyway; nothing optional (transformers, deepspeed, wandb, ...).
WARM_IMPORTS = (
    "torch._dynamo", "torch.distributed.checkpoint", "gigatron.training.run.pretrain",
    "gigatron.training.run.loop", "gigatron.training.run.builders",
    "gigatron.training.run.from_checkpoint", "gigatron.training.run.banner",
    "gigatron.training.run.preflight", "gigatron.training.checkpoint.orchestrator",
    "gigatron.training.config.arguments", "gigatron.training.plan.report",
    "gigatron.models.gpt", "gigatron.models.megatron.args", "gigatron.data.builder",
    "gigatron.data.tokenizer", "gigatron.parallel.pipeline.executor",
    "gigatron.parallel.expert.dispatchers", "gigatron.parallel.watchdog",
    "gigatron.parallel.zero.optimizer", "gigatron.engine",
)


def pytest_configure(config):
    """Warm the process that runs tests. Under `-n 2` that is each xdist worker, not the
    controller, which only hands out files: importing torch and the modules above there cost
    ~3.7 CPU-s before any worker had started."""
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import torch

    if os.environ.get("PYTEST_XDIST_WORKER"):
        # the README's command runs 2 workers on 2 cores: a second intra-op thread per worker
        # would only spin against the other worker (forked ranks already run single-threaded)
        torch.set_num_threads(1)
    for module in WARM_IMPORTS:
        importlib.import_module(module)
    # the ~300k objects of these imports live as long as the process: out of the collector's
    # view, a gc.collect() in a test or pytest's own at the session's end (~1.3 CPU-s per
    # worker) walks only what came after
    gc.collect()
    gc.freeze()


# The files that take longest on 2 cores (`pytest --durations=0`, summed per file), longest
# first. Only the order changes: a file missing here runs after these, in collection order.
LONGEST_FIRST = (
    "test_launch_cli.py", "test_horovod.py", "test_bench_train_gpu.py", "test_e2e_training.py",
    "test_horovod_api.py", "test_deepspeed_checkpoint_load.py", "test_torch_compile.py",
    "test_engine.py", "test_watchdog.py", "test_checkpoint_dist.py",
    "test_bench_context_parallel.py", "test_deepspeed_parity.py", "test_megatron_torch_dist.py",
    "test_restart.py", "test_deepspeed_auto.py", "test_megatron_scripts.py",
    "test_context_parallel_checkpoint.py", "test_context_parallel.py",
    "test_pipeline_user_model.py", "test_mla_parallel.py", "test_zero_bubble_training.py",
)


def pytest_collection_modifyitems(config, items):
    import torch

    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the device machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
