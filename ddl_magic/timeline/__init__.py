"""A run's timeline as files: the lanes the runtime records, the Chrome trace it is written
to, its columnar (Arrow) copy, and reading either back for the viewer (`ui/`).

The recorder that sits on the collectives' hot path is `runtime/timeline.py`; everything here
runs in the driver or the notebook.
"""
