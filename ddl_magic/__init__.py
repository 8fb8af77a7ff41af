"""ddl_magic: distributed deep learning from a notebook cell.

    %load_ext ddl_magic
    %%horovod -np 2
    import ddl_magic.torch as hvd
    hvd.init()
    ...

or, as a function: ``HorovodRunner(np=-2).run(train, lr=0.01)``, or decorated as on
Databricks: ``@distributed(np=2)`` then ``train.distributed(0.01)`` (every rank's return
value); plain torch.distributed code (DDP, FSDP) runs the same way, or through pyspark's API:
``TorchDistributor(num_processes=2, use_gpu=False).run(train, 0.01)``.
"""

import importlib

__all__ = ["DeepspeedTorchDistributor", "HorovodRunner", "Pool", "RankFailedError", "RunResult", "TorchDistributor",
           "active_pool", "distributed", "last_run", "load_ipython_extension", "show_timeline",
           "start"]

# Imported when first used, not with the package: a rank or a Spark task imports
# `ddl_magic.<module>` and must not pay for the driver's run machinery and notebook UI.
_DRIVER_API = {"HorovodRunner": ".frontends.runner", "RankFailedError": ".driver.run_result",
               "RunResult": ".driver.run_result", "last_run": ".driver.job",
               "TorchDistributor": ".frontends.torch_distributor",
               "DeepspeedTorchDistributor": ".frontends.deepspeed_distributor",
               "distributed": ".frontends.decorator",
               "Pool": ".driver.pool", "active_pool": ".driver.pool",
               "start": ".frontends.pool_magic"}


def __getattr__(name: str):
    if name not in _DRIVER_API:
        raise AttributeError(f"module 'ddl_magic' has no attribute {name!r}")
    return getattr(importlib.import_module(_DRIVER_API[name], __name__), name)


def show_timeline(path_or_run, **options) -> None:
    """Show a run's timeline (a path, or `last_run()`) in the notebook: see ddl_magic.ui."""
    from .ui.show_timeline import show_timeline as show

    show(path_or_run, **options)  # plotly and pandas load only when a timeline is shown
__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    """`%load_ext ddl_magic`: registers the `%%horovod` cell magic."""
    from .launch.local import prewarm
    from .frontends.magic import HorovodMagics, show_run_error

    ipython.register_magics(HorovodMagics)
    ipython.set_custom_exc(show_run_error.handles, show_run_error)
    prewarm()  # the first cell then finds torch already imported in the rank factory
