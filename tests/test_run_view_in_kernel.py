"""The run view through real runs: a notebook executed in a real kernel, widgets and all.

nbclient plays the frontend: it keeps every widget's state as the kernel sends it (the
model opened with the view, then each refresh's updates), as JupyterLab would hold it, and
saves it in the notebook's metadata. These tests read that saved state, so they see what a
user's browser would have drawn when each run ended.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

FLOOD_LINES = 5_000
BOUNDED_LINES = 500  # RunView's default max_lines

CELLS = {
    "setup": "%load_ext ddl_magic",
    "hello": (
        "%%horovod -np 2\n"
        "import sys\n"
        "import ddl_magic.torch as hvd\n"
        "hvd.init()\n"
        "for i in range(3):\n"
        "    print(f'line {i} from rank {hvd.rank()}')\n"
        "print(f'warning from rank {hvd.rank()}', file=sys.stderr)\n"
        "hvd.rank()"
    ),
    "fails_on_rank_1": (
        "%%horovod -np 2 --quiet\n"
        "import torch\n"
        "import ddl_magic.torch as hvd\n"
        "hvd.init()\n"
        "print(f'rank {hvd.rank()} before the failure', flush=True)\n"
        "if hvd.rank() == 1:\n"
        "    raise RuntimeError('loss is nan on rank 1')\n"
        "hvd.allreduce(torch.ones(1))"
    ),
    "flood": (
        "%%horovod -np 2 --quiet\n"
        "import ddl_magic.torch as hvd\n"
        "hvd.init()\n"
        f"for i in range({FLOOD_LINES}):\n"
        "    print(f'rank {hvd.rank()} line {i}')"
    ),
    # The kernel's first timeline, after a run shorter than plotly takes to load: the cell
    # ends with the lanes as a picture, and the figure takes its place once plotly is loaded.
    # (Short as the view counts, on a busy machine too.)
    "runs_are_short": (
        "from ddl_magic.ui import run_view\n"
        "run_view.DRAWING_STARTS_AFTER_S = 600"
    ),
    "short_timeline": (
        "%%horovod -np 2 --timeline timeline.json\n"
        "import torch\n"
        "import ddl_magic.torch as hvd\n"
        "hvd.init()\n"
        "hvd.allreduce(torch.ones(4), name='short')"
    ),
    # ...and before the next cell starts, plotly is loaded: no thread of ours imports beside it.
    "plotly_loaded": (
        "from ddl_magic.ui import run_view\n"
        "run_view._drawing_thread.ident is not None, run_view._drawing_thread.is_alive()"
    ),
}


@dataclass
class RenderedView:
    """What one cell's run view showed when its run ended, as the frontend held it."""

    banner: str  # text of the banner line
    rows: list[dict[str, str]]  # per rank: rank, status, host, elapsed, last line; and "highlighted"
    failure: str  # text of the failure panel ("" when no rank failed)
    tab_titles: list[str]
    tab_texts: list[str]  # text of each tab: "all ranks", then rank 0, rank 1, ...
    widget_state_chars: int  # size of the view's widget state, what a saved notebook keeps


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    """The notebook of CELLS, executed once in a real kernel with the widget run view."""
    folder = tmp_path_factory.mktemp("run_view_notebook")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source, id=name) for name, source in CELLS.items()]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    with pytest.MonkeyPatch.context() as patch:
        # The widget view from each run's first moment: these cells end before its widgets
        # would be made otherwise (a short run shows its final report instead).
        patch.setenv("DDL_MAGIC_DISPLAY", "widgets")
        NotebookClient(nb, kernel_name="python3", store_widget_state=True, allow_errors=True,
                       timeout=120, resources={"metadata": {"path": str(folder)}}).execute()
    nbformat.write(nb, folder / "executed.ipynb")  # kept for a look when a test fails
    return nb


def cell(notebook, name):
    return next(c for c in notebook.cells if c.id == name)


def rendered_view(notebook, name) -> RenderedView:
    """Rebuild what the run view of cell `name` showed from the notebook's widget state."""
    states = notebook.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    views = [output.data["application/vnd.jupyter.widget-view+json"]["model_id"]
             for output in cell(notebook, name).outputs
             if "application/vnd.jupyter.widget-view+json" in output.get("data", {})]
    assert len(views) == 1, f"cell {name!r} should show one run view, shows {len(views)}"

    def model(reference):
        return states[reference.removeprefix("IPY_MODEL_")]

    root = states[views[0]]
    assert root["model_name"] == "VBoxModel"
    banner, table, failure, tabs = (model(child) for child in root["state"]["children"])
    assert tabs["model_name"] == "TabModel"
    tab_models = [model(child) for child in tabs["state"]["children"]]
    shown = [root, banner, table, failure, tabs, *tab_models]
    return RenderedView(
        banner=text_of(banner["state"]["value"]),
        rows=table_rows(table["state"]["value"]),
        failure=text_of(failure["state"]["value"]),
        tab_titles=list(tabs["state"]["titles"]),
        tab_texts=[text_of(tab["state"]["value"]) for tab in tab_models],
        widget_state_chars=sum(len(str(m["state"])) for m in shown),
    )


def text_of(markup: str) -> str:
    """The text a browser shows for `markup`, a block element ending a line."""
    return html.unescape(re.sub(r"<[^>]+>", "", markup.replace("</div>", "</div>\n")))


def table_rows(markup: str) -> list[dict[str, str]]:
    rows = []
    for attributes, body in re.findall(r"<tr([^>]*)>(.*?)</tr>", markup, flags=re.DOTALL):
        cells = [text_of(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", body, flags=re.DOTALL)]
        if cells:  # the header row has <th> cells only
            rank, status, host, elapsed, last_line = cells
            rows.append({"rank": rank, "status": status, "host": host, "elapsed": elapsed,
                         "last_line": last_line, "highlighted": "background" in attributes})
    return rows


def test_every_rank_reaches_done_with_its_host_and_elapsed_time(notebook):
    view = rendered_view(notebook, "hello")
    assert [row["status"] for row in view.rows] == ["done", "done"]
    assert all(row["host"] not in ("", "—") for row in view.rows)
    assert all(re.fullmatch(r"\d+\.\d s", row["elapsed"]) for row in view.rows)
    assert "%%horovod -np 2" in view.banner and "done in" in view.banner
    assert not view.failure and not any(row["highlighted"] for row in view.rows)
    result = next(o for o in cell(notebook, "hello").outputs if o.output_type == "execute_result")
    assert result.data["text/plain"] == "0"


def test_each_ranks_lines_land_in_its_own_tab(notebook):
    view = rendered_view(notebook, "hello")
    assert view.tab_titles == ["all ranks", "rank 0", "rank 1"]
    every_rank, rank_0, rank_1 = view.tab_texts
    for rank, tab, other in ((0, rank_0, 1), (1, rank_1, 0)):
        for i in range(3):
            assert f"line {i} from rank {rank}" in tab
            assert f"[{rank}] line {i} from rank {rank}" in every_rank
        assert f"warning from rank {rank}" in tab  # stderr too
        assert f"from rank {other}" not in tab
    for rank, row in enumerate(view.rows):
        assert row["last_line"].endswith(f"from rank {rank}")


def test_a_rank_failing_is_highlighted_with_its_traceback(notebook):
    view = rendered_view(notebook, "fails_on_rank_1")
    assert [row["status"] for row in view.rows] == ["stopped", "failed"]
    assert [row["highlighted"] for row in view.rows] == [False, True]
    assert view.tab_titles == ["all ranks", "rank 0", "rank 1 ✗"]
    assert view.failure.startswith("rank 1 on ")
    assert "Traceback (most recent call last)" in view.failure
    assert "line 7" in view.failure  # the line as the notebook numbers it
    assert "RuntimeError: loss is nan on rank 1" in view.failure
    assert "failed after" in view.banner
    assert "rank 1 before the failure" in view.tab_texts[2]
    error = next(o for o in cell(notebook, "fails_on_rank_1").outputs if o.output_type == "error")
    assert error.ename == "RankFailedError"


def test_a_flood_of_lines_keeps_the_view_bounded_and_names_the_log_folder(notebook):
    view = rendered_view(notebook, "flood")
    assert [row["status"] for row in view.rows] == ["done", "done"]
    log_dir = re.search(r"logs in (\S+)", view.banner).group(1)
    for rank in range(2):
        tab = view.tab_texts[1 + rank]
        kept = [line for line in tab.splitlines() if line.startswith(f"rank {rank} line ")]
        assert len(kept) == BOUNDED_LINES
        assert kept[-1] == f"rank {rank} line {FLOOD_LINES - 1}"  # the newest lines are kept
        assert f"{FLOOD_LINES - BOUNDED_LINES:,} earlier lines not shown" in tab
        full_log = f"{log_dir}/rank-{rank}.log"
        assert f"full log: {full_log}" in tab
        assert Path(full_log).read_text().count(f"rank {rank} line ") == FLOOD_LINES
        assert view.rows[rank]["last_line"] == f"rank {rank} line {FLOOD_LINES - 1}"
    assert len(view.tab_texts[0].splitlines()) <= BOUNDED_LINES + 1  # + the note
    # 10,000 lines of ~16 characters went by; the frontend holds about a tenth of them.
    assert view.widget_state_chars < 60_000


def test_the_first_timeline_of_a_kernel_ends_at_once_and_its_figure_follows(notebook):
    """Widget state as the frontend held it once the kernel was done: the short run's view
    swapped its lanes' picture for the zoomable figure, after its cell had ended."""
    states = notebook.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    views = [output.data["application/vnd.jupyter.widget-view+json"]["model_id"]
             for output in cell(notebook, "short_timeline").outputs
             if "application/vnd.jupyter.widget-view+json" in output.get("data", {})]
    assert len(views) == 1
    children = [states[child.removeprefix("IPY_MODEL_")] for child in states[views[0]]["state"]["children"]]
    assert "Waited longest" in children[-3]["state"]["value"]  # the summary
    lanes = children[-2]
    assert lanes["model_name"] != "HTMLModel", lanes["state"].get("value", "")[:300]
    assert lanes["state"]["_anywidget_id"].endswith("FullWidthFigureWidget")
    pictures = [s for s in states.values() if "zoomable once plotly has loaded" in str(s["state"].get("value"))]
    assert len(pictures) == 1, "the cell ended with the lanes as a picture, before plotly loaded"
    loaded = next(o for o in cell(notebook, "plotly_loaded").outputs if o.output_type == "execute_result")
    assert loaded.data["text/plain"] == "(True, False)", "the next cell started while plotly loaded"
