"""What a rank runs: a function (HorovodRunner, TorchDistributor), a notebook cell (%%horovod)
or a script (ddlrun, TorchDistributor).

A task is cloudpickled once on the driver and unpickled on every rank by the worker, which
calls `run()` and sends the return value back.
"""

from __future__ import annotations

import ast
import linecache
import runpy
import sys
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

    def run(self) -> Any:
        # Registered so that tracebacks quote the cell's own lines.
        linecache.cache[self.filename] = (len(self.source), None, self.source.splitlines(True),
                                          self.filename)
        tree = ast.parse(self.source, filename=self.filename)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        namespace = {"__name__": "__main__", "__builtins__": __builtins__, **self.namespace}
        exec(compile(tree, self.filename, "exec"), namespace)
        if last is None:
            return None
        return eval(compile(ast.Expression(last.value), self.filename, "eval"), namespace)


@dataclass
class ScriptTask:
    """`python script.py args...`, as `ddlrun` asks; its exit status is the rank's."""

    path: str
    args: list[str]

    def run(self) -> None:
        sys.argv = [self.path, *self.args]
        runpy.run_path(self.path, run_name="__main__")
