"""README.md says what is true: its marked blocks run, its commands are the ones CI runs,
and the files it names exist.

A fenced block preceded by ``<!-- readme-test: KIND -->`` is checked here:

- ``demo``: the install-and-run-the-demo command; its install steps are checked, its last
  step runs (with this interpreter);
- ``ci``: the install-and-test command, which must be exactly what ``.ci/run`` runs;
- ``notebook``: installing what the labs need and starting JupyterLab on lab 01 with the
  clone's jupyter_lab_config.py; the extra it names must exist and be installed here, the
  notebook must exist (tests/test_browser.py starts JupyterLab this way);
- ``cell``: a notebook cell; the cells run one after another, each as a cell of its own, in
  a real kernel.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from kernel import Kernel

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
MARKED_BLOCK = re.compile(r"<!-- readme-test: (\w+) -->\n```(\w+)\n(.*?)\n```", re.DOTALL)
KNOWN_KINDS = {"demo", "ci", "notebook", "cell"}


def blocks(kind: str) -> list[str]:
    found = [body for marked, _, body in MARKED_BLOCK.findall(README) if marked == kind]
    assert found, f"README.md has no block marked <!-- readme-test: {kind} -->"
    return found


def one_block(kind: str) -> str:
    (body,) = blocks(kind)
    return body


def steps(command_line: str) -> list[list[str]]:
    """A shell line's `&&`-separated commands, each as its words."""
    return [shlex.split(part) for part in command_line.split(" && ")]


def in_this_environment(words: list[str]) -> list[str]:
    """The README's `.venv/bin/X` as this environment's X (the tests may run from another venv)."""
    bin_dir = Path(sys.executable).parent
    return [str(bin_dir / word.removeprefix(".venv/bin/")) if word.startswith(".venv/bin/") else word
            for word in words]


def extras_of(install: list[str]) -> list[str]:
    """The extras an editable install of this repository names: `-e ".[a,b]"` -> [a, b]."""
    target = install[install.index("-e") + 1]
    found = re.fullmatch(r"\.(?:\[([\w,]+)\])?", target)
    assert found, f"the README installs {target!r}; it should install this clone: -e . or -e '.[extra]'"
    return found.group(1).split(",") if found.group(1) else []


def unmet_requirements(extra: str) -> list[str]:
    """The requirements of this package's `extra` that the environment does not satisfy."""
    unmet = []
    for line in metadata.requires("ddl_magic") or []:
        requirement = Requirement(line)
        if requirement.marker is None or not requirement.marker.evaluate({"extra": extra}):
            continue
        if requirement.name == "ddl_magic":  # an extra made of extras
            unmet += [u for inner in requirement.extras for u in unmet_requirements(inner)]
            continue
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{requirement} (not installed)")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            unmet.append(f"{requirement} (installed: {version})")
    return unmet


def test_every_marked_block_is_of_a_known_kind():
    kinds = {kind for kind, _, _ in MARKED_BLOCK.findall(README)}
    assert kinds <= KNOWN_KINDS, f"unknown readme-test kinds: {kinds - KNOWN_KINDS}"
    assert README.count("<!-- readme-test:") == len(MARKED_BLOCK.findall(README)), (
        "a readme-test marker must sit right above its fenced block")


def test_the_test_command_is_exactly_what_ci_runs():
    assert one_block("ci") in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_the_install_commands_pin_torch_first_and_name_real_extras():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    for kind in ("demo", "ci", "notebook"):
        first_line = one_block(kind).splitlines()[0]
        commands = steps(first_line)
        assert commands[0] == ["python3", "-m", "venv", ".venv"], first_line
        installs = [c for c in commands if c[:2] == [".venv/bin/pip", "install"]]
        assert "torch==2.13.0" in installs[0], f"torch must be installed first, pinned: {first_line}"
        for extra in extras_of(installs[1]):
            assert extra in declared, f"README's {kind} command installs the extra {extra!r}, which pyproject.toml lacks"


def test_the_labs_extra_is_installed_here_with_a_pandas_that_pyspark_supports():
    (install,) = [c for c in steps(one_block("notebook").splitlines()[0]) if "-e" in c]
    assert extras_of(install) == ["examples"]
    assert unmet_requirements("examples") == []
    assert int(metadata.version("pandas").split(".")[0]) < 3  # pyspark warns at every conversion


def jupyterlab_config() -> Path:
    """The config file the README's JupyterLab command names (`--config=FILE`)."""
    (start,) = steps(one_block("notebook").splitlines()[1])
    assert start[:2] == [".venv/bin/jupyter", "lab"] and start[2].startswith("--config="), start
    return ROOT / start[2].removeprefix("--config=")


def test_the_notebook_command_starts_jupyterlab_on_lab_01():
    config = jupyterlab_config()
    assert config.is_file(), f"{config} does not exist"
    first_lab = re.search(r'^FIRST_LAB = LABS \+ "(.+)"$', config.read_text(), re.MULTILINE).group(1)
    assert (ROOT / "example_notebooks" / first_lab).is_file()
    assert f"/lab/tree/example_notebooks/{first_lab}?token=" in README, "the README shows the URL it prints"
    assert Path(in_this_environment([".venv/bin/jupyter-lab"])[0]).exists(), "the extra installs no JupyterLab"


@pytest.mark.timeout(90)
def test_the_demo_command_trains_and_writes_the_timeline_files_the_readme_names():
    demo = in_this_environment(steps(one_block("demo"))[-1])
    finished = subprocess.run(demo, cwd=ROOT, capture_output=True, text=True, timeout=80,
                              env={**os.environ, "DDL_MAGIC_DISPLAY": "text"})
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "accuracy:" in finished.stdout
    timeline = Path(re.search(r"^timeline: (\S+)$", finished.stdout, re.MULTILINE).group(1))
    assert timeline.is_file() and timeline.with_suffix(".arrow").is_file()
    assert f"`{timeline.name}`" in README and f"`{timeline.with_suffix('.arrow').name}`" in README
    assert_the_readmes_timeline_line_has_the_shape_of(finished.stdout)


def test_cell_magic_lines_open_their_cells():
    for block in re.findall(r"```python\n(.*?)\n```", README, re.DOTALL):
        for number, line in enumerate(block.splitlines()):
            assert not (line.startswith("%%") and number > 0), (
                f"{line!r} is not the first line of its README block; pasted as one cell it fails")


@pytest.mark.timeout(120)
def test_the_first_cells_run_in_a_kernel_as_two_cells():
    first, second, *_ = blocks("cell")
    kernel = Kernel(env={"DDL_MAGIC_DISPLAY": "text"})
    try:
        loaded = kernel.run(first)
        assert loaded.error is None, loaded.error
        ran = kernel.run(second, timeout=90)
        assert ran.error is None, ran.error
        for rank in range(2):
            assert re.search(rf"\[{rank}\] rank {rank} of 2: loss \d", ran.stdout), ran.stdout
        assert float(ran.result) > 0
    finally:
        kernel.close()


@pytest.mark.timeout(240)
def test_the_pool_cells_run_one_after_another_on_ranks_that_keep_their_state():
    first, _, *rest = blocks("cell")
    pool_cells = rest[:rest.index("%horovod stop") + 1]
    assert pool_cells[0].startswith("%horovod start")
    kernel = Kernel(env={"DDL_MAGIC_DISPLAY": "text"})
    try:
        assert kernel.run(first).error is None
        printed = ""
        for cell in pool_cells:
            ran = kernel.run(cell, timeout=120)
            assert ran.error is None, (cell, ran.error, ran.text)
            printed += ran.text
        report = re.search(r"captured lr \(float\) · the ranks' own: ([\w, ]+)", printed)
        assert report and {"model", "optimizer"} <= {name.strip() for name in report.group(1).split(",")}, printed
        assert kernel.run("type(trained_model).__name__").result == "'Linear'"
    finally:
        kernel.close()


@pytest.mark.timeout(120)
def test_the_data_cells_give_each_rank_its_share_and_say_what_an_epoch_reads():
    first, *rest = blocks("cell")
    data_cells = rest[rest.index("%horovod stop") + 1:]
    assert data_cells[-1].startswith("%%horovod -np 2 --data train=df")
    kernel = Kernel(env={"DDL_MAGIC_DISPLAY": "text"})
    try:
        outputs = [kernel.run(cell, timeout=90) for cell in [first, *data_cells]]
        assert all(output.error is None for output in outputs), [o.error for o in outputs]
        printed = outputs[-1].text
        for line in re.findall(r"^(?:ddl_magic: train|\[0\] train): .*$", README, re.MULTILINE):
            assert line in printed, (line, printed)
        assert outputs[-1].result == "7"
    finally:
        kernel.close()


def test_the_files_it_names_exist():
    named = set(re.findall(r"\]\(((?:docs|example_notebooks|tests|benchmarks|ddl_magic)/[^)#]+)\)", README))
    named |= set(re.findall(r"`((?:docs|example_notebooks|tests|benchmarks|ddl_magic|kernels)/[\w./-]+)`", README))
    named |= {f"example_notebooks/{name}" for name in re.findall(r"`(\d\d_\w+\.ipynb)`", README)}
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"README.md names files that do not exist: {missing}"
    assert len(named) > 10


def test_the_house_names_every_folder_of_the_package_and_the_layers_are_the_checked_ones():
    house = README.split("## How it is built", 1)[1].split("\n## ", 1)[0]
    folders = {path.parent.relative_to(ROOT / "ddl_magic").as_posix()
               for path in (ROOT / "ddl_magic").glob("*/__init__.py")}
    drawn = set(re.findall(r"(?<![\w/.])(\w+)/ ", house))
    assert folders <= drawn, folders - drawn
    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"][0]["layers"]
    written = re.search(r"Layers, top down: (.*?)\.", house, re.DOTALL).group(1)
    assert re.findall(r"`(\w+)`", written) == [name for layer in layers
                                                for name in layer.split(" | ")]


# ---- the README says what the code prints (issue 41: drift between them) ----------------------

def section(title: str) -> str:
    """The README's text under the heading `title`, up to the next heading of any level."""
    return re.split(r"\n#+ ", README.split(f"\n## {title}\n", 1)[1], maxsplit=1)[0]


def written_options(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(-np|-o|--[a-z][a-z-]*)\b", text))


def test_the_synopsis_and_the_option_table_name_every_option_of_the_magic_and_no_other():
    from ddl_magic.frontends.magic import HorovodMagics

    parsed = {flags[0] if flags[0] in ("-np", "-o") else flags[-1]
              for action in HorovodMagics.horovod.parser._actions
              if (flags := action.option_strings) and flags != ["-h", "--help"]}
    magic = section("`%%horovod`")
    synopsis = re.search(r"```\n(%%horovod .*?)\n```", magic, re.DOTALL).group(1)
    table = "\n".join(line.split(" | ")[0] for line in magic.splitlines() if line.startswith("| `"))
    assert written_options(synopsis) == parsed, (
        f"the synopsis lacks {sorted(parsed - written_options(synopsis))}, "
        f"names {sorted(written_options(synopsis) - parsed)} that %%horovod? does not")
    assert written_options(table) == parsed, (
        f"the option table lacks {sorted(parsed - written_options(table))}, "
        f"names {sorted(written_options(table) - parsed)} that %%horovod? does not")


def test_the_pool_table_names_every_option_that_starts_a_pool():
    from ddl_magic.frontends.options import LAUNCH_OPTIONS

    accepted = {option.flags[0] for option in LAUNCH_OPTIONS}  # --max-restarts is refused there
    (row,) = [line for line in README.splitlines() if line.startswith("| `%horovod start ")]
    written = written_options(row.split(" | ")[0])
    assert written == accepted, f"lacks {sorted(accepted - written)}, names {sorted(written - accepted)}"


def assert_the_readmes_timeline_line_has_the_shape_of(printed: str) -> None:
    """The README's example `[timeline]` line and its sketch of the live table name the kinds
    of time that a run like the demo's prints: the same words, as many shares per rank."""
    (example,) = re.findall(r"^\[timeline\] .*$", README, re.MULTILINE)
    numbers = r"(?:\d+(?:\.\d+)?|–)"
    shape = re.sub(r"\d+(?:\.\d+)?", lambda _: numbers, re.escape(example))
    last = re.findall(r"^\[timeline\] .*$", printed, re.MULTILINE)[-1]
    assert re.fullmatch(shape, last), f"the README's line\n  {example}\nthe demo's\n  {last}"
    words = re.search(r"% of time ([a-z/]+):", example).group(1).split("/")
    sketch = re.search(r"^timeline so far\n(rank .*)$", README, re.MULTILINE).group(1)
    from ddl_magic.timeline.lanes import KINDS
    from ddl_magic.timeline.live import _KIND_WORDS

    assert re.findall(r"(\w+) %", sketch) == [kind for kind in KINDS if _KIND_WORDS[kind] in words], sketch
