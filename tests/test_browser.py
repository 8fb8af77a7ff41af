"""A person's view, following the README's own path: JupyterLab started with the README's
command (from the `examples` extra, which tests/test_readme.py checks is installed) in a git
clone of the labs, lab 01 opened from the URL JupyterLab printed and run top to bottom, then
saved (the clone stays clean), then a `%%horovod --timeline` notebook, in headless Chromium.
The README's command alone is refused as root, as the README says, and serves lab 01 as a
user (as root, the user's command runs where root's own interpreter is in reach).

The test drives Chromium through the Chrome DevTools Protocol (a websocket,
`websocket-client`): "Run All Cells" as the Run menu does it, then checks the page's DOM: lab
01 ends with no error or warning box, and its short timeline run's lanes become zoomable
after its cell (a picture until plotly has loaded); the run view draws its live timeline
lanes while the ranks still train, then its status table, its tabs, a tab's lines once
clicked, and, after the run, the whole timeline in the same figure (one figure per cell, as
wide as the cell); and `ddl_magic.last_run()` renders as a table; after a kernel restart the
finished run's view shows as it ended, without broken-link icons. Screenshots (lab_01.png,
lab_01_timeline.png, lab_01_pool_cell.png, live_lanes.png, run_view.png,
run_view_rank_1.png, timeline_cell.png, last_run.png, run_view_after_restart.png, page.png)
land in the test's tmp folder; a wait that times out leaves timed_out.png.

The ranks train until the test has seen the live lanes: it then creates a file, and rank 0
tells the others to stop (a broadcast), so the screenshot is taken mid-run on any machine.

Needs Chromium: ``apt-get install -y chromium``. Without it the test is skipped, and fails
under CI (``CI=true``), where it must run. Lab 01 also needs Java 17 for its Spark parts.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from kernel import users_kernel_environment
from test_readme import in_this_environment, one_block, steps

ROOT = Path(__file__).resolve().parent.parent

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run",
                  "--disable-dev-shm-usage", "--hide-scrollbars")
WINDOW = (1400, 1600)
STEPS = 5  # at least; then the ranks go on until the test has seen the live lanes


def notebook_cells(stop_file: Path) -> tuple[str, ...]:
    return (
        "%load_ext ddl_magic",
        (
            "%%horovod -np 2 --timeline\n"
            "import os, time, torch\n"
            "import ddl_magic.torch as hvd\n"
            "hvd.init()\n"
            "deadline, step = time.monotonic() + 120, 0\n"
            "while True:\n"
            "    with hvd.timeline_span('step', step=step):\n"
            "        hvd.allreduce(torch.ones(100_000), name='grad')\n"
            f"    if step < {STEPS}:\n"
            "        print(f'step {step} on rank {hvd.rank()}')\n"
            "    step += 1\n"
            f"    go_on = step < {STEPS} or not os.path.exists({str(stop_file)!r})\n"
            "    if not hvd.broadcast(torch.tensor([float(go_on)]), 0, name='go on').item():\n"
            "        break\n"
            "    if time.monotonic() > deadline:\n"
            "        raise TimeoutError('the test never saw the live lanes')\n"
            "hvd.rank()"
        ),
        "import ddl_magic\nddl_magic.last_run()",
    )


# JavaScript run in the page. The run view is the widget box whose table has a "status" column.
RUN_VIEW = """(() => [...document.querySelectorAll('.jp-OutputArea-output .widget-vbox')]
    .find(box => [...box.querySelectorAll('th')].some(th => th.textContent === 'status')))()"""
# The notebook open in JupyterLab, once its kernel is connected and its cells are shown.
NOTEBOOK_READY = """(() => { const app = window.jupyterapp;
    const panel = app && app.shell.currentWidget;
    return !!(panel && panel.sessionContext && panel.sessionContext.session
              && panel.sessionContext.session.kernel
              && panel.sessionContext.session.kernel.connectionStatus === 'connected'
              && panel.content.widgets.length >= CELLS); })()"""
# Every code cell of the current notebook has run, and the kernel rests.
ALL_CELLS_RAN = """(() => { const panel = window.jupyterapp.shell.currentWidget;
    return panel.sessionContext.session.kernel.status === 'idle'
        && panel.content.widgets.every(cell => cell.model.type !== 'code'
                                               || (cell.model.executionCount && !cell.promptNode.textContent.includes('*'))); })()"""
# What the current notebook's cells printed (their stream outputs), from its model.
PRINTED = """[...window.jupyterapp.shell.currentWidget.content.widgets]
    .filter(cell => cell.model.type === 'code').flatMap(cell => cell.model.outputs.toJSON())
    .filter(output => output.output_type === 'stream')
    .map(output => Array.isArray(output.text) ? output.text.join('') : output.text).join('')"""
# Error boxes and stderr boxes (pink in JupyterLab) in the current notebook's outputs.
WARNING_BOXES = """[...document.querySelectorAll(
    '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')].map(box => box.innerText.slice(0, 300))"""


def require_or_skip(ok: bool, message: str) -> None:
    """Skip when a browser-test prerequisite is missing, but fail under CI, where it must run."""
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(check, timeout: float, what: str, interval: float = 0.2):
    """Poll `check()` until it returns something truthy; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(interval)


class DevToolsPage:
    """One Chromium tab, driven through the Chrome DevTools Protocol."""

    def __init__(self, websocket_url: str, folder: Path):
        import websocket

        self._folder = folder  # where a wait that times out leaves its screenshot
        self._socket = websocket.create_connection(websocket_url, timeout=30, suppress_origin=True)
        self._next_id = 0

    def call(self, method: str, **params) -> dict:
        self._next_id += 1
        self._socket.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:  # events arrive in between; only the answer to this call matters here
            message = json.loads(self._socket.recv())
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} raised {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float, what: str):
        """Poll `expression` until truthy; on timeout, a screenshot shows what the page showed."""
        try:
            return wait_until(lambda: self.evaluate(expression), timeout, what, interval=0.25)
        except TimeoutError as exc:
            shown = self.screenshot(self._folder / "timed_out.png")
            raise TimeoutError(f"{exc}; the page then: {shown}") from None

    def click(self, x: float, y: float) -> None:
        """A real mouse click (lumino's tab bar listens to pointer events, not `click`)."""
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def screenshot(self, path: Path, element: str | None = None) -> Path:
        """A PNG of the page, or of the element `element` evaluates to (scrolled into view)."""
        params: dict = {"format": "png"}
        if element is not None:
            # Scrolled into view, then measured after two frames: JupyterLab draws a cell that
            # comes into view on the next frame, and an element shot before that is blank.
            # On a busy machine the element may still be laid out, or redrawn (a finished run's
            # view is replaced): found afresh each frame, up to 300 frames (~5 s), until it
            # takes room (an empty box cannot be shot).
            box = self.evaluate(f"""(async () => {{ let e = {element}, r = null;
                for (let i = 0; i < 300 && (i < 3 || !r || !r.width || !r.height); i++) {{
                    if (i > 0) await new Promise(done => requestAnimationFrame(done));
                    e = {element};
                    if (!e) continue;
                    if (i === 0 || !r || !r.width) e.scrollIntoView({{block: 'start'}});
                    r = e.getBoundingClientRect(); }}
                return r ? {{x: r.x, y: r.y, width: r.width, height: r.height}}
                         : {{x: 0, y: 0, width: 0, height: 0}}; }})()""")
            if not box["width"] or not box["height"]:
                raise AssertionError(f"{element} has no size on the page to screenshot: {box}")
            params.update(clip={**box, "scale": 1}, captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", **params)["data"]))
        return path

    def close(self) -> None:
        self._socket.close()


def readme_jupyterlab_command() -> list[str]:
    """The README's command that starts JupyterLab, with this environment's `jupyter`."""
    return in_this_environment(steps(one_block("notebook").splitlines()[1])[0])


def clone_of_the_labs(folder: Path) -> Path:
    """A git repository holding what the README's command serves (the labs, the JupyterLab
    config, .gitignore), committed: `git status` there says whether running a lab dirtied it."""
    shutil.copytree(ROOT / "example_notebooks", folder / "example_notebooks")
    for name in (".gitignore", "jupyter_lab_config.py"):
        shutil.copy(ROOT / name, folder / name)
    for command in (["init", "-q"], ["add", "-A"],
                    ["-c", "user.name=test", "-c", "user.email=test@example.com", "commit", "-qm", "labs"]):
        subprocess.run(["git", *command], cwd=folder, check=True, capture_output=True, timeout=30)
    return folder


@pytest.fixture()
def jupyterlab(tmp_path):
    """JupyterLab started as the README says (its command, this environment's `jupyter`), on
    127.0.0.1 with a token, in a git clone of the labs (`clone_of_the_labs`, so running them
    saves nothing into this repository); yields its base URL, token, the folder it serves and
    the URL it printed."""
    require_or_skip(_importable("jupyterlab") and _importable("websocket"),
                    "JupyterLab or websocket-client is missing: pip install -e '.[test]' installs them")
    readme_start = readme_jupyterlab_command()
    folder, config = clone_of_the_labs(tmp_path / "clone"), tmp_path / "jupyter-config"
    # No "get Jupyter news?" toast over the screenshots.
    (config / "labconfig").mkdir(parents=True)
    (config / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    port, token = free_port(), secrets.token_hex(16)
    # Its kernels show stderr boxes as a user's do.
    env = users_kernel_environment({"JUPYTER_CONFIG_DIR": str(config),
                                    "JUPYTER_DATA_DIR": str(tmp_path / "jupyter-data"),
                                    "JUPYTER_RUNTIME_DIR": str(tmp_path / "jupyter-runtime"),
                                    "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "jupyter-workspaces"),
                                    "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "jupyter-settings")})
    env.pop("DDL_MAGIC_DISPLAY", None)  # the widget run view, as a user gets it
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [*readme_start, "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
         "--LabApp.expose_app_in_browser=True", *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: server.poll() is not None or _answers(f"{base}/api/status?token={token}"),
                   timeout=30, what=f"JupyterLab to answer (log: {log.name})")
        assert server.poll() is None, (tmp_path / "jupyterlab.log").read_text()
        printed = wait_until(lambda: re.search(rf"{re.escape(base)}/\S+", (tmp_path / "jupyterlab.log").read_text()),
                             timeout=10, what="JupyterLab to print its URL").group(0)
        # (a token given on the command line is printed as "...")
        yield base, token, folder, printed.replace("?token=...", f"?token={token}")
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture()
def browser(tmp_path):
    """Headless Chromium with one blank tab; yields a DevToolsPage on it."""
    executable = next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)
    require_or_skip(executable is not None,
                    "Chromium is missing: install it with `apt-get install -y chromium` "
                    "(the browser test runs JupyterLab in headless Chromium)")
    profile = tmp_path / "chromium-profile"
    log = open(tmp_path / "chromium.log", "w")
    process = subprocess.Popen(
        [executable, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
         f"--window-size={WINDOW[0]},{WINDOW[1]}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=log)
    page = None
    try:
        # Chromium writes the port it chose, then the browser's websocket path, to this file.
        port_file = profile / "DevToolsActivePort"
        wait_until(lambda: process.poll() is not None or
                   (port_file.exists() and len(port_file.read_text().split()) == 2),
                   timeout=30, what="Chromium's DevTools port")
        assert process.poll() is None, (tmp_path / "chromium.log").read_text()
        port = int(port_file.read_text().split()[0])
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        page = DevToolsPage(next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"], tmp_path)
        page.call("Emulation.setDeviceMetricsOverride", width=WINDOW[0], height=WINDOW[1],
                  deviceScaleFactor=1, mobile=False)
        # A headless tab never has focus, and JupyterLab finds "the current notebook" by focus.
        page.call("Emulation.setFocusEmulationEnabled", enabled=True)
        yield page
    finally:
        if page is not None:
            page.close()
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


NOBODY = 65534


@pytest.mark.timeout(120)
def test_the_readmes_jupyterlab_command_as_root_and_as_a_user(tmp_path):
    """As root, the README's command alone is refused, as the README says (the lab 01 test
    adds --allow-root, as the README says to); as a user, it serves the clone and the URL it
    prints is lab 01's."""
    require_or_skip(_importable("jupyterlab"), "JupyterLab is missing: pip install -e '.[test]' installs it")
    command = readme_jupyterlab_command()
    as_user: list[str] = []
    if os.geteuid() == 0:
        refused = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")})
        assert refused.returncode != 0 and "--allow-root" in refused.stderr, refused.stderr[-2000:]
        assert "--allow-root" in one_block_context("notebook")
    # A folder the user owns (pytest's are private to root), removed at the end.
    home = Path(tempfile.mkdtemp(prefix="ddl-magic-lab-user-"))
    try:
        if os.geteuid() == 0:
            as_user = as_a_user_who_can_run(sys.executable, home / "hidden")
            # (setpriv's own exec may still pass where the user's next one is refused: try both)
            execs_again = "import os, sys; os.execv(sys.executable, [sys.executable, '-c', ''])"
            if subprocess.run([*as_user, sys.executable, "-c", execs_again], capture_output=True, timeout=30).returncode:
                pytest.skip(f"refused as root, as the README says; {sys.executable} cannot run as a "
                            "user here, so the user's half is not tried")
        folder = clone_of_the_labs(home / "clone")
        if as_user:
            subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(home)], check=True, timeout=30)
            home.chmod(0o755)
        port, token = free_port(), secrets.token_hex(16)
        log = home / "jupyterlab.log"
        with open(log, "w") as written:
            server = subprocess.Popen(
                [*as_user, *command, "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                 "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}"],
                cwd=folder, stdout=written, stderr=subprocess.STDOUT,
                env={**os.environ, "HOME": str(home), "JUPYTER_CONFIG_DIR": str(home / "config"),
                     "JUPYTER_DATA_DIR": str(home / "data"), "JUPYTER_RUNTIME_DIR": str(home / "runtime")})
        try:
            base = f"http://127.0.0.1:{port}"
            printed = wait_until(lambda: server.poll() is not None or re.search(rf"{re.escape(base)}/\S+", log.read_text()),
                                 timeout=60, what=f"JupyterLab to print its URL (log: {log})")
            assert server.poll() is None, log.read_text()
            assert printed.group(0).split("?")[0] == f"{base}/lab/tree/example_notebooks/01_iris_mlp.ipynb"
            assert _answers(f"{base}/api/contents/example_notebooks/01_iris_mlp.ipynb?token={token}")
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def as_a_user_who_can_run(python: str, spare_folder: Path) -> list[str]:
    """The command prefix that runs what follows as user nobody, able to run `python`.

    A Python installed under root's home (pyenv's /root/.pyenv, as on this project's
    machines) is out of a user's reach only because /root is private; a user who installs
    Python has one of their own. So where exactly one folder on the interpreter's real path
    is private to root, the user's command runs in a mount namespace of its own in which an
    open folder lies over it, holding only the way on to the interpreter (bound there from
    `spare_folder`, an empty folder, which is free again once the namespace has it)."""
    user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    real = Path(os.path.realpath(python))
    private = [folder for folder in reversed(real.parents) if not folder.stat().st_mode & 0o001]
    if len(private) != 1:
        return user
    closed, way_on = private[0], real.relative_to(private[0]).parts[0]
    spare_folder.mkdir()
    lay_open = (f"set -e; mount --bind {closed} {spare_folder}; "
                f"mount -t tmpfs -o mode=755 tmpfs {closed}; mkdir {closed / way_on}; "
                f"mount --bind {spare_folder / way_on} {closed / way_on}; umount {spare_folder}; "
                'exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", lay_open, "sh", *user]


def one_block_context(kind: str) -> str:
    """The README's paragraph after its `kind` block: what it says about the command."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    after = readme.split(one_block(kind), 1)[1]
    return after.split("\n\n", 2)[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def open_and_run_all(page: DevToolsPage, url: str, path: str, cells: int) -> None:
    page.call("Page.navigate", url=url)
    page.wait_for(NOTEBOOK_READY.replace("CELLS", str(cells)), timeout=45,
                  what=f"JupyterLab to open {path} with a connected kernel")
    # Not awaited: the command resolves when the cells are done, and they may wait for this test.
    page.evaluate("void window.jupyterapp.commands.execute('notebook:run-all-cells')")


@pytest.mark.timeout(420)
def test_lab_01_runs_from_the_readmes_path_to_its_end_without_a_warning_box(browser, jupyterlab, tmp_path):
    base, token, served, printed = jupyterlab
    # The URL JupyterLab printed opens lab 01 (as through an SSH tunnel: no browser opened it).
    lab = "example_notebooks/01_iris_mlp.ipynb"
    assert printed == f"{base}/lab/tree/{lab}?token={token}", printed
    cells = len(nbformat.read(served / lab, as_version=4).cells)
    started = time.monotonic()
    open_and_run_all(browser, printed, lab, cells)
    assert browser.evaluate("window.jupyterapp.shell.currentWidget.context.path") == lab
    browser.wait_for(ALL_CELLS_RAN, timeout=300, what="lab 01 to run to its end")
    took = time.monotonic() - started
    boxes = browser.evaluate(WARNING_BOXES)
    browser.screenshot(tmp_path / "lab_01.png")
    assert boxes == [], f"lab 01 shows error or warning boxes: {boxes}"
    # Both models learned, on Spark and on two ranks, and so did the pool's (the numbers
    # `test_example_notebooks.py` checks in full among the long checks, through nbclient).
    printed = browser.evaluate(PRINTED)
    for learned in (r"Spark MLP accuracy: ([\d.]+)", r"torch MLP \(2 ranks\) accuracy: ([\d.]+)",
                    r"pool: [\d.]+ after 30 epochs, ([\d.]+) after 150"):
        found = re.search(learned, printed)
        assert found and float(found.group(1)) >= 0.9, (learned, printed[-2000:])
    # Its runs finished: every run view says so, and the report cell's numbers are there. A
    # run view is the live widgets, or, for a run over before they were due, its final report.
    run_views = ("[...document.querySelectorAll('.jp-OutputArea-output')].filter(output => "
                 "[...output.querySelectorAll('th')].some(th => th.textContent === 'status'))")
    finished = browser.evaluate(f"""{run_views}.map(view => [view.textContent.includes('done in'),
                                                          !!view.querySelector('.widget-vbox')])""")
    # the two one-shot runs, then Part 3½'s pool cells (the set-up, two trainings, two evaluations)
    assert [done for done, _ in finished] == [True] * 7, finished
    assert finished[0][1], finished  # the timeline run: the live view, with its lanes
    # Its lanes are zoomable: the kernel's first timeline, after a short run, ended with them
    # as a picture, and the figure took the picture's place once plotly had loaded; in view
    # (JupyterLab lays out no cell out of sight), as wide as the run view.
    timeline_view = f"{run_views}[0]"
    browser.wait_for(f"""(() => {{ const view = {timeline_view};
        view.scrollIntoView({{block: 'center'}});
        const plot = view.querySelector('.js-plotly-plot');
        return !!plot && !!plot.querySelector('.bars path')
            && !view.textContent.includes('zoomable once plotly has loaded')
            && plot.querySelector('.main-svg').getBoundingClientRect().width
               >= 0.95 * view.getBoundingClientRect().width; }})()""",
                     timeout=60, what="lab 01's timeline run to show its lanes in a zoomable figure as wide as its view")
    browser.screenshot(tmp_path / "lab_01_timeline.png", element=timeline_view)
    # A pool cell's run view: its title says so, and both ranks trained on from where they were.
    pool_view = f"{run_views}[4]"
    shown = browser.evaluate(f"(() => {{ const view = {pool_view}; view.scrollIntoView(); "
                             "return view.textContent; })()")
    assert "(pool)" in shown and "150 epochs" in shown, shown
    # Shot until it shows the view: on a busy machine JupyterLab may draw it frames later.
    shot = tmp_path / "lab_01_pool_cell.png"
    wait_until(lambda: browser.screenshot(shot, element=pool_view).stat().st_size > 5_000,
               timeout=30, what="the pool cell's run view to be drawn for its screenshot")
    # Saved, the lab is as committed: running it leaves the clone clean.
    browser.evaluate("void window.jupyterapp.commands.execute('docmanager:save')")
    browser.wait_for("!window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=20,
                     what="lab 01 to be saved")
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=served, capture_output=True,
                           text=True, timeout=30, check=True).stdout
    assert dirty == "", f"running lab 01 changed the clone:\n{dirty}"
    print(f"lab 01 ran in JupyterLab in {took:.0f} s")


@pytest.mark.timeout(300)  # its waits, on a busy machine: the live lanes up to 110 s, the end 45 s
def test_jupyterlab_shows_the_run_view_the_timeline_and_last_run(browser, jupyterlab, tmp_path):
    base, token, served, _ = jupyterlab
    page = browser
    notebook = nbformat.v4.new_notebook()
    stop_file = tmp_path / "lanes_seen"
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in notebook_cells(stop_file)]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, served / "run.ipynb")
    open_and_run_all(page, f"{base}/lab/tree/run.ipynb?token={token}", "run.ipynb", len(notebook.cells))

    # While the ranks train: the run view's live lanes, a row per (rank, lane), with bars. Each
    # rank sends its events on its own clock, so the first figure may hold one rank's lanes:
    # wait for both ranks' shared-memory lanes.
    live = page.wait_for(f"""(() => {{ const view = {RUN_VIEW};
        const plot = view && view.querySelector('.js-plotly-plot');
        const rows = plot ? [...plot.querySelectorAll('.ytick text')].map(t => t.textContent) : [];
        const lane = rank => rows.some(row => row.startsWith(`rank ${{rank}} (`)
                                              && row.includes('shared_memory'));
        return !!plot && plot.querySelectorAll('.bars path').length > 0
            && view.textContent.includes('running') && view.textContent.includes('timeline so far')
            && lane(0) && lane(1) && {{rows}}; }})()""",
                         timeout=110, what="the run view to draw both ranks' live lanes while the run trains")
    assert all(row.startswith(("rank 0 (", "rank 1 (")) for row in live["rows"]), live
    page.screenshot(tmp_path / "live_lanes.png", element=RUN_VIEW)
    stop_file.touch()

    # The run view: its table, both ranks done, a tab per rank.
    page.wait_for(f"""(() => {{ const view = {RUN_VIEW};
        return !!view && view.textContent.includes('done in')
            && [...view.querySelectorAll('b')].some(b => b.textContent === 'timeline'); }})()""",
                  timeout=45, what="the run view to show the finished run and its timeline")
    view = page.evaluate(f"""(() => {{ const view = {RUN_VIEW};
        return {{
            rows: [...view.querySelector('table').querySelectorAll('tr')].slice(1).map(
                tr => [...tr.querySelectorAll('td')].map(td => td.innerText)),
            tabs: [...view.querySelectorAll('.lm-TabBar-tab')].map(tab => tab.innerText.trim()),
            visible: view.querySelector('.widget-tab-contents .widget-html:not(.lm-mod-hidden)').innerText,
        }}; }})()""")
    assert [row[:2] for row in view["rows"]] == [["0", "done"], ["1", "done"]], view
    assert view["tabs"] == ["all ranks", "rank 0", "rank 1"], view
    for rank in range(2):
        assert f"[{rank}] step {STEPS - 1} on rank {rank}" in view["visible"], view
    page.screenshot(tmp_path / "run_view.png", element=RUN_VIEW)

    # Clicking "rank 1" shows rank 1's lines alone.
    tab = page.evaluate(f"""(() => {{ const tab = [...{RUN_VIEW}.querySelectorAll('.lm-TabBar-tab')]
        .find(t => t.innerText.trim() === 'rank 1');
        tab.scrollIntoView({{block: 'center'}}); const r = tab.getBoundingClientRect();
        return {{x: r.x + r.width / 2, y: r.y + r.height / 2}}; }})()""")
    page.click(tab["x"], tab["y"])
    rank_1 = page.wait_for(f"""(() => {{ const shown = {RUN_VIEW}.querySelector(
            '.widget-tab-contents .widget-html:not(.lm-mod-hidden)');
        return shown && !shown.innerText.includes('[') && shown.innerText; }})()""",
                           timeout=10, what="the rank 1 tab to show")
    assert f"step {STEPS - 1} on rank 1" in rank_1 and "rank 0" not in rank_1
    page.screenshot(tmp_path / "run_view_rank_1.png", element=RUN_VIEW)

    # The finished run's timeline: one figure in the cell, as wide as the cell, the whole trace.
    cell = "document.querySelectorAll('.jp-Notebook .jp-CodeCell')[1]"
    figure = page.wait_for(f"""(() => {{ const cell = {cell};
        const plots = [...cell.querySelectorAll('.js-plotly-plot')];
        const plot = plots[0];
        if (!plot || !plot.querySelector('.gtitle') || !plot.querySelector('.gtitle').textContent.includes('from 2 rank(s)'))
            return false;
        return {{ figures: plots.length,
                 width: plot.querySelector('.main-svg').getBoundingClientRect().width,
                 cell_width: cell.querySelector('.jp-OutputArea-output').getBoundingClientRect().width,
                 title: plot.querySelector('.gtitle').textContent,
                 legend_top: plot.querySelector('.legend').getBoundingClientRect().bottom
                             <= plot.querySelector('.nsewdrag').getBoundingClientRect().top + 1,
                 rows: [...plot.querySelectorAll('.ytick text')].map(t => t.textContent),
                 row_px: plot.querySelector('.nsewdrag').getBoundingClientRect().height
                         / plot.querySelectorAll('.ytick text').length,
                 bars: plot.querySelectorAll('.bars path').length }}; }})()""",
                           timeout=30, what="the run view's figure to show the whole trace")
    assert figure["figures"] == 1, f"a second figure in the cell: {figure}"
    assert figure["legend_top"] and figure["row_px"] >= 20, figure
    for rank in range(2):
        assert any(row.startswith(f"rank {rank} (") and row.endswith("· user") for row in figure["rows"]), figure
        assert any(row.startswith(f"rank {rank} (") and "shared_memory" in row for row in figure["rows"]), figure
    assert figure["bars"] >= 2 * STEPS
    page.screenshot(tmp_path / "timeline_cell.png", element=f"{cell}.querySelector('.jp-Cell-outputWrapper')")

    # last_run(): a table, a row per rank, every rank done with exit 0.
    report = "document.querySelectorAll('.jp-Notebook .jp-CodeCell')[2].querySelector('.jp-OutputArea-output table')"
    rows = page.wait_for(f"""(() => {{ const table = {report};
        return !!table && [...table.querySelectorAll('tr')].slice(1).map(
            tr => [...tr.querySelectorAll('td')].map(td => td.innerText)); }})()""",
                         timeout=30, what="last_run() to show its table")
    assert [row[:2] for row in rows] == [["0", "done"], ["1", "done"]] and [row[4] for row in rows] == ["0", "0"], rows
    # Its "rank" header starts inside the output area (a negative margin once cut it to "ank").
    assert page.evaluate(f"""(() => {{ const table = {report};
        return table.querySelector('th').getBoundingClientRect().left
               >= table.closest('.jp-OutputArea-output').getBoundingClientRect().left; }})()""")
    page.screenshot(tmp_path / "last_run.png", element=f"{report}.closest('.jp-OutputArea')")

    # After a kernel restart the finished run's view stays as it ended: every widget of it is
    # disconnected, and none shows ipywidgets' red broken-link icon for it.
    page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.restart()")
    after_restart = page.wait_for(f"""(() => {{ const view = {RUN_VIEW};
        const parts = view ? [view, ...view.querySelectorAll('.jupyter-widgets')] : [];
        const disconnected = parts.filter(part => part.classList.contains('jupyter-widgets-disconnected'));
        return disconnected.length > 0 && {{ disconnected: disconnected.length,
            icons: disconnected.filter(part => getComputedStyle(part, '::before').display !== 'none').length,
            done: view.textContent.includes('done in') }}; }})()""",
                                  timeout=60, what="the restarted kernel to disconnect the run view")
    assert after_restart["icons"] == 0 and after_restart["done"], after_restart
    page.screenshot(tmp_path / "run_view_after_restart.png", element=RUN_VIEW)
    page.screenshot(tmp_path / "page.png")
    assert page.evaluate(WARNING_BOXES) == []
    for name in ("run_view.png", "timeline_cell.png", "live_lanes.png", "last_run.png"):
        assert (tmp_path / name).stat().st_size > 5_000
    # Last, so that the screenshots above are taken either way: the figure as drawn (its svg,
    # not the element plotly draws into) fills the cell.
    assert figure["width"] >= 0.95 * figure["cell_width"], f"the figure is narrower than the cell: {figure}"
