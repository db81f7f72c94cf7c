"""Host memory of the --optimizer-cpu-offload step per parameter, accounted and measured (issue 42).

A bf16 stack of square linears (~100M parameters by default), ZeRO stage 1 on one rank,
AdamW, two steps, in a fresh process per mode:

  none      no offload: masters and Adam state beside the parameters
  streamed  offload, parallel/zero/offload.py's bucket stream (fp32 master + m + v and a
            fixed set of bucket buffers)
  whole     offload through the whole-shard path (what non-elementwise optimizers get, and
            what every optimizer got before the stream): a host copy of the full grad shard

Per mode: the host bytes the offload path owns, accounted exactly (nbytes of masters,
optimizer state, bucket buffers, host grad copies), and the process's peak RSS growth
from after the model is built to the end of the second step (VmHWM, reset through
/proc/self/clear_refs), less the ZeRO buffers that would be on the GPU (flat parameters and
grads): on a CPU-only machine both live in the same process memory.

Checkpoints of the offloaded modes (issue 42): the peak RSS growth, above the RSS just before,
of a torch_dist save, of a per-rank (--ckpt-format torch) save (`ZeroOptimizer.state_dict`
through torch.save into a file), and of a torch_dist resume into a fresh model and ZeRO (it
makes Adam's m and v, 8 B/param, which the first step would make otherwise), written to a
temporary folder (--ckpt-dir) and removed.

    python bench/bench_offload.py                        # ~100M parameters
    python bench/bench_offload.py --layers 36 --hidden 2048 --modes streamed whole
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Callable, Dict, Optional

import torch
from torch import nn

MODES = ("none", "streamed", "whole")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class Stack(nn.Module):
    """`layers` bias-free hidden x hidden linears (the parameter count is what matters)."""

    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=False)
                                    for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.float().square().mean()


def _train(layers: int, hidden: int, mode: str, bucket: int):
    """Two ZeRO steps of a fresh Stack; returns (model, zero, RSS before ZeRO was built)."""
    from gigatron.parallel.zero import ZeroConfig, build_zero

    torch.manual_seed(0)
    model = Stack(layers, hidden).to(torch.bfloat16)
    before_kib = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on
    zero = build_zero(model, ZeroConfig(zero_stage=1, lr=1e-4, weight_decay=0.1, clip_grad=1.0,
                                        offload_optimizer="none" if mode == "none" else "cpu",
                                        offload_bucket_size=bucket))
    x = torch.randn(4, hidden, dtype=torch.bfloat16)
    for _ in range(2):
        zero.zero_grad()
        zero.backward(model(x))
        zero.step()
    return model, zero, before_kib


def _peak_growth(action: Callable[[], object]) -> int:
    """Bytes the process's peak RSS rose above its RSS while `action` ran."""
    before_kib = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    action()
    return (_status_kib("VmHWM") - before_kib) * 1024


def checkpoint_peaks(model: nn.Module, zero, layers: int, hidden: int, bucket: int,
                     ckpt_dir: str) -> Dict[str, int]:
    """Peak RSS growth of a torch_dist save, a per-rank save and a torch_dist resume."""
    from gigatron.parallel.zero import ZeroConfig, build_zero
    from gigatron.training.checkpoint import folders
    from gigatron.training.checkpoint.torch_dist import resume, save_load
    from gigatron.training.checkpoint.torch_dist import state as dist_state

    root = tempfile.mkdtemp(dir=ckpt_dir)
    try:
        def dist_save() -> str:
            values, scalars = dist_state.zero_state_to_save(zero, [model], 0, 1, 0, True)
            state = {**values, dist_state.COMMON: {
                "optimizer": dist_state.optimizer_common(zero, scalars)}}
            return save_load.save(root, 2, state, {"tp": 0, "pp": 0, "dp": 0},
                                  {"iteration": 2, "tp": 1, "pp": 1}, single_process=True)
        peaks = {"torch_dist_save": _peak_growth(dist_save)}
        folder = folders.iteration_dir(root, 2)
        peaks["per_rank_save"] = _peak_growth(
            lambda: torch.save(zero.state_dict(), os.path.join(root, "rank.pt")))
        saved = save_load.read_common(folder)["optimizer"]
        fresh = Stack(layers, hidden).to(torch.bfloat16)
        fresh_zero = build_zero(fresh, ZeroConfig(zero_stage=1, lr=1e-4, weight_decay=0.1,
                                                  clip_grad=1.0, offload_optimizer="cpu",
                                                  offload_bucket_size=bucket))
        peaks["torch_dist_resume"] = _peak_growth(
            lambda: resume.read_zero_state(folder, saved, [fresh], fresh_zero, 1)())
        return peaks
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_one(mode: str, layers: int, hidden: int, bucket: int,
            ckpt_dir: Optional[str] = None) -> Dict[str, float]:
    """One mode in this process: accounted host bytes and peak RSS growth."""
    from gigatron.parallel.zero import measure_memory, offload

    if mode == "whole":
        offload.STREAMED = ()
    _train(1, 64, mode, bucket)  # warm-up: kernels, libraries and thread pools load here
    model, zero, before_kib = _train(layers, hidden, mode, bucket)
    peak_kib = _status_kib("VmHWM")
    params = sum(p.numel() for p in model.parameters())
    mem = measure_memory(zero)
    if zero.offload is not None:
        host = zero.offload.host_bytes()
    else:
        host = {"master": int(mem.master_params), "optimizer_state": int(mem.optimizer_state),
                "buffers": 0, "grads": 0}
    device_side = mem.params + mem.grads
    growth = (peak_kib - before_kib) * 1024
    checkpoint = {} if zero.offload is None else {
        f"{k}_growth_per_param": v / params for k, v in
        checkpoint_peaks(model, zero, layers, hidden, bucket, ckpt_dir).items()}
    return {**checkpoint, "mode": mode, "params": params,
            **{f"host_{k}": v for k, v in host.items()},
            "host_per_param": sum(host.values()) / params,
            "host_per_param_without_buffers": (sum(host.values()) - host["buffers"]) / params,
            "peak_rss_growth_per_param": growth / params,
            "device_side_per_param": device_side / params,
            "peak_rss_growth_less_device_side_per_param": (growth - device_side) / params}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--offload-bucket-size", type=int, default=32_000_000,
                   help="elements per bucket (ZeroConfig.offload_bucket_size's default)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--ckpt-dir", default=None,
                   help="where the checkpoints of the offloaded modes are written (default: "
                        "the temporary folder); each is removed")
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for offload.json")
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.layers, args.hidden, args.offload_bucket_size,
                                 args.ckpt_dir)))
        return
    rows = []
    for mode in args.modes:  # a fresh process each: peak RSS must not carry over
        out = subprocess.run([sys.executable, __file__, "--one", mode, "--layers",
                              str(args.layers), "--hidden", str(args.hidden),
                              "--offload-bucket-size", str(args.offload_bucket_size)] +
                             (["--ckpt-dir", args.ckpt_dir] if args.ckpt_dir else []),
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{rows[0]['params']:,} parameters, bf16, ZeRO 1, dp 1, AdamW, offload bucket "
          f"{args.offload_bucket_size:,} elements; bytes per parameter:")
    print("| mode | host accounted | of it buffers | host without buffers | peak RSS growth "
          "| ZeRO device-side | growth less device-side |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['host_per_param']:.2f} | {r['host_buffers'] / r['params']:.2f}"
              f" | {r['host_per_param_without_buffers']:.2f} | "
              f"{r['peak_rss_growth_per_param']:.2f} | {r['device_side_per_param']:.2f} | "
              f"{r['peak_rss_growth_less_device_side_per_param']:.2f} |")
    saved = [r for r in rows if "torch_dist_save_growth_per_param" in r]
    if saved:
        print("checkpoints of the offloaded modes, peak RSS growth per parameter:")
        print("| mode | torch_dist save | per-rank save | torch_dist resume (m, v: 8) |")
        print("|---|---|---|---|")
        for r in saved:
            print(f"| {r['mode']} | {r['torch_dist_save_growth_per_param']:.2f} | "
                  f"{r['per_rank_save_growth_per_param']:.2f} | "
                  f"{r['torch_dist_resume_growth_per_param']:.2f} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "offload.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
