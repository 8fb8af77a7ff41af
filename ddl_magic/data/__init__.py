"""Training data as each rank's share: a Spark DataFrame (or pandas, Parquet, Delta) given to
a run reaches every rank's training loop as its own share, streamed batch by batch.

On the driver, give a run its data (`%%horovod -np 4 --data train=df`,
`HorovodRunner(np).run(main, train=df)`, ...); on each rank, read it::

    loader = train.loader(batch_size=256, columns=["features", "label"], shuffle=True, seed=0)
    for epoch in range(epochs):
        for batch in loader:
            ...

What each module decides: `order` (pure: which rows, in what order, how many steps),
`columns` (which Arrow types become tensors), `share_file` (a share on disk, with no name),
`sources` (where a rank's share comes from), `share` (what the rank's code holds), `loader`
(batches of tensors, a torch IterableDataset, their state for checkpoints).
"""

from .share import Share, share
from .sources import Data, ShareSourceError

__all__ = ["Data", "Share", "ShareSourceError", "share"]
