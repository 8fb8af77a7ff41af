"""JupyterLab for this clone's labs, as the README starts it:

    .venv/bin/jupyter lab --config=jupyter_lab_config.py

It serves the clone from its root, opens lab 01 (the URL it prints opens it too, as on a
remote machine through an SSH tunnel), and saves the labs in example_notebooks/ without
their outputs, so running a lab leaves the clone as it was: what it shows stays in the
browser until the page closes; "Save Notebook As..." into another folder keeps it.
"""

import json
import os

CLONE = os.path.dirname(os.path.abspath(__file__))
LABS = "example_notebooks/"
FIRST_LAB = LABS + "01_iris_mlp.ipynb"


def save_labs_without_outputs(model, path, contents_manager, **kwargs):
    """A lab of this clone is saved as it is committed: its code and text (yours, if you
    edited them), no outputs, and the notebook's metadata as it was (the kernel's version
    is not written in)."""
    if model.get("type") != "notebook" or not path.lstrip("/").startswith(LABS):
        return
    notebook = model["content"]
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
    saved = os.path.join(CLONE, path.lstrip("/"))
    if os.path.exists(saved):
        with open(saved, encoding="utf-8") as file:
            notebook["metadata"] = json.load(file).get("metadata", notebook.get("metadata", {}))


c = get_config()  # noqa: F821 - the name traitlets gives a config file
c.ServerApp.root_dir = CLONE
c.LabApp.default_url = "/lab/tree/" + FIRST_LAB
c.FileContentsManager.pre_save_hook = save_labs_without_outputs
