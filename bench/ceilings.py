"""The two ceilings of a GPU (docs/PERFORMANCE.md, the device method): device-to-device copy
bandwidth (bytes read + written) and a bf16 matrix product's TFLOP/s, on random data, median
of device-event-timed runs. Prints one JSON line."""
import json
import statistics

import torch


def median_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def matmul_tflops(iters: int = 20, n: int = 8192) -> float:
    """bf16 n^3 matrix product TFLOP/s on random data (median of `iters` timed runs)."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * n ** 3 / median_ms(lambda: a @ b, iters) / 1e9


def copy_gb_s() -> float:
    """Device-to-device copy of 2 GiB, GB/s counting bytes read and written (median of 20);
    its buffers are freed on return."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / median_ms(lambda: dst.copy_(src)) / 1e6


def main() -> None:
    copy_gbs = copy_gb_s()
    props = torch.cuda.get_device_properties(0)
    result = dict(device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                  cuda=torch.version.cuda, copy_gb_s=round(copy_gbs, 1),
                  bf16_matmul_tflops=round(matmul_tflops(), 1))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
