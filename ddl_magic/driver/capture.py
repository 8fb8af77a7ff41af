"""From a notebook cell to the bytes every rank runs: the one place that decides what is captured.

The cell is treated as the body of a function: the notebook names it *reads* without
assigning them (variables, functions, classes, modules) are captured; the names it assigns
stay on the ranks. Python's own `symtable` decides which is which, so nested functions,
comprehensions and classes in the cell follow Python's scoping rules exactly.

Everything is cloudpickled once. When that fails, each captured name is tried alone so the
error can say which variable cannot travel, and what to do about it. A tensor the notebook
holds on its GPU travels as a host copy and lands on each rank's own GPU
(`wire/cuda_values.py`); the capture says so before launch, naming the variables.
"""

from __future__ import annotations

import builtins
import inspect
import io
import symtable
import textwrap
from dataclasses import dataclass, field

import cloudpickle

from ..wire import cuda_values
from ..wire.tasks import CellTask, FunctionTask

LARGE_PAYLOAD_BYTES = 50 * 1024 * 1024
REPORT_WIDTH = 100
"""The capture line's width: it fits a notebook beside JupyterLab's file browser."""
_NOTEBOOK_INTERNALS = {"In", "Out", "get_ipython", "exit", "quit", "_", "__", "___"}


class CaptureError(ValueError):
    """The cell cannot be sent to the ranks; the message says why and what to do."""


@dataclass
class CapturedCell:
    payload: bytes
    names: dict[str, str]  # captured name -> its type, for the report line
    ranks_own: list[str] = field(default_factory=list)  # read, and the pool's ranks' own
    on_gpu: list[str] = field(default_factory=list)  # captured names holding CUDA tensors

    def report(self, width: int = REPORT_WIDTH) -> str:
        """'captured lr (float), Net (class), torch (module) · payload 3.1 KB', and in a pool
        '... · the ranks' own: model, opt · ...', wrapped to `width` between names (a
        notebook wraps a long line anywhere, mid-word too); a line more for CUDA tensors
        captured.

        >>> print(CapturedCell(b"x" * 3174, {"lr": "float", "Net": "class"}, ["model"]).report(width=40))
        ddl_magic: captured lr (float),
          Net (class) · the ranks' own: model ·
          payload 3.1 KB
        """
        # A no-break space holds what must stay on one line: a name and its kind, "the
        # ranks' own:", the payload's size; textwrap breaks at ordinary spaces only.
        listed = ", ".join(f"{name}\xa0({kind})" for name, kind in self.names.items()) or "no notebook names"
        own = f" · the\xa0ranks'\xa0own: {', '.join(self.ranks_own)}" if self.ranks_own else ""
        line = f"ddl_magic: captured {listed}{own} · payload\xa0{format_bytes(len(self.payload)).replace(' ', chr(160))}"
        wrapped = textwrap.fill(line, width, subsequent_indent="  ", break_long_words=False,
                                break_on_hyphens=False).replace("\xa0", " ")
        return wrapped + ("\n" + gpu_note(self.on_gpu) if self.on_gpu else "")

    @property
    def is_large(self) -> bool:
        return len(self.payload) > LARGE_PAYLOAD_BYTES


def capture_cell(source: str, namespace: dict, ranks_own: set[str] | frozenset = frozenset(),
                 filename: str = "<%%horovod cell>") -> CapturedCell:
    """Build the payload for `source`, capturing the names it reads from `namespace`.

    `ranks_own`: names that a pool's ranks assigned in earlier cells; they are the ranks'
    own, and a notebook name of the same spelling is not sent.

    >>> captured = capture_cell("y = x * 2\\ny", {"x": 21})
    >>> captured.names
    {'x': 'int'}
    """
    if "get_ipython()" in source:
        raise CaptureError(
            "this cell uses IPython syntax (a %magic or !shell line), which cannot run on the "
            "ranks: they run plain Python. Move that line to a cell of its own.")
    read = names_read(source)
    names = {name: namespace[name] for name in read if name in namespace and name not in ranks_own}
    payload = _pickle(CellTask(source, names, filename), names)
    return CapturedCell(payload, {name: _kind(value) for name, value in names.items()},
                        [name for name in read if name in ranks_own],
                        [name for name, value in names.items() if cuda_values.holds_cuda_tensors(value)])


def unknown_names(source: str, namespace: dict) -> list[str]:
    """The names `source` reads that neither the notebook (`namespace`) nor the cell defines.

    >>> unknown_names("model.train()\\nn = len(data)", {"data": []})
    ['model']
    """
    return [name for name in names_read(source) if name not in namespace and not name.startswith("__")]


def capture_function(function, kwargs: dict, args: tuple = ()) -> bytes:
    """The payload for `HorovodRunner.run(function, **kwargs)`, naming what cannot be pickled."""
    try:
        payload = dumps(FunctionTask(function, kwargs, tuple(args)))
    except Exception as whole_error:
        name = getattr(function, "__name__", repr(function))
        used = inspect.getclosurevars(function) if inspect.isfunction(function) else None
        positional = {f"#{i + 1}": value for i, value in enumerate(args)}
        for where, values in (("argument", {**positional, **kwargs}),
                              ("variable", {**used.nonlocals, **used.globals} if used else {})):
            culprit = _first_unpicklable(values)
            if culprit is not None:
                raise CaptureError(
                    f"{name}() uses the {where} {culprit}. Create it inside {name}() instead, "
                    "or pass what it is made from.") from None
        raise CaptureError(f"{name}() cannot be sent to the ranks: {whole_error}") from None
    on_gpu = [name for name, value in {**dict(enumerate(args)), **kwargs}.items()
              if cuda_values.holds_cuda_tensors(value)]
    if on_gpu:
        print(gpu_note([f"argument {name}" for name in on_gpu]))
    return payload


def gpu_note(names: list[str]) -> str:
    """What happens to the notebook's CUDA tensors, said before launch."""
    return (f"ddl_magic note: {', '.join(names)} hold{'s' if len(names) == 1 else ''} tensors on the "
            "notebook's GPU: each rank gets a copy on its own GPU (cuda:<local_rank>), through host "
            "memory. Create them inside the cell to skip the copy.")


def dumps(value: object) -> bytes:
    """`cloudpickle.dumps`, with CUDA tensors device-neutral (`wire/cuda_values.py`)."""
    out = io.BytesIO()
    _DeviceNeutralPickler(out, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(value)
    return out.getvalue()


class _DeviceNeutralPickler(cloudpickle.CloudPickler):
    def reducer_override(self, obj):
        if cuda_values.is_cuda_tensor(obj):
            return cuda_values.device_neutral(obj)
        return super().reducer_override(obj)


def names_read(source: str) -> list[str]:
    """The global names `source` reads when run as a function body, in order of appearance.

    >>> names_read("import math\\nz = math.pi * r\\ndef f(): return z + w")
    ['r', 'w']
    """
    body = textwrap.indent(source, "    ") or "    pass"
    try:
        table = symtable.symtable(f"def __cell__():\n{body}\n    pass\n", "<%%horovod cell>", "exec")
    except SyntaxError as exc:
        raise CaptureError(f"the cell has a syntax error on line {exc.lineno - 1 if exc.lineno else '?'}: "
                           f"{exc.msg}") from None
    found: dict[str, None] = {}
    _collect_globals(table.get_children()[0], found)
    return [name for name in found
            if name not in _NOTEBOOK_INTERNALS and not hasattr(builtins, name)]


def _collect_globals(table: symtable.SymbolTable, found: dict[str, None]) -> None:
    for symbol in table.get_symbols():
        if symbol.is_global() and (symbol.is_referenced() or symbol.is_assigned()):
            found.setdefault(symbol.get_name(), None)
    for child in table.get_children():
        _collect_globals(child, found)


def _pickle(task: CellTask, names: dict) -> bytes:
    try:
        return dumps(task)
    except Exception as whole_error:
        culprit = _first_unpicklable(names)
        if culprit is not None:
            raise CaptureError(
                f"the cell uses the notebook variable {culprit}. Create it inside the cell "
                "instead (each rank then builds its own), or pass what it is made from (a path, "
                "a config dict).") from None
        raise CaptureError(f"the cell cannot be sent to the ranks: {whole_error}") from None


def _first_unpicklable(values: dict) -> str | None:
    """"'lock' (lock), which cannot be sent to the ranks: TypeError: ..." for the first one."""
    for name, value in values.items():
        if type(value).__name__ == "DataFrame" and type(value).__module__.startswith("pyspark"):
            return (f"{name!r} (a Spark DataFrame), whose rows cannot be sent whole: give them "
                    f"to the ranks as their shares, %horovod data {name}={name} in a pool (once: "
                    f"the ranks keep them), or --data {name}={name} for one function run")
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            return (f"{name!r} ({_kind(value)}), which cannot be sent to the ranks: "
                    f"{type(exc).__name__}: {exc}")
    return None


def _kind(value: object) -> str:
    if isinstance(value, type):
        return "class"
    kind = type(value).__name__
    return "function" if kind in ("function", "builtin_function_or_method") else kind


def format_bytes(count: int) -> str:
    """1536 -> '1.5 KB'"""
    size = float(count)
    for unit in ("B", "KB", "MB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"
