"""One command that checks ddl_magic on the GPU it runs on and writes down what it found.

    bash benchmarks/gpu_check.sh OUTDIR            # on a GPU machine: installs the project first
    python benchmarks/gpu_check.py OUTDIR --quick  # fewer sizes and steps (about half the time)
    python benchmarks/gpu_check.py OUTDIR --on-cpu # every step tried on the CPU, where no GPU is

Needs torch (its CUDA build), triton, cloudpickle, pyarrow, psutil, pytest, pytest-xdist and
pytest-timeout, and the project installed (``gpu_check.sh`` installs it from this checkout,
without its dependencies and without the network: a GPU machine lent for minutes has
PyTorch's stack and no IPython, Spark or plotly, which none of the steps needs). Steps, each
with its own time limit (about 8 minutes in all on one H100):

1. every CUDA test: ``tests/test_cuda_ipc.py`` (CUDA IPC between ranks), ``tests/test_cuda_plane.py``
   (every Horovod op and the ``ddl`` backend on CUDA tensors through NCCL at np 1 and CUDA IPC
   at np 2 on the one GPU), ``tests/test_kernels.py`` (the Triton kernels compiled for the GPU
   against the torch reference), ``tests/test_gpu_code_path.py``;
2. ``benchmarks/allreduce.py --device cuda --np 2``, 4 KiB .. 256 MiB: ours through CUDA IPC
   against gloo on CUDA tensors and ours over TCP, with the device-to-device copy rate and
   NCCL's allreduce on one rank measured in the same run (the 256 MiB row's target: busbw at
   least 70 % of the copy rate);
3. ``benchmarks/gpu_check_train_step.py``: the MNIST CNN's training step, ours against DDP
   over NCCL.

Writes ``OUTDIR/gpu_check.md`` (the report), ``OUTDIR/gpu_check.json`` and each step's log;
the report also before each step, so a check stopped from outside leaves what it did. Exits
0 when every step passed, 1 otherwise. Without a GPU it writes "no GPU" into the report and
the JSON and exits 0: nothing here can be checked on a CPU (CI runs the same code paths
with gloo standing in for NCCL). ``--on-cpu`` runs every step there all the same, as short as
it goes (the CUDA tests collected, the benchmarks on ``--device cpu``): it checks that the
steps start and finish in an environment like the GPU machine's, before its minutes are
spent (``tests/test_gpu_check.py`` does so in CI).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CUDA_TESTS = ("tests/test_cuda_ipc.py", "tests/test_cuda_plane.py", "tests/test_kernels.py",
              "tests/test_gpu_code_path.py")
SIZES = ("4KiB", "64KiB", "1MiB", "16MiB", "64MiB", "256MiB")
QUICK_SIZES = ("4KiB", "1MiB", "256MiB")
BUDGET_S = 8 * 60


@dataclass
class Step:
    """One step of the check: what ran, how it ended, where its output is."""

    name: str
    command: list[str]
    limit_s: float
    returncode: int | None = None  # None: it ran past its limit and was stopped
    wall_s: float = 0.0
    log: str = ""
    summary: str = ""  # the lines of its output worth reading in the report

    @property
    def passed(self) -> bool:
        return self.returncode == 0


def steps_for(outdir: Path, quick: bool, device: str = "cuda") -> list[Step]:
    """The check's steps on `device`; on "cpu" (`--on-cpu`) each as short as it goes: the CUDA
    tests collected (CI runs what of them runs on a CPU), two sizes of few calls, two training
    steps."""
    python = sys.executable
    on_cpu = device == "cpu"
    sizes = ("4KiB", "1MiB") if on_cpu else QUICK_SIZES if quick else SIZES
    steps = "2" if on_cpu else "100" if quick else "200"
    return [
        Step("CUDA tests", [python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                            *(["--collect-only"] if on_cpu else []), *CUDA_TESTS], 240),
        Step(f"allreduce on {device.upper()} tensors", [
            python, "benchmarks/allreduce.py", "--device", device, "--np", "2", "--sizes", *sizes,
            *(["--quick", "--iterations", "20", "--small-rounds", "1"] if on_cpu
              else ["--repeats", "1"] if quick else [])], 180),
        Step("MNIST CNN step", [python, "benchmarks/gpu_check_train_step.py",
                                str(outdir / "train_step.json"), "--steps", steps, "--device", device], 120),
    ]


def run_step(step: Step, outdir: Path) -> None:
    """Run `step` from the repository root, its output into its log; stopped at its limit."""
    log = outdir / f"{step.name.lower().replace(' ', '_')}.log"
    step.log = str(log)
    started = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(step.command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            step.returncode = process.wait(timeout=step.limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)  # the step's whole tree: it was started in its own session
            process.wait()
    step.wall_s = time.monotonic() - started
    step.summary = summarize(log.read_text(errors="replace"))


def summarize(output: str) -> str:
    """What a step's output says in a few lines: pytest's verdict, the benchmarks' tables."""
    lines = output.splitlines()
    keep = [line for line in lines
            if line.startswith(("issue 38", "GPU ", "allreduce sum", "  size", "MNIST", "  ours",
                                "  ddp", "  plain", "FAILED", "ERROR", "SKIPPED"))
            or " passed" in line or " failed" in line]
    table = [line for line in lines if line.strip()[:1].isdigit() and ("MiB" in line or "KiB" in line)]
    return "\n".join(dict.fromkeys(keep + table)) or "\n".join(lines[-15:])


def describe_machine() -> dict:
    """torch, CUDA and the GPUs, found in a child process so this one never initialises CUDA."""
    probe = ("import json, torch, torch.distributed as d; n = torch.cuda.device_count() "
             "if torch.cuda.is_available() else 0; print(json.dumps({'torch': torch.__version__, "
             "'cuda_build': torch.version.cuda, 'gpus': n, 'nccl': d.is_nccl_available(), "
             "'names': [torch.cuda.get_device_name(i) for i in range(n)]}))")
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    machine = json.loads(found.stdout) if found.returncode == 0 else {"gpus": 0, "probe_error": found.stderr[-500:]}
    try:
        machine["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        machine["triton"] = None
    machine.update(python=platform.python_version(), cpus=os.cpu_count(), system=platform.platform(),
                   load_average=os.getloadavg()[0])
    return machine


def write_report(outdir: Path, machine: dict, steps: list[Step], wall_s: float,
                 not_run: tuple[str, ...] = ()) -> tuple[str, bool]:
    """The report (Markdown) and the JSON: (its verdict, whether everything passed).

    Written before each step too, `not_run` naming the steps still to come: a check stopped
    from outside (the device machine's own time limit) leaves the report of what it did."""
    passed = bool(steps) and all(step.passed for step in steps) and not not_run
    if not_run:
        verdict = (f"INCOMPLETE after {wall_s:.0f} s: not run (yet): {', '.join(not_run)}; the check "
                   "was stopped, or is still running")
    elif not machine["gpus"] and steps:
        verdict = (f"no GPU: every step tried on the CPU (--on-cpu), "
                   f"{'PASSED' if passed else 'FAILED'} in {wall_s:.0f} s; nothing on a GPU was checked")
    elif not machine["gpus"]:
        build = ("" if machine.get("cuda_build") else " This torch is a CPU build: a GPU machine "
                 "needs torch's CUDA build of the same version.")
        verdict = ("no GPU: torch sees no CUDA device here "
                   f"(torch {machine.get('torch')}, CUDA build {machine.get('cuda_build')}); "
                   "nothing was run. CI checks the same code paths on CPU with gloo standing in "
                   f"for NCCL.{build}")
    else:
        verdict = (f"{'PASSED' if passed else 'FAILED'} on {', '.join(machine['names'])} in "
                   f"{wall_s:.0f} s (budget {BUDGET_S} s: {'within' if wall_s <= BUDGET_S else 'OVER'})")
    lines = [f"# ddl_magic GPU check\n\n{verdict}\n", "## Machine\n",
             *[f"- {key}: {value}" for key, value in machine.items()]]
    for step in steps:
        ended = "passed" if step.passed else ("ran past its limit" if step.returncode is None
                                              else f"failed (exit {step.returncode})")
        lines += [f"\n## {step.name}: {ended} in {step.wall_s:.0f} s (limit {step.limit_s:.0f} s)\n",
                  f"`{' '.join(step.command[1:])}` · log: {Path(step.log).name}\n",
                  "```", step.summary, "```"]
    (outdir / "gpu_check.md").write_text("\n".join(lines) + "\n")
    results = {"verdict": verdict, "gpu": bool(machine["gpus"]), "passed": passed if steps else None,
               "not_run": list(not_run),
               "wall_s": wall_s, "machine": machine, "steps": [asdict(step) for step in steps]}
    for name in ("allreduce", "train_step"):  # the benchmarks' own JSON, beside the report
        path = ROOT / "benchmarks" / "results" / f"{name}.json" if name == "allreduce" \
            else outdir / "train_step.json"
        if machine["gpus"] and path.exists():
            results[name] = json.loads(path.read_text())
    (outdir / "gpu_check.json").write_text(json.dumps(results, indent=2))
    return verdict, passed


def report(outdir: Path, machine: dict, steps: list[Step], wall_s: float) -> bool:
    """The final report, said on the terminal too; whether everything passed."""
    verdict, passed = write_report(outdir, machine, steps, wall_s)
    print(verdict)
    print(f"report: {outdir / 'gpu_check.md'}")
    return passed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", type=Path, help="where the report, the JSON and the logs go")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and steps")
    parser.add_argument("--on-cpu", action="store_true",
                        help="where no GPU is: run every step on the CPU all the same")
    args = parser.parse_args()
    args.outdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    machine = describe_machine()
    if not machine["gpus"] and not args.on_cpu:
        report(args.outdir, machine, [], time.monotonic() - started)
        return 0
    steps = steps_for(args.outdir.resolve(), args.quick, "cuda" if machine["gpus"] else "cpu")
    for index, step in enumerate(steps):
        write_report(args.outdir, machine, steps[:index], time.monotonic() - started,
                     not_run=tuple(later.name for later in steps[index:]))
        print(f"{step.name} (at most {step.limit_s:.0f} s) ...", flush=True)
        run_step(step, args.outdir)
        print(f"  {'passed' if step.passed else 'FAILED'} in {step.wall_s:.0f} s", flush=True)
    return 0 if report(args.outdir, machine, steps, time.monotonic() - started) else 1


if __name__ == "__main__":
    sys.exit(main())
