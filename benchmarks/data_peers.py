"""The peers of `data.py`, run in their own virtual environment (Petastorm needs pyarrow < 15
and numpy < 2, which ddl_magic's own environment does not have): `data.py` starts this
script with that environment's Python and reads the JSON line it prints last.

    .bench-venv/bin/python benchmarks/data_peers.py petastorm --rows 1000000
    .bench-venv/bin/python benchmarks/data_peers.py mosaic --rows 1000000

For each: the same cached DataFrame as ours (`data_frame.py`), then the time from the
conversion's start to the first batch, the steady rows/s of one reader (Petastorm: shard 0 of
2; Mosaic: one process, as a rank of a 1-process world), a loop that only touches each batch,
and that reader's peak RSS. No ddl_magic here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time

from data_frame import local_spark, make_frame

BATCH_SIZE = 256


def petastorm(spark, frame, workdir: str) -> dict:
    from petastorm.spark import SparkDatasetConverter, make_spark_converter

    spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, f"file://{workdir}")
    began = time.time()
    converter = make_spark_converter(frame)
    converted = time.time() - began
    with converter.make_torch_dataloader(batch_size=BATCH_SIZE, cur_shard=0, shard_count=2,
                                         num_epochs=1) as loader:
        return _read(loader, began, {"convert_s": converted})


def mosaic(spark, frame, workdir: str) -> dict:
    import torch
    from streaming import StreamingDataset
    from streaming.base.converters import dataframe_to_mds

    out = os.path.join(workdir, "mds")
    began = time.time()
    dataframe_to_mds(frame, merge_index=True,
                     mds_kwargs={"out": out, "columns": {"features": "ndarray:float32",
                                                         "label": "int32"}})
    converted = time.time() - began
    dataset = StreamingDataset(local=out, batch_size=BATCH_SIZE, shuffle=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH_SIZE)
    return _read(loader, began, {"convert_s": converted})


def _read(loader, began: float, result: dict) -> dict:
    rows, touched, first_at = 0, 0.0, None
    for batch in loader:
        touched += float(batch["features"][0][0])
        rows += len(batch["label"])
        if first_at is None:
            first_at = time.time()
            first_rows = rows
    ended = time.time()
    result.update(first_batch_s=first_at - began, rows_read=rows,
                  rows_per_s=(rows - first_rows) / max(ended - first_at, 1e-9),
                  peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peer", choices=["petastorm", "mosaic"])
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    spark = local_spark()
    workdir = tempfile.mkdtemp(prefix="ddl_magic-bench-peers-")
    try:
        frame = make_frame(spark, args.rows)
        result = {"petastorm": petastorm, "mosaic": mosaic}[args.peer](spark, frame, workdir)
    except Exception as exc:  # the table says why a peer has no numbers
        result = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        spark.stop()
    print(json.dumps({"peer": args.peer, "rows": args.rows, **result}), flush=True)


if __name__ == "__main__":
    main()
