"""The teaching notebooks in example_notebooks/ run top to bottom in a real kernel and teach
what they claim: each test executes one notebook with nbclient, then one more cell that
reports the notebook's results, and checks them."""

import ast
import json
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from kernel import users_kernel_environment

NOTEBOOKS = Path(__file__).resolve().parent.parent / "example_notebooks"
CELL_TIMEOUT_S = 150
NOTEBOOK_TIMEOUT_S = 240  # each notebook takes under a minute on 2 cores; CI may be slower
REPORT_MARKER = "NOTEBOOK REPORT "


def run_notebook(name: str, report: str) -> tuple[nbformat.NotebookNode, dict]:
    """Execute the notebook, then `report` (code ending in a dict expression) in one more cell.

    Returns the executed notebook and the dict. A failing cell fails the test with its traceback.
    """
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    report = report.strip()
    last = ast.parse(report).body[-1]
    statements = "\n".join(report.splitlines()[:last.lineno - 1])
    value = ast.get_source_segment(report, last.value)
    notebook.cells.append(nbformat.v4.new_code_cell(
        f"{statements}\nimport json\nprint({REPORT_MARKER!r} + json.dumps({value}))"))
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute(env=users_kernel_environment())  # stderr boxes as a user would see them
    assert_no_warning_boxes(notebook)
    printed = "".join(o.get("text", "") for o in notebook.cells[-1].outputs if o.output_type == "stream")
    found = re.search(re.escape(REPORT_MARKER) + r"(.*)", printed)
    assert found, f"the report cell printed no report: {printed!r}"
    return notebook, json.loads(found.group(1))


def assert_no_warning_boxes(notebook: nbformat.NotebookNode) -> None:
    """No cell shows stderr (a pink box in JupyterLab): a warning a reader cannot act on,
    such as pyspark's about a pandas it does not support, is one for us to avoid."""
    boxes = [(number, output["text"][:300]) for number, cell in enumerate(notebook.cells)
             for output in cell.get("outputs", [])
             if output.output_type == "stream" and output.name == "stderr"]
    assert not boxes, f"cells (by position) wrote to stderr: {boxes}"


def printed_text(notebook: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for o in cell.get("outputs", []) if o.output_type == "stream")


def is_figure(output: dict) -> bool:
    """A plotly figure: static, the viewer's zoomable widget, or a run view that drew its
    run's timeline (its saved text then ends with the timeline's summary)."""
    data = output.get("data", {})
    widget = "application/vnd.jupyter.widget-view+json" in data
    return "application/vnd.plotly.v1+json" in data or (widget and "FigureWidget" in data.get("text/plain", "")) or (
        widget and "\n\ntimeline\n" in data.get("text/plain", ""))


def shown_text(cell: nbformat.NotebookNode, figures: bool = True) -> str:
    """What a code cell displayed as text, tables included (their text/plain), and figures
    too unless `figures` is False."""
    return "\n".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")
                     for o in cell.outputs if figures or not is_figure(o))


def source_of(notebook: nbformat.NotebookNode, kind: str) -> str:
    return "\n".join(cell.source for cell in notebook.cells if cell.cell_type == kind)


@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S)
@pytest.mark.long  # the default run opens lab 01 in JupyterLab (test_browser.py): its accuracies
def test_01_iris_spark_mlp_and_torch_on_two_ranks_both_learn():
    notebook, report = run_notebook("01_iris_mlp.ipynb", """
import ddl_magic
run = ddl_magic.last_run()
{"spark": spark_accuracy, "torch": torch_accuracy, "shards": shard_sizes,
 "checkpoint": os.path.exists(CHECKPOINT), "run": [run.status, run.np, run.where],
 "pool": [accuracy_after_30, pool_accuracy, pool_epochs, type(pooled_model).__name__],
 "pipelines": pipeline_accuracy, "epochs": len(history),
 "mlflow": [logged.info.status, len(accuracy_per_epoch), logged.data.params["ddl_magic.np"],
            logged.data.tags.get("mlflow.parentRunId") == lab_run.info.run_id],
 "jvm_ended": jvm.poll() is not None}
""")
    assert report["spark"] >= 0.9
    assert report["torch"] >= 0.9
    # Part 4: the seed lecture's pipeline, TorchEstimator beside Spark ML's perceptron.
    assert report["pipelines"]["VectorAssembler → TorchEstimator (2 ranks)"] >= 0.9
    assert report["pipelines"]["VectorAssembler → MultilayerPerceptronClassifier"] >= 0.9
    assert report["epochs"] == 150
    assert report["run"][2] == "Spark barrier tasks"  # the estimator's run was the last
    assert report["shards"] == [53, 52]  # rank 0's copy of every rank's shard size
    assert report["checkpoint"]
    assert report["run"][:2] == ["done", 2]
    # Part 3½: one pool, train -> evaluate -> train more, the model kept on the ranks.
    after_30, after_150, epochs, pulled = report["pool"]
    assert epochs == 150 and after_150 >= 0.9 and pulled == "Sequential"
    assert 0 <= after_30 <= 1
    # Part 5: the fit, tracked as a child of the lab's MLflow run, read back.
    assert report["mlflow"] == ["FINISHED", 150, "2", True]
    text = printed_text(notebook)
    # Part 3's run drew its timeline (the run view saves its summary with the cell)...
    assert any(is_figure(output) for cell in notebook.cells if cell.source.startswith("%%horovod -np 2 --local --timeline")
               for output in cell.outputs)
    # ...and the lab stops what it started: Spark's JVM, and the rank factory
    assert report["jvm_ended"]
    released = re.search(r"the rank factory \(pid (\d+), [\d.]+ MB\) has ended", text)
    assert released and not Path(f"/proc/{released.group(1)}").exists(), text[-500:]
    assert f"Spark MLP accuracy: {report['spark']:.3f}" in text
    assert f"torch MLP (2 ranks) accuracy: {report['torch']:.3f}" in text
    # The migration is shown step by step, and the distributed cell is numbered to match.
    markdown, code = source_of(notebook, "markdown"), source_of(notebook, "code")
    for step in range(1, 8):
        assert f"**Step {step} — " in markdown
        assert f"# Step {step}" in code
    for call in ("hvd.init()", "hvd.local_rank()", "hvd.rank()::hvd.size()", "BASE_LR * hvd.size()",
                 "hvd.DistributedOptimizer(", "hvd.broadcast_parameters(", "hvd.rank() == 0"):
        assert call in code


@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S)
def test_02_mnist_cnn_trains_with_per_rank_progress_and_spark_scores_it():
    notebook, report = run_notebook("02_mnist_cnn.ipynb", """
run = training_run
shares = ddl_magic.last_run()
{"test": test_accuracy, "spark": spark_accuracy, "scored": len(results), "epochs": EPOCHS,
 "logs": [run.log(rank) for rank in range(run.np)], "status": run.status,
 "share_logs": [shares.log(rank) for rank in range(shares.np)], "resumed": resumed_alike}
""")
    assert report["status"] == "done"
    # Lab 2's last run trained on a Spark DataFrame's shares and resumed mid-epoch exactly.
    assert report["resumed"] is True
    assert "rank 0: 2000 of the 4000 digits, 62 steps per epoch" in report["share_logs"][0]
    assert "train: 62 steps of 32 rows per epoch on each of 2 ranks" in report["share_logs"][0]
    assert report["test"] >= 0.9
    assert report["scored"] == 1000
    # The same model on the same digits, on the ranks and on Spark's executors.
    assert report["spark"] == pytest.approx(report["test"], abs=0.002)
    text = printed_text(notebook)
    assert f"test accuracy: {report['test']:.3f}" in text
    assert f"Spark inference accuracy: {report['spark']:.3f} on 1000 digits" in text
    epochs = report["epochs"]
    for rank, log in enumerate(report["logs"]):
        bars = re.findall(rf"rank {rank} epoch {epochs}/{epochs}: +(\d+)%", log)
        assert bars and bars[-1] == "100", log[-2000:]  # its own tqdm bar, finished
        assert f"rank {rank}: " in log and " of its test digits right" in log


# Lab 3's ring by hand on a pool of 3: every rank's buffer, pulled after each step. Rank r
# starts with [1..6] * 10^r, so a number's digits say whose gradients it holds.
RING_BY_HAND = {
    "start": [[1, 2, 3, 4, 5, 6], [10, 20, 30, 40, 50, 60], [100, 200, 300, 400, 500, 600]],
    "scatter-reduce step 0": [[1, 2, 3, 4, 505, 606], [11, 22, 30, 40, 50, 60],
                              [100, 200, 330, 440, 500, 600]],
    # the lecture: after N - 1 steps rank r holds the complete sum of chunk r + 1, and only it
    "scatter-reduce step 1": [[1, 2, 333, 444, 505, 606], [11, 22, 30, 40, 555, 666],
                              [111, 222, 330, 440, 500, 600]],
    "allgather step 0": [[111, 222, 333, 444, 505, 606], [11, 22, 333, 444, 555, 666],
                         [111, 222, 330, 440, 555, 666]],
    "allgather step 1": [[111, 222, 333, 444, 555, 666]] * 3,
}


@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S)
def test_03_ring_replayed_and_stepped_by_hand_matches_the_lecture_and_sharding_divides_adam_state():
    notebook, report = run_notebook("03_ring_watched.ipynb", """
import ddl_magic
{"by_hand": by_hand, "agree": agree, "pool_stopped": ddl_magic.active_pool() is None,
 "sums": [sum_2, sum_3, sum_4],
 "lecture": {n: bool(t["as the lecture says"].all()) for n, t in steps.items()},
 "steps": {n: len(t) for n, t in steps.items()},
 "complete": {n: all(len(h) == n for row in replay(t, n)[-1][2] for h in row) for n, t in steps.items()},
 "sent": traffic["ring: sent per rank (MB)"].to_dict(),
 "formula": traffic["2(N-1)K/N (MB)"].to_dict(),
 "same": traffic["every rank the same"].astype(bool).to_dict(),
 "frames": {n: len(ring_figure(t, n).frames) for n, t in steps.items()},
 "adam_mb": [whole_mb, share_2_mb, share_4_mb]}
""")
    assert report["sums"] == [3.0, 6.0, 10.0]
    for n in ("2", "3", "4"):
        size = int(n)
        assert report["steps"][n] == size * 2 * (size - 1)
        assert report["lecture"][n], f"N={n}: a rank sent another chunk than the lecture says"
        assert report["complete"][n]
        assert report["sent"][n] == pytest.approx(report["formula"][n])
        assert report["same"][n]
        assert report["frames"][n] == 2 * (size - 1) + 1
    assert report["sent"]["4"] == pytest.approx(7.2)  # 2 * 3/4 * 4.8 MB
    # The ring by hand: one cell per step on a pool, the buffers kept on the ranks in between.
    assert report["by_hand"] == RING_BY_HAND
    assert report["agree"] == [True, True, True]  # every rank's buffer is hvd.allreduce's sum
    assert report["pool_stopped"]
    assert ("every rank's buffer equals hvd.allreduce: [True, True, True]; "
            "each is the sum of the three gradients: True") in printed_text(notebook)
    step_cells = [cell.source for cell in notebook.cells if cell.cell_type == "code"
                  and re.fullmatch(r"%%horovod --quiet\n(scatter_reduce|allgather)\(step=\d\)", cell.source)]
    assert len(step_cells) == 4  # 2(N - 1) cells, each one step
    whole, share_2, share_4 = report["adam_mb"]
    parameters = 1024 * 1024 * 2 + 1024 * 512 + 1024 * 2 + 512
    assert whole == pytest.approx(8 * parameters / 1e6)  # two float32 moments per parameter
    assert (share_2, share_4) == (pytest.approx(whole / 2, rel=1e-3), pytest.approx(whole / 4, rel=1e-3))


@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S)
def test_04_timeline_shows_fusion_overlap_and_who_waits_for_the_slow_rank():
    notebook, report = run_notebook("04_reading_a_timeline.ipynb", """
slow_runs = waiting[waiting["run"] == "rank 1 sleeps"].set_index("rank")
{"fused": int(runs["tensors"].max()), "gradients": int(runs["tensors"].sum()), "steps": STEPS,
 "started": overlap["allreduces started during backward"].tolist(),
 "hidden": overlap["share of ring time hidden"].tolist(),
 "wait": slow_runs["negotiating ms"].tolist(), "slept": slow_runs["sleeping ms"].tolist(),
 "delay_ms": STEPS * DELAY_S * 1000}
""")
    assert report["fused"] >= 2  # some ring runs carried several gradients
    assert report["gradients"] == 8 * report["steps"]  # every gradient went through a ring run
    for started in report["started"]:
        submitted, _, total = started.split()
        assert submitted == total and int(total) > 0
    assert min(report["hidden"]) > 0.1
    wait, slept, delay = report["wait"], report["slept"], report["delay_ms"]
    assert slept[1] >= delay and slept[0] == slept[2] == 0
    assert wait[0] - wait[1] > 0.5 * delay and wait[2] - wait[1] > 0.5 * delay
    assert "rank 1 slept 1000 ms in all" in printed_text(notebook)
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    assert sum(map(is_figure, outputs)) >= 2
    # The summary under the last figure tells the lab's story first: the slow rank waits least.
    # (The figure's own text is left out: its base64 data may spell "nan" by chance.)
    summary = shown_text(notebook.cells[-2], figures=False)
    assert re.search(r"^Waited longest: rank [02] \(.*; shortest: rank 1 \(", summary, re.M), summary
    assert "wait ms" in summary and "nan" not in summary.lower()


@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S)
def test_05_plain_ddp_learns_over_gloo_ddl_and_torch_distributor_and_ddl_shows_its_buckets():
    notebook, report = run_notebook("05_plain_ddp.ipynb", """
from ddl_magic.timeline.analysis import format_summary, summarize
from ddl_magic.timeline.load import load_trace
bucket_allreduces = ddl_events[(ddl_events["lane"] == "shared_memory")
                               & ddl_events["name"].str.startswith("ddl0.allreduce")
                               & (ddl_events["args"].map(lambda a: a.get("bytes")) == 115752)]
{"runs": runs, "steps": STEPS, "gloo_events": len(gloo_events),
 "lanes": sorted(set(ddl_events["lane"])),
 "buckets": {str(rank): int(n) for rank, n in bucket_allreduces.groupby("rank").size().items()},
 "first_calls": calls["call"].head(6).tolist(), "first_bytes": calls["bytes"].head(6).tolist(),
 "shown": format_summary(summarize(load_trace(f"{TRACES}/ddl.json"))).to_dict(orient="list")}
""")
    runs = report["runs"]
    assert [run["backend"] for run in runs.values()] == ["gloo", "ddl", "gloo"]
    for name, run in runs.items():
        assert run["test accuracy"] >= 0.85 and run["loss"] < 0.6, (name, run)
        assert len({rank["fingerprint"] for rank in run["ranks"]}) == 1, (name, run)
    # gloo and ddl add the same two halves: bit for bit the same weights, as the lab says.
    assert len({rank["fingerprint"] for run in runs.values() for rank in run["ranks"]}) == 1, runs
    # gloo's collectives never reach ddl_magic's timeline; ddl's do, one bucket per step.
    assert report["gloo_events"] == 0
    assert report["lanes"] == ["negotiate", "shared_memory"]
    assert report["buckets"] == {"0": report["steps"], "1": report["steps"]}
    # DDP's protocol, read off the timeline in the order the lab explains it.
    assert report["first_calls"] == ["ddl0.allgather.0", "ddl0.broadcast.0", "ddl0.broadcast.1",
                                     "ddl0.allreduce.0", "ddl0.broadcast.2", "ddl0.broadcast.3"]
    assert report["first_bytes"] == [16, 208, 115752, 115752, 28, 4]
    text = printed_text(notebook)
    assert "events on the gloo run's timeline: 0" in text
    assert "ranks agree in every run: True; every run the same weights: True" in text
    # Each %%horovod --timeline cell drew its timeline; the port is one import.
    timeline_cells = [cell for cell in notebook.cells
                      if cell.cell_type == "code" and cell.source.startswith("%%horovod -np 2 --timeline")]
    assert len(timeline_cells) == 2
    for cell in timeline_cells:
        assert any(map(is_figure, cell.outputs))
    # Under them, the summary as a report: "–" where the runtime packed nothing, and the bytes
    # that ranks sharing memory moved counted on the bus (not 0, not NaN).
    gloo_cell, ddl_cell = timeline_cells
    assert "The timeline holds no events." in shown_text(gloo_cell)
    assert re.search(r"^Waited longest: rank [01] \(", shown_text(ddl_cell), re.M)
    shown = report["shown"]
    assert "compute ms" not in shown  # ranks sharing memory pack nothing: no column of dashes
    for column in ("bus MB", "bus GB/s", "communicate ms"):
        assert all(re.fullmatch(r"[\d,]+(\.\d+)?", cell) and float(cell.replace(",", "")) > 0
                   for cell in shown[column]), shown
    code = source_of(notebook, "code")
    assert 'dist.init_process_group(backend)' in code and "DistributedDataParallel(" in code
    assert "import ddl_magic.torch" not in code and "hvd." not in code  # plain torch.distributed
    assert "from ddl_magic import TorchDistributor" in code


@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S)
def test_06_a_model_too_big_for_one_rank_measures_what_the_accounting_says():
    notebook, report = run_notebook("06_a_model_too_big_for_one_rank.ipynb", """
{"table": table.to_dict(orient="records"), "plain": plain, "checkpointed": checkpointed,
 "saved": saved, "resumed": resumed, "capped": capped}
""")
    for row in report["table"]:  # to the rows an uneven shard adds, the paper's sums
        assert abs(row["measured MB"] - row["accounting MB"]) <= 0.01 * row["accounting MB"], row
    by_strategy = {row["strategy"]: row["measured MB"] for row in report["table"]}
    assert by_strategy["fsdp2"] < by_strategy["hsdp"] < by_strategy["zero1"] < by_strategy["ddp"]
    assert report["plain"] > 3 * report["checkpointed"]
    assert report["resumed"] == report["saved"] and len(report["saved"]) == 16
    assert len(report["capped"]) == 4 and max(report["capped"]) < 300 << 20
    assert "resumed on 2 ranks with the weights saved by 4: True" in printed_text(notebook)


def test_the_labs_are_committed_without_outputs():
    """A lab with outputs in the repository would show a stale run, and a clone that runs
    it would differ from the repository (jupyter_lab_config.py saves them without outputs)."""
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        ran = [number for number, cell in enumerate(notebook.cells) if cell.cell_type == "code"
               and (cell.outputs or cell.execution_count is not None)]
        assert not ran, f"{path.name}: cells {ran} hold outputs; clear them before committing"
