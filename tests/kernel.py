"""A real IPython kernel (jupyter_client) that tests drive cell by cell, as a notebook does."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

from jupyter_client.manager import start_new_kernel


def users_kernel_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment as a kernel a user starts would have it.

    Under pytest, ipykernel sees PYTEST_CURRENT_TEST and leaves the process's stderr file
    descriptor alone: what a child process (Spark's JVM) or C code writes there then reaches
    the test's terminal, where a user's notebook shows it in a cell, as a pink box.
    """
    import os

    environment = {**os.environ, **(extra or {})}
    environment.pop("PYTEST_CURRENT_TEST", None)
    return environment


@dataclass
class CellOutput:
    stdout: str = ""
    stderr: str = ""
    result: str | None = None  # text/plain of the execute_result
    error: dict | None = None  # {"ename", "evalue", "traceback"}
    displays: list[dict] = field(default_factory=list)  # display_data bundles

    @property
    def text(self) -> str:
        return self.stdout + self.stderr


class Kernel:
    """Starts a kernel, runs cells, collects what a notebook would show."""

    def __init__(self, env: dict[str, str] | None = None, cwd: str | None = None):
        import os
        self.manager, self.client = start_new_kernel(
            kernel_name="python3", env={**os.environ, **(env or {})}, cwd=cwd)

    def run(self, code: str, timeout: float = 120, on_output=None, on_message=None) -> CellOutput:
        """Execute `code`; `on_output(text)` is called with each stream chunk as it arrives,
        `on_message(message)` with every message the cell sends (widget updates included)."""
        msg_id = self.client.execute(code)
        output = CellOutput()
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"cell did not finish in {timeout} s; output so far: {output}")
            try:
                message = self.client.get_iopub_msg(timeout=remaining)
            except queue.Empty:
                continue
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            if on_message is not None:
                on_message(message)
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                setattr(output, content["name"], getattr(output, content["name"]) + content["text"])
                if on_output is not None:
                    on_output(content["text"])
            elif kind == "execute_result":
                output.result = content["data"].get("text/plain")
            elif kind == "display_data":
                output.displays.append(content["data"])
            elif kind == "error":
                output.error = content
            elif kind == "status" and content["execution_state"] == "idle":
                return output

    def interrupt(self) -> None:
        self.manager.interrupt_kernel()

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)
