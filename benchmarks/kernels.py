"""Pack/unpack bandwidth of ddl_magic.kernels against plain torch baselines.

    python benchmarks/kernels.py [--tensors 200] [--mebibytes 64] [--repeats 20]

Packs a model-like set of float32 tensors (a few large, many small, ``--tensors``
of them totalling ``--mebibytes``) into a fusion buffer and back, plain and
compressed to float16 with a scale, and compares ddl_magic.kernels with what
one would write in torch (``torch.cat``; ``torch.split`` + ``_foreach_copy_``).
Bandwidth counts bytes read plus bytes written.

On a GPU the kernels run in Triton and each rate is also given as a fraction
of the GPU's peak memory bandwidth. Without a GPU the script says so, times
the CPU torch reference the same way, and exits 0. It prints a table and
writes benchmarks/results/kernels.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ddl_magic import kernels

RESULTS = Path(__file__).parent / "results" / "kernels.json"
# Used when the driver does not report memory clock and bus width.
PEAK_BANDWIDTH_BY_NAME = {"H200": 4.8e12, "H100": 3.35e12}


def main() -> None:
    options = _parse_arguments()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("No GPU present: timing the CPU torch reference instead of the Triton kernels.")
    peak = peak_bandwidth() if device == "cuda" else None
    tensors = model_like_tensors(options.tensors, options.mebibytes, device)
    rows = [
        _measure(name, ours, baseline, moved, device, options.repeats, peak)
        for name, ours, baseline, moved in benchmark_cases(tensors)
    ]
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "backend": kernels.backend_for(tensors[0]),
        "peak_bandwidth_gbps": peak / 1e9 if peak else None,
        "tensors": options.tensors,
        "mebibytes": options.mebibytes,
        "results": rows,
    }
    _print_table(report)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")


def model_like_tensors(count: int, mebibytes: float, device: str) -> list[torch.Tensor]:
    """``count`` float32 tensors of skewed, seeded sizes totalling about ``mebibytes``."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.empty(count).exponential_(generator=generator) ** 3
    sizes = (weights / weights.sum() * mebibytes * 2**20 / 4).long().clamp(min=1)
    return [torch.randn(int(size), device=device) for size in sizes]


def benchmark_cases(tensors: list[torch.Tensor]):
    """(name, ddl_magic call, torch baseline, bytes moved) for each case."""
    sizes = [t.numel() for t in tensors]
    total = sum(sizes)
    device = tensors[0].device
    buffer = torch.empty(total, device=device)
    half_buffer = torch.empty(total, dtype=torch.float16, device=device)

    # The tensors are 1-D, so buffer pieces copy into them as they are.
    def unpack_baseline():
        torch._foreach_copy_(tensors, buffer.split(sizes))

    def unpack_half_baseline():
        torch._foreach_copy_(tensors, half_buffer.split(sizes))
        torch._foreach_mul_(tensors, 2.0)

    return [
        ("pack", lambda: kernels.pack(tensors, buffer), lambda: torch.cat([t.view(-1) for t in tensors], out=buffer),
         8 * total),
        ("unpack", lambda: kernels.unpack(buffer, tensors), unpack_baseline, 8 * total),
        ("pack fp32->fp16 x0.5", lambda: kernels.pack(tensors, half_buffer, 0.5),
         lambda: half_buffer.copy_(torch.cat([t.view(-1) for t in tensors]).mul_(0.5)), 6 * total),
        ("unpack fp16->fp32 x2", lambda: kernels.unpack(half_buffer, tensors, 2.0), unpack_half_baseline, 6 * total),
    ]


def peak_bandwidth() -> float | None:
    """Peak GPU memory bandwidth in bytes/s: from clock and bus width, else by name."""
    properties = torch.cuda.get_device_properties()
    clock_khz = getattr(properties, "memory_clock_rate", 0)
    bus_bits = getattr(properties, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8  # double data rate
    return next((peak for name, peak in PEAK_BANDWIDTH_BY_NAME.items() if name in properties.name), None)


def _measure(name, ours, baseline, moved, device, repeats, peak) -> dict:
    ours_seconds = _median_seconds(ours, device, repeats)
    baseline_seconds = _median_seconds(baseline, device, repeats)
    row = {
        "case": name,
        "ms": ours_seconds * 1e3,
        "gbps": moved / ours_seconds / 1e9,
        "baseline_ms": baseline_seconds * 1e3,
        "baseline_gbps": moved / baseline_seconds / 1e9,
    }
    if peak:
        row["fraction_of_peak"] = moved / ours_seconds / peak
        row["baseline_fraction_of_peak"] = moved / baseline_seconds / peak
    return row


def _median_seconds(run, device, repeats) -> float:
    for _ in range(3):  # warm-up: Triton compiles, the allocator settles
        run()
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            run()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def _print_table(report: dict) -> None:
    print(f"{report['tensors']} tensors, {report['mebibytes']} MiB float32 on {report['device']} "
          f"(ddl_magic backend: {report['backend']})")
    with_peak = report["peak_bandwidth_gbps"] is not None
    if with_peak:
        print(f"peak memory bandwidth {report['peak_bandwidth_gbps']:.0f} GB/s")
    header = f"{'case':<24}{'ddl_magic GB/s':>16}{'torch GB/s':>12}{'speed-up':>10}"
    print(header + (f"{'of peak':>9}" if with_peak else ""))
    for row in report["results"]:
        line = f"{row['case']:<24}{row['gbps']:>16.1f}{row['baseline_gbps']:>12.1f}"
        line += f"{row['baseline_ms'] / row['ms']:>9.2f}x"
        print(line + (f"{row['fraction_of_peak']:>9.0%}" if with_peak else ""))


def _parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=200, help="number of tensors packed together")
    parser.add_argument("--mebibytes", type=float, default=64, help="their total size")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per case (median reported)")
    return parser.parse_args()


if __name__ == "__main__":
    main()
