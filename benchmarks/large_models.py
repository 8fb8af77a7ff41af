"""The large-model stack over the ``ddl`` backend: HSDP and FSDP2 steps against gloo, a DCP
checkpoint against ``torch.save``, and each rank's peak memory under DDP, ZeRO-1 and FSDP2.

    python benchmarks/large_models.py                 # everything (~10 minutes on 2 cores)
    python benchmarks/large_models.py --quick         # smoke run: fewer steps, a 40M model
    python benchmarks/large_models.py --only steps    # steps | checkpoint | memory

Steps: ``train_step.py``'s MLP (784-512-512-10, batch 64 per rank, SGD, one torch thread per
rank) at np 4, every Linear then the model under ``fully_shard``: HSDP on a 2x2 mesh
(replicate x shard) and FSDP2 on a 1-D mesh of 4. Both backends run the same code on ranks
started by ddl_magic's launcher, interleaved; the slowest rank's median step of the less
disturbed run is reported, and ddl/gloo against the target 0.7.

Checkpoint: a 151M-parameter model (nine 4096x4096 Linear layers, 604 MB of float32) under
FSDP2 at np 4, made on the meta device so no rank ever holds all of it.
``dcp.save`` of its state dict (every rank writes its quarter, fsynced, as DCP does by default)
against every rank ``torch.save``-ing the same tensors to a file of its own, fsynced too: the
same bytes from the same ranks. Also shown: one process ``torch.save``-ing all 604 MB.
Target: DCP within 1.2x of the same bytes.

Memory: the same 151M model with Adam at np 4, one step, each rank's peak resident memory
(``VmHWM``): plain DDP, ZeRO-1 (``hvd.DistributedOptimizer(shard_optimizer_state=True)``) and
FSDP2, next to what the ZeRO paper's accounting predicts (16 bytes a parameter with Adam in
float32: DDP 16P, ZeRO-1 8P + 8P/N, FSDP2 16P/N) and the baseline of a rank that has
imported torch. Needs about 12 GB free for DDP's four ranks. Target: FSDP2 at most 1/3 of DDP.

Prints the tables and writes ``benchmarks/results/large_models.json``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from common import (best_of, interleaved, print_table, run_ours, slowest_rank, summarize,
                    time_iterations, warn_if_busy, write_results)
from train_step import WORKLOADS, mlp, training_step

NP = 4
MLP = WORKLOADS["mlp"]
BACKENDS = ("gloo", "ddl")
LAYOUTS = {"hsdp": "HSDP 2x2", "fsdp2": "FSDP2 1-D"}
TARGET_STEP_RATIO = 0.7
TARGET_CHECKPOINT_RATIO = 1.2
TARGET_FSDP2_OVER_DDP = 1 / 3
WIDTH = 4096
LAYERS, QUICK_LAYERS = 9, 3  # 151M parameters; 50M for --quick


# ---- on the ranks ---------------------------------------------------------------------------

def fully_sharded(model: nn.Module, layout: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    size = dist.get_world_size()
    mesh = (init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("replicate", "shard"))
            if layout == "hsdp" else init_device_mesh("cpu", (size,)))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def timed_steps(backend: str, layout: str, steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    model = fully_sharded(mlp(MLP.layers), layout)
    step = training_step(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                         dist.get_rank(), MLP)
    return summarize(time_iterations(step, dist.barrier, steps, warmup))


def big_model(layers: int) -> nn.Module:
    """`layers` Linear(4096, 4096), on the meta device: nothing allocated yet."""
    with torch.device("meta"):
        return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def materialized(model: nn.Module) -> nn.Module:
    """Allocate a (sharded) meta model on the CPU and fill it, each rank its own share."""
    model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.01)
    return model


def checkpoint_times(layers: int, folder: str) -> dict:
    """Seconds for dcp.save of the sharded model, and for torch.save of this rank's shards."""
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dist.init_process_group("ddl")
    model = materialized(fully_sharded(big_model(layers), "fsdp2"))
    state = model.state_dict()
    rank = dist.get_rank()
    dist.barrier()
    started = time.perf_counter()
    dcp.save(state, checkpoint_id=os.path.join(folder, "dcp"))
    dcp_s = time.perf_counter() - started
    dist.barrier()
    started = time.perf_counter()
    path = os.path.join(folder, f"torch-save-{rank}.pt")
    shards = {name: tensor.to_local() for name, tensor in state.items()}
    with open(path, "wb") as file:
        torch.save(shards, file)
        file.flush()
        os.fsync(file.fileno())
    same_bytes_s = time.perf_counter() - started
    dist.barrier()
    return {"dcp_s": dcp_s, "torch_save_s": same_bytes_s,
            "bytes": sum(t.numel() * t.element_size() for t in shards.values())}


def peak_memory(strategy: str, layers: int) -> dict:
    """One step of Adam under `strategy`; this rank's peak resident bytes, and its baseline."""
    torch.set_num_threads(1)
    baseline = _resident("VmRSS")
    dist.init_process_group("ddl")
    if strategy == "fsdp2":
        model = materialized(fully_sharded(big_model(layers), "fsdp2"))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    else:
        model = materialized(big_model(layers))
        if strategy == "zero1":
            import ddl_magic.torch as hvd

            hvd.init()
            optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4),
                                                 named_parameters=model.named_parameters(),
                                                 shard_optimizer_state=True)
        else:
            model = nn.parallel.DistributedDataParallel(model)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    inputs = torch.randn(8, WIDTH)
    optimizer.zero_grad()
    model(inputs).square().mean().backward()
    optimizer.step()
    return {"peak_bytes": _resident("VmHWM"), "baseline_bytes": baseline,
            "parameters": sum(p.numel() for p in model.parameters())}  # a DTensor's: the whole


def _resident(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


# ---- in the benchmark's process -------------------------------------------------------------

def measure_steps(args) -> dict:
    sides = [(layout, backend) for layout in LAYOUTS for backend in BACKENDS]
    measured = interleaved(args.repeats, *[
        partial(run_ours, timed_steps, NP, backend=backend, layout=layout, steps=args.steps,
                warmup=args.warmup) for layout, backend in sides])
    summaries = {f"{layout}_{backend}": best_of([slowest_rank(ranks) for ranks in repeats])
                 for (layout, backend), repeats in zip(sides, measured)}
    ratios = {layout: summaries[f"{layout}_ddl"]["median_s"] / summaries[f"{layout}_gloo"]["median_s"]
              for layout in LAYOUTS}
    print_table(f"train step, {MLP.title}, np={NP}: median ms of the slowest rank",
                ["layout", "gloo ms", "ddl ms", "ddl/gloo", "target", "verdict"],
                [[LAYOUTS[layout], f"{summaries[f'{layout}_gloo']['median_s'] * 1e3:.2f}",
                  f"{summaries[f'{layout}_ddl']['median_s'] * 1e3:.2f}", f"{ratios[layout]:.2f}",
                  f"<={TARGET_STEP_RATIO}", "meets" if ratios[layout] <= TARGET_STEP_RATIO else "MISSES"]
                 for layout in LAYOUTS])
    return {"sides": summaries, "ddl_over_gloo": ratios}


def measure_checkpoint(layers: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="ddl-dcp-bench-") as folder:
        ranks = run_ours(checkpoint_times, NP, layers=layers, folder=folder)
        whole = materialized(big_model(layers))
        path = os.path.join(folder, "whole.pt")
        started = time.perf_counter()
        with open(path, "wb") as file:
            torch.save(whole.state_dict(), file)
            file.flush()
            os.fsync(file.fileno())
        whole_s = time.perf_counter() - started
        del whole
    dcp_s = max(rank["dcp_s"] for rank in ranks)
    same_bytes_s = max(rank["torch_save_s"] for rank in ranks)
    total = sum(rank["bytes"] for rank in ranks)
    ratio = dcp_s / same_bytes_s
    print_table(f"saving {total / 1e6:.0f} MB of FSDP2 state ({layers} x Linear({WIDTH}, {WIDTH})), "
                f"np={NP}, fsynced: seconds of the slowest rank",
                ["dcp.save", "torch.save, each rank its shards", "ratio", "target", "verdict",
                 "torch.save, one process, all"],
                [[f"{dcp_s:.2f}", f"{same_bytes_s:.2f}", f"{ratio:.2f}", f"<={TARGET_CHECKPOINT_RATIO}",
                  "meets" if ratio <= TARGET_CHECKPOINT_RATIO else "MISSES", f"{whole_s:.2f}"]])
    return {"bytes": total, "dcp_s": dcp_s, "torch_save_same_bytes_s": same_bytes_s,
            "torch_save_one_process_s": whole_s, "ratio": ratio, "ranks": ranks}


def predicted_bytes(strategy: str, parameters: int, np: int) -> float:
    """The ZeRO paper's accounting, float32 with Adam: 4 bytes each of parameter, gradient and
    the two moments."""
    return {"ddp": 16 * parameters, "zero1": 8 * parameters + 8 * parameters / np,
            "fsdp2": 16 * parameters / np}[strategy]


def measure_memory(layers: int) -> dict:
    results = {}
    for strategy in ("ddp", "zero1", "fsdp2"):
        ranks = run_ours(peak_memory, NP, strategy=strategy, layers=layers)
        results[strategy] = {"peak_bytes": max(r["peak_bytes"] for r in ranks),
                             "baseline_bytes": max(r["baseline_bytes"] for r in ranks),
                             "parameters": ranks[0]["parameters"]}
    ratio = results["fsdp2"]["peak_bytes"] / results["ddp"]["peak_bytes"]
    print_table(f"peak resident memory per rank, {results['ddp']['parameters'] / 1e6:.0f}M parameters "
                f"+ Adam, one step, np={NP} (GB; the most of any rank)",
                ["strategy", "peak", "baseline (torch imported)", "peak - baseline", "ZeRO accounting"],
                [[name, f"{r['peak_bytes'] / 1e9:.2f}", f"{r['baseline_bytes'] / 1e9:.2f}",
                  f"{(r['peak_bytes'] - r['baseline_bytes']) / 1e9:.2f}",
                  f"{predicted_bytes(name, r['parameters'], NP) / 1e9:.2f}"]
                 for name, r in results.items()])
    verdict = "meets" if ratio <= TARGET_FSDP2_OVER_DDP else "MISSES"
    print(f"FSDP2 / DDP peak: {ratio:.2f} (target <= {TARGET_FSDP2_OVER_DDP:.2f}: {verdict})")
    return {"strategies": results, "fsdp2_over_ddp": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["steps", "checkpoint", "memory"], action="append")
    parser.add_argument("--steps", type=int, help="timed steps per run (default 200, --quick 30)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, help="runs of each step side (default 2, --quick 1)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    args.steps = args.steps or (30 if args.quick else 200)
    args.repeats = args.repeats or (1 if args.quick else 2)
    layers = QUICK_LAYERS if args.quick else LAYERS
    parts = args.only or ["steps", "checkpoint", "memory"]
    started = time.perf_counter()
    load_before = warn_if_busy()
    results = {}
    if "steps" in parts:
        results["steps"] = measure_steps(args)
    if "checkpoint" in parts:
        results["checkpoint"] = measure_checkpoint(layers)
    if "memory" in parts:
        results["memory"] = measure_memory(layers)
    path = write_results("large_models", {
        "settings": {"np": NP, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                     "big_model_layers": layers, "width": WIDTH},
        "targets": {"step_ddl_over_gloo": TARGET_STEP_RATIO, "dcp_over_torch_save": TARGET_CHECKPOINT_RATIO,
                    "fsdp2_over_ddp_peak": TARGET_FSDP2_OVER_DDP},
        **results, "load_average_before": load_before, "wall_s": time.perf_counter() - started})
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
