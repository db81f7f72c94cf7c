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

    python bench/bench_offload.py                        # ~100M parameters
    python bench/bench_offload.py --layers 36 --hidden 2048 --modes streamed whole
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Dict

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


def run_one(mode: str, layers: int, hidden: int, bucket: int) -> Dict[str, float]:
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
    return {"mode": mode, "params": params, **{f"host_{k}": v for k, v in host.items()},
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
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for offload.json")
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.layers, args.hidden, args.offload_bucket_size)))
        return
    rows = []
    for mode in args.modes:  # a fresh process each: peak RSS must not carry over
        out = subprocess.run([sys.executable, __file__, "--one", mode, "--layers",
                              str(args.layers), "--hidden", str(args.hidden),
                              "--offload-bucket-size", str(args.offload_bucket_size)],
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
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "offload.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
