"""`ddlrun` from a terminal: Python commands as `python` runs them, prefixed output, failures, a
killed rank, Ctrl-C, bad usage."""

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

# What every form of Python command runs below: each rank reports how it was started and
# takes part in an allreduce, then rank 1 exits with the status its last argument names.
REPORTS_AND_EXITS = """
import os, sys, torch, ddl_magic.torch as hvd
hvd.init()
total = int(hvd.allreduce(torch.tensor(1), op=hvd.Sum))
print(f"rank {hvd.rank()}: {__name__} {os.path.basename(sys.argv[0])} {sys.argv[1:]} sum {total}")
hvd.barrier()
sys.exit(int(sys.argv[-1]) if hvd.rank() == 1 else 0)
"""

SCRIPTS = {
    "reports.py": REPORTS_AND_EXITS,
    "reporting_module.py": REPORTS_AND_EXITS,
    "reporting_package/__init__.py": "",
    "reporting_package/__main__.py": REPORTS_AND_EXITS,
    "hello.py": """
import ddl_magic.torch as hvd
hvd.init()
print(f"hello from {hvd.rank()} of {hvd.size()}")
""",
    "raises.py": """
import ddl_magic.torch as hvd, torch
hvd.init()
hvd.allreduce(torch.ones(4))
if hvd.rank() == 1:
    raise ValueError("rank one is unhappy")
hvd.allreduce(torch.ones(4))
""",
    "exits.py": """
import sys, ddl_magic.torch as hvd
hvd.init()
sys.exit(3 if hvd.rank() == 2 else 0)
""",
    "progress.py": """
import sys
for step in range(1, 51):
    sys.stdout.write(f"\\rtraining {2 * step}%")
    sys.stdout.flush()
sys.stdout.write("\\n")
print("finished")
""",
    "straggler.py": """
import threading, torch, ddl_magic.torch as hvd
hvd.init()
if hvd.rank() == 1:
    threading.Event().wait(2.5)  # rank 1 is late to submit: long enough for a stall warning
hvd.allreduce(torch.ones(2), name="late.gradient")
""",
    "long_allreduce.py": """
import os, torch, ddl_magic.torch as hvd
hvd.init()
tensor = torch.ones(8 * 1024 * 1024)
hvd.allreduce(tensor)
print(f"READY {os.getpid()}", flush=True)
while True:
    hvd.allreduce(tensor)
""",
    "last_words.py": """
import os, signal, sys, ddl_magic.torch as hvd
hvd.init()
if hvd.rank() == 1:
    print("KILL_AT the next line", flush=True)
    sys.stderr.write("a line it never finished")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
hvd.barrier()
""",
    "segfault.py": """
import ctypes, ddl_magic.torch as hvd
hvd.init()
if hvd.rank() == 1:
    ctypes.string_at(0)
hvd.barrier()
""",
}


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scripts")
    for name, text in SCRIPTS.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(text)
    return folder


def ddlrun(*args, cwd):
    return subprocess.run([sys.executable, "-m", "ddl_magic.frontends.ddlrun", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


class LiveDdlrun:
    """A ddlrun whose output is read line by line as it comes, to act on it mid-run."""

    def __init__(self, *args, cwd, sigint=signal.SIG_DFL):
        self.process = subprocess.Popen([sys.executable, "-m", "ddl_magic.frontends.ddlrun", *args], cwd=cwd,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, prefix, timeout=60):
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            assert line is not None, f"ddlrun ended before printing {prefix!r}: {self.seen}"
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def ranks_ready(self, np):
        """{rank: pid} once every rank has printed 'READY pid'."""
        ready = {}
        while len(ready) < np:
            line = self.wait_for("[")
            if " READY " in line:
                ready[int(line[1:line.index("]")])] = int(line.split()[-1])
        return ready

    def rest(self, timeout=30):
        self.process.wait(timeout=timeout)
        while (line := self.lines.get(timeout=timeout)) is not None:
            self.seen.append(line)
        return "\n".join(self.seen)


def process_exists(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("command, argv0", [
    (["python", "reports.py"], "reports.py"),
    (["reports.py"], "reports.py"),
    (["python", "-m", "reporting_module"], "reporting_module.py"),
    (["python", "-m", "reporting_package"], "__main__.py"),
    (["python", "-u", "-c", REPORTS_AND_EXITS], "-c"),
], ids=["python script", "script", "python -m module", "python -m package", "python -c"])
def test_a_python_command_runs_on_every_rank_as_python_runs_it(scripts, command, argv0):
    result = ddlrun("-np", "2", *command, "--flag", "3", cwd=scripts)
    assert result.returncode == 3, result.stderr  # rank 1's sys.exit(3)
    assert "rank 1" in result.stderr and "exit code 3" in result.stderr
    for rank in range(2):
        assert f"[{rank}] rank {rank}: __main__ {argv0} ['--flag', '3'] sum 2" in result.stdout


def test_code_given_with_c_is_quoted_in_its_traceback(scripts):
    code = "import sys\nraise ValueError('unhappy with ' + sys.argv[1])"
    result = ddlrun("-np", "2", "python", "-c", code, "everything", cwd=scripts)
    assert result.returncode == 1
    assert 'File "<string>", line 2, in <module>' in result.stderr
    assert "raise ValueError('unhappy with ' + sys.argv[1])" in result.stderr
    assert "ValueError: unhappy with everything" in result.stderr


def test_every_line_is_prefixed_with_its_rank(scripts):
    result = ddlrun("-np", "3", "python", "hello.py", cwd=scripts)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for rank in range(3):
        assert f"[{rank}] hello from {rank} of 3" in lines


def test_a_raising_rank_fails_the_run_with_its_traceback_once(scripts):
    result = ddlrun("-np", "3", "python", "raises.py", cwd=scripts)
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert output.count("Traceback") == 1
    assert "rank 1" in output and "ValueError: rank one is unhappy" in output
    assert 'raises.py", line 6' in output


def test_exit_code_is_that_of_the_failing_rank(scripts):
    result = ddlrun("-np", "3", "exits.py", cwd=scripts)
    assert result.returncode == 3
    assert "rank 2" in result.stderr and "exit code 3" in result.stderr


def test_a_progress_bar_redrawn_with_carriage_returns_stays_one_line(scripts):
    result = ddlrun("-np", "2", "progress.py", cwd=scripts)
    assert result.returncode == 0
    for rank in range(2):
        lines = [line for line in result.stdout.splitlines() if line.startswith(f"[{rank}] ")]
        # The bar's final state, then the next line; at most an occasional redraw before it
        # (a terminal shows a long bar's progress every few seconds), never all fifty.
        assert lines[-2:] == [f"[{rank}] training 100%", f"[{rank}] finished"]
        assert len(lines) <= 4


def test_a_tensor_missing_on_some_ranks_is_reported_as_a_stall(scripts):
    result = ddlrun("-np", "3", "--env", "HOROVOD_STALL_CHECK_TIME_SECONDS=1", "straggler.py",
                    cwd=scripts)
    assert result.returncode == 0
    warning = next(line for line in result.stderr.splitlines() if "stall" in line)
    assert warning.startswith("[0] ddl_magic warning")
    assert "'late.gradient'" in warning and "ranks [1] have not submitted it" in warning


def test_killed_rank_stops_the_run_within_two_seconds_leaving_no_process(scripts):
    run = LiveDdlrun("-np", "3", "python", "long_allreduce.py", cwd=scripts)
    ready = run.ranks_ready(3)
    killed_at = time.monotonic()
    os.kill(ready[1], signal.SIGKILL)
    output = run.rest(timeout=10)
    elapsed = time.monotonic() - killed_at
    assert run.process.returncode == 128 + signal.SIGKILL
    assert elapsed < 2.0, f"ddlrun took {elapsed:.2f} s to stop after a rank was killed"
    assert "rank 1" in output and "killed by SIGKILL" in output
    assert not [pid for pid in ready.values() if process_exists(pid)]


def log_dir(output):
    return output.split("full logs in ")[-1].split()[0]


def test_a_rank_killed_hard_keeps_its_last_words_even_an_unfinished_line(scripts):
    run = LiveDdlrun("-np", "2", "python", "last_words.py", cwd=scripts)
    output = run.rest(timeout=60)
    assert run.process.returncode == 128 + signal.SIGKILL
    lines = output.splitlines()
    said = lines.index("[1] KILL_AT the next line")
    unfinished = lines.index("[1] a line it never finished")
    failed = next(i for i, line in enumerate(lines) if "rank 1" in line and "killed by SIGKILL" in line)
    assert said < unfinished < failed  # shown before the rank is reported failed
    with open(os.path.join(log_dir(output), "rank-1.log")) as log:
        assert log.read().splitlines()[-2:] == ["KILL_AT the next line", "a line it never finished"]


def test_a_segfault_shows_the_python_stack_of_every_thread(scripts):
    result = ddlrun("-np", "2", "python", "segfault.py", cwd=scripts)
    assert result.returncode == 128 + signal.SIGSEGV
    assert "[1] Fatal Python error: Segmentation fault" in result.stdout + result.stderr
    assert 'segfault.py", line 5 in <module>' in result.stdout + result.stderr
    assert "killed by SIGSEGV" in result.stderr


@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN], ids=["default", "ignored"])
def test_ctrl_c_stops_every_rank(scripts, inherited):
    # "ignored": as a background job of a script, or some CI runners, start it.
    run = LiveDdlrun("-np", "2", "python", "long_allreduce.py", cwd=scripts, sigint=inherited)
    ready = run.ranks_ready(2)
    run.process.send_signal(signal.SIGINT)
    output = run.rest(timeout=10)
    assert run.process.returncode == 130
    assert "interrupted" in output
    assert not [pid for pid in ready.values() if process_exists(pid)]


@pytest.mark.parametrize("args, message", [
    (["-np", "2"], "give the command to run"),
    (["-np", "2", "python", "missing.py"], "not found"),
    (["-np", "2", "ls", "-l"], "'ls' is not a Python script. ddlrun runs a Python command"),
    (["-np", "2", "python"], "give the script to run after 'python'"),
    (["-np", "2", "python", "-m"], "-m needs the module to run"),
    (["-np", "2", "python", "-m", "no_such_module"], "module 'no_such_module' not found"),
    (["-np", "2", "python", "-c"], "-c needs the code to run"),
    (["-np", "2", "python", "-O", "hello.py"], "python option '-O' is not passed on"),
    (["-np", "0", "hello.py"], "-np must be at least 1"),
    (["-np", "2", "--env", "NOEQUALS", "hello.py"], "expected KEY=VALUE"),
])
def test_bad_usage_says_what_to_do(scripts, args, message):
    result = ddlrun(*args, cwd=scripts)
    assert result.returncode == 2
    assert message in result.stderr


def test_a_script_in_another_folder_imports_the_modules_beside_it(tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "helpers.py").write_text("GREETING = 'hello from beside the script'\n")
    (folder / "train.py").write_text("import helpers\nprint(helpers.GREETING)\n")
    result = ddlrun("-np", "2", "python", "project/train.py", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[0] hello from beside the script" in result.stdout
    assert "[1] hello from beside the script" in result.stdout
