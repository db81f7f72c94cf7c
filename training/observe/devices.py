"""The one hardware table: what a device can do, for the planner and for MFU at run time.

Every figure is the vendor's datasheet number (dense, no structured sparsity), per device:

  peak_tflops       dense tensor-core TFLOP/s by dtype; fp32 is plain fp32 (torch's default
                    disallows TF32 for matmuls)
  memory_gib        device memory, GiB (the datasheet's GB as torch.cuda.mem_get_info
                    reports it: an "80 GB" H100 has 79.6 GiB, a "141 GB" H200 139.8)
  hbm_gbps          memory bandwidth, GB/s
  intra_node_gbps   bandwidth one device has to the others of its node, per direction, GB/s
                    (NVLink: half the datasheet's bidirectional figure; PCIe cards: PCIe)
  inter_node_gbps   network bandwidth per device, per direction, GB/s: the reference
                    system's NICs divided by its GPUs (DGX A100: 8x HDR 200 Gb/s for 8 GPUs;
                    DGX H100/H200/B200: 8x ConnectX-7 400 Gb/s for 8 GPUs). A cluster's own
                    figure may differ: override it.

Sources (retrieved for this table):
  A100: NVIDIA A100 Tensor Core GPU datasheet (312 TFLOP/s bf16/fp16 dense, 19.5 fp32;
        40 GB HBM2 1,555 GB/s; 80 GB HBM2e 2,039 GB/s; NVLink 600 GB/s); DGX A100 datasheet.
  H100: NVIDIA H100 Tensor Core GPU datasheet (SXM: 989 TFLOP/s bf16 dense, 67 fp32, 80 GB
        HBM3 3.35 TB/s, NVLink 900 GB/s; PCIe: 756 dense, 51 fp32, 80 GB HBM2e 2.0 TB/s,
        PCIe Gen5 128 GB/s); DGX H100 datasheet.
  H100 NVL: the same datasheet's NVL column (835 TFLOP/s bf16 dense, 60 fp32, 94 GB HBM3
        3.9 TB/s; its NVLink bridge joins pairs only, so groups beyond two use PCIe Gen5,
        64 GB/s per direction); memory as nvidia-smi shows the card, 95,830 MiB.
  H100 96 GB HBM2e: torchtitan's GPUs (pytorch/torchtitan benchmarks/
        llama3_h100_202412_torchtitan.md: Grand Teton hosts, 96 GB HBM2e at 2.4 TB/s, NVLink
        within a host, 400 Gb/s RDMA per GPU, 500 W power limit). Its peak is not published
        ("between SXM and NVL", ibid.): the NVL's 835 (the same 132-SM die rated for its
        lower power), the bound torchtitan states, chosen while comparing with torchtitan's
        Table 1 (training/plan/published.py). Memory: six 16 GiB stacks less the 80 GB
        card's 0.4 GiB reserve. No device name matches it: `--gpu h100-hbm2e`.
  H200: NVIDIA H200 Tensor Core GPU datasheet (989 TFLOP/s bf16 dense, 67 fp32, 141 GB HBM3e
        4.8 TB/s, NVLink 900 GB/s); memory 139.80 GiB as torch reported it on the H200 of
        the GPU session (docs/PERFORMANCE.md, "One H200").
  B200: NVIDIA DGX B200 / HGX B200 datasheets (2.25 PFLOP/s bf16 dense per GPU, 1,440 GB for
        8 GPUs = 180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s; 8x ConnectX-7 400 Gb/s).
  SMs: the same datasheets and NVIDIA's architecture whitepapers (A100 108 of the GA100's
        128; H100 SXM/NVL 132, PCIe 114; H200 132, as the H200 session's device query
        showed; B200 148).
  matmul_tflops: the measured maximum achievable bf16 matmul (a well-quantised large shape,
        median of repeats), where one is known: H200 794.9, the H200 session's ceiling
        (bench/ceilings.py, 8192^3; docs/PERFORMANCE.md, "One H200"); H100 SXM 792.1 and
        A100 SXM 267.9 from stas00/ml-engineering compute/accelerator/README.md, "Maximum
        Achievable Matmul FLOPS comparison table" (mamf-finder.py, CUDA 12.1; the A100 80
        GB's figure for the 40 GB, the same SMs and clocks). The planner's full-wave GEMM
        rate (training/plan/gemm.py); without one, gemm.GEMM_EFFICIENCY of the peak.
  Others (for MFU at run time; no interconnect figures): L40S, L4, A10G, A10, V100 and
        RTX 4090 datasheets.
  cpu:  NOT a datasheet: a nominal host (1 TFLOP/s, 50 GB/s DRAM, gloo over shared memory
        10 GB/s, 10 GbE between hosts). Measure yours and override.

`--peak-tflops`, `--gpu-memory-gib`, `--hbm-bandwidth`, `--intra-node-bandwidth` and
`--inter-node-bandwidth` of `gigatron plan` override a row (`with_overrides`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Hardware:
    """One device type: its compute peak, memory and links (see the module docstring)."""

    key: str
    name: str
    match: Tuple[str, ...]  # every token appears in torch.cuda.get_device_name()
    peak_tflops: Mapping[str, float]
    memory_gib: Optional[float] = None
    hbm_gbps: Optional[float] = None
    intra_node_gbps: Optional[float] = None
    inter_node_gbps: Optional[float] = None
    gpus_per_node: int = 8
    sms: Optional[int] = None  # streaming multiprocessors: the waves of a GEMM's tiles
    matmul_tflops: Optional[float] = None  # measured bf16 matmul ceiling (see the docstring)

    def peak(self, dtype_name: str) -> Optional[float]:
        """Dense peak TFLOP/s for 'bf16' | 'fp16' | 'fp32' (None if the device lacks it)."""
        return self.peak_tflops.get(dtype_name)

    @property
    def plannable(self) -> bool:
        """Whether every figure the cost model needs is known."""
        return None not in (self.memory_gib, self.hbm_gbps, self.intra_node_gbps,
                            self.inter_node_gbps)


def _p(bf16: Optional[float], fp32: float, fp16: Optional[float] = None) -> Dict[str, float]:
    out = {"fp32": fp32}
    if bf16 is not None:
        out["bf16"] = bf16
    if fp16 is not None or bf16 is not None:
        out["fp16"] = fp16 if fp16 is not None else bf16  # type: ignore[assignment]
    return out


# First match wins when a device name is looked up: specific names before general ones.
HARDWARE: Tuple[Hardware, ...] = (
    Hardware("h200", "NVIDIA H200 SXM", ("H200",), _p(989.4, 66.9), 139.8, 4800, 450, 50,
             sms=132, matmul_tflops=794.9),
    Hardware("h100-pcie", "NVIDIA H100 PCIe", ("H100", "PCIe"), _p(756.0, 51.2), 79.6, 2000,
             64, 50, sms=114),
    Hardware("h100-nvl", "NVIDIA H100 NVL", ("H100", "NVL"), _p(835.0, 60.0), 93.6, 3900,
             64, 50, sms=132),
    Hardware("h100-hbm2e", "NVIDIA H100 SXM 96GB HBM2e, 500 W (Grand Teton)", (),
             _p(835.0, 60.0), 95.6, 2400, 450, 50, sms=132),
    Hardware("h100-sxm", "NVIDIA H100 SXM 80GB", ("H100",), _p(989.4, 66.9), 79.6, 3350, 450,
             50, sms=132, matmul_tflops=792.1),
    Hardware("b200", "NVIDIA B200", ("B200",), _p(2250.0, 75.0), 179.0, 8000, 900, 50,
             sms=148),
    Hardware("a100-80gb", "NVIDIA A100 SXM 80GB", ("A100", "80GB"), _p(312.0, 19.5), 80, 2039,
             300, 25, sms=108, matmul_tflops=267.9),
    Hardware("a100-40gb", "NVIDIA A100 SXM 40GB", ("A100",), _p(312.0, 19.5), 40, 1555, 300,
             25, sms=108, matmul_tflops=267.9),
    Hardware("l40s", "NVIDIA L40S", ("L40S",), _p(362.1, 91.6), 48, 864),
    Hardware("l4", "NVIDIA L4", ("L4",), _p(121.0, 30.3), 24, 300),
    Hardware("a10g", "NVIDIA A10G", ("A10G",), _p(70.0, 31.2), 24, 600),
    Hardware("a10", "NVIDIA A10", ("A10",), _p(125.0, 31.2), 24, 600),
    Hardware("v100", "NVIDIA V100", ("V100",), {"fp16": 125.0, "fp32": 15.7}, 32, 900, 150),
    Hardware("rtx-4090", "NVIDIA GeForce RTX 4090", ("RTX 4090",), _p(165.2, 82.6), 24, 1008),
    Hardware("cpu", "CPU host (nominal)", (), _p(1.0, 1.0), 64, 50, 10, 1.25, gpus_per_node=1),
)

# the devices `gigatron plan --gpu` offers (every figure known)
PLAN_KEYS: Tuple[str, ...] = tuple(h.key for h in HARDWARE if h.plannable)


def hardware(key: str) -> Hardware:
    """The table's row for `key` (e.g. 'h100-sxm'); a clear error lists the choices."""
    for row in HARDWARE:
        if row.key == key.lower():
            return row
    raise ValueError(f"--gpu {key!r} is not in the hardware table: choose one of "
                     f"{', '.join(PLAN_KEYS)} (docs/PLAN.md lists their figures and sources)")


def for_device_name(name: str) -> Optional[Hardware]:
    """The row whose tokens all appear in a CUDA device name, or None."""
    for row in HARDWARE:
        if row.match and all(token in name for token in row.match):
            return row
    return None


def with_overrides(row: Hardware, overrides: Mapping[str, Optional[float]]) -> Hardware:
    """`row` with the given fields replaced; 'peak_tflops' replaces every dtype's peak."""
    given: Dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    if "peak_tflops" in given:
        peak = float(given.pop("peak_tflops"))
        given["peak_tflops"] = {dtype: peak for dtype in ("bf16", "fp16", "fp32")}
        given["matmul_tflops"] = None  # the measured ceiling was the datasheet device's
    if "gpus_per_node" in given:
        given["gpus_per_node"] = int(given["gpus_per_node"])
    unknown = set(given) - {"peak_tflops", "matmul_tflops", "memory_gib", "hbm_gbps",
                            "intra_node_gbps", "inter_node_gbps", "gpus_per_node"}
    if unknown:
        raise ValueError(f"unknown hardware fields {sorted(unknown)}")
    return replace(row, **given)


def table_rows(keys: Sequence[str] = PLAN_KEYS) -> str:
    """The plannable rows as a markdown table (docs/PLAN.md)."""
    lines = ["| --gpu | device | bf16/fp16 TFLOP/s | fp32 TFLOP/s | memory GiB | HBM GB/s | "
             "intra-node GB/s | inter-node GB/s |", "|---|---|---|---|---|---|---|---|"]
    for key in keys:
        h = hardware(key)
        lines.append(f"| {h.key} | {h.name} | {h.peak('bf16')} | {h.peak('fp32')} | "
                     f"{h.memory_gib} | {h.hbm_gbps} | {h.intra_node_gbps} | "
                     f"{h.inter_node_gbps} |")
    return "\n".join(lines)
