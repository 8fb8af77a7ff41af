"""What a rank runs: a function (HorovodRunner, TorchDistributor, @distributed), a notebook cell
(%%horovod), or a Python command: a script (ddlrun, TorchDistributor), a module (`ddlrun
python -m`) or a string of code (`ddlrun python -c`).

A task is cloudpickled once on the driver and unpickled on every rank by the worker, which
calls `run()` and sends the return value back.
"""

from __future__ import annotations

import ast
import linecache
import os
import runpy
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class FunctionTask:
    """`main(*args, **kwargs)`, as `HorovodRunner.run(main, **kwargs)` and
    `TorchDistributor.run(main, *args, **kwargs)` ask."""

    function: Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    args: tuple = ()

    def run(self) -> Any:
        return self.function(*self.args, **self.kwargs)


@dataclass
class CellTask:
    """A notebook cell's source with the notebook names it reads.

    The cell runs as module-level code in a fresh namespace holding the captured names, so
    functions and classes it defines behave as in the notebook and the names it assigns stay
    on the rank. Like IPython, the value of a final expression is the cell's result.
    """

    source: str
    namespace: dict[str, Any]
    filename: str = "<%%horovod cell>"

    def run(self, namespace: dict[str, Any] | None = None) -> Any:
        """Run in a fresh namespace, or in `namespace` (a pool rank's own, which persists
        between cells: the captured names are put in it first)."""
        # Registered so that tracebacks quote the cell's own lines.
        linecache.cache[self.filename] = (len(self.source), None, self.source.splitlines(True),
                                          self.filename)
        tree = ast.parse(self.source, filename=self.filename)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        if namespace is None:
            namespace = {}
        namespace.setdefault("__name__", "__main__")
        namespace.setdefault("__builtins__", __builtins__)
        namespace.update(self.namespace)
        exec(compile(tree, self.filename, "exec"), namespace)
        if last is None:
            return None
        return eval(compile(ast.Expression(last.value), self.filename, "eval"), namespace)


@dataclass
class ScriptTask:
    """`python script.py args...`, as `ddlrun` asks; its exit status is the rank's."""

    path: str
    args: list[str]
    shares: dict[str, Any] = field(default_factory=dict)  # its datasets: ddl_magic.data.share(name)

    def run(self) -> None:
        sys.argv = [self.path, *self.args]
        # As `python sub/train.py` does: modules beside the script import.
        sys.path.insert(0, os.path.dirname(os.path.abspath(self.path)))
        runpy.run_path(self.path, run_name="__main__")


@dataclass
class ModuleTask:
    """`python -m module args...`, as `ddlrun` asks; its exit status is the rank's.

    As Python's `-m` does, the module runs as `__main__` (a package runs its `__main__`
    submodule) with `sys.argv[0]` its file's path.
    """

    module: str
    args: list[str]
    shares: dict[str, Any] = field(default_factory=dict)  # its datasets: ddl_magic.data.share(name)

    def run(self) -> None:
        sys.argv = [self.module, *self.args]  # runpy replaces argv[0] with the module's file
        runpy.run_module(self.module, run_name="__main__", alter_sys=True)


@dataclass
class CodeTask:
    """`python -c code args...`, as `ddlrun` asks; its exit status is the rank's.

    As Python's `-c` does, the code runs as the module `__main__` with `sys.argv[0]` "-c".
    """

    code: str
    args: list[str]
    filename: str = "<string>"
    shares: dict[str, Any] = field(default_factory=dict)  # its datasets: ddl_magic.data.share(name)

    def run(self) -> None:
        sys.argv = ["-c", *self.args]
        # Registered so that tracebacks quote the code's own lines.
        linecache.cache[self.filename] = (len(self.code), None, self.code.splitlines(True),
                                          self.filename)
        main = types.ModuleType("__main__")
        main.__builtins__ = __builtins__
        # A real module in sys.modules, so that what the code defines pickles by reference
        # (multiprocessing, torch.save), as under `python -c`.
        previous = sys.modules["__main__"]
        sys.modules["__main__"] = main
        try:
            exec(compile(self.code, self.filename, "exec"), main.__dict__)
        finally:
            sys.modules["__main__"] = previous
