"""A rank's traceback as the user should see it: their code, not ddl_magic's machinery.

A collective that fails deep in the runtime reports five frames of ours (``process_sets.py``,
``ops.py``, ``op_queue.py``...) under the user's own line; they say nothing the user can act
on and push the line that matters out of sight. The displays show the traceback with those
frames left out and a note saying how many; the rank's log keeps every frame.

The traceback arrives as text (the rank formatted it, maybe on another machine, where
ddl_magic is installed elsewhere), so a frame is ours when its file lies in a ``ddl_magic``
package folder, wherever that is.

Example:
    >>> text = '''Traceback (most recent call last):
    ...   File "<cell>", line 5, in <module>
    ...     hvd.allreduce(x)
    ...   File "/site-packages/ddl_magic/torch/ops.py", line 80, in allreduce
    ...     return synchronize(handle)
    ... RuntimeError: rank 1 left
    ... '''
    >>> print(without_machinery_frames(text, "rank-0.log"))
    Traceback (most recent call last):
      File "<cell>", line 5, in <module>
        hvd.allreduce(x)
      [1 frame inside ddl_magic not shown; rank-0.log has them all]
    RuntimeError: rank 1 left
    <BLANKLINE>
"""

from __future__ import annotations

import re

_FRAME = re.compile(r'^  File "(?P<file>[^"]*)", line \d+')
_OURS = re.compile(r"[/\\]ddl_magic[/\\](?!tests[/\\])[\w/\\]*\.py$|^<frozen runpy>$")


def without_machinery_frames(text: str, full_log: str = "the rank's log") -> str:
    """``text`` (one or more chained tracebacks) without the frames inside ddl_magic.

    A traceback whose every frame is ours (a failure of ddl_magic itself) is kept whole: it
    is then the only clue. ``full_log`` names where the whole traceback can be read.
    """
    lines = text.splitlines(keepends=True)
    blocks = _frame_blocks(lines)
    kept: list[str] = []
    position = 0
    for group in _tracebacks(blocks):
        user_frames = [block for block in group if not _is_ours(lines[block[0]])]
        hidden = len(group) - len(user_frames) if user_frames else 0
        first, last = group[0][0], group[-1][1]
        kept.extend(lines[position:first])
        for start, end in group:
            if not hidden or not _is_ours(lines[start]):
                kept.extend(lines[start:end])
        if hidden:
            plural = "frame" if hidden == 1 else "frames"
            kept.append(f"  [{hidden} {plural} inside ddl_magic not shown; {full_log} has them all]\n")
        position = last
    kept.extend(lines[position:])
    return "".join(kept)


def _frame_blocks(lines: list[str]) -> list[tuple[int, int]]:
    """(first line, line after the last) of every frame: its "File" line and the indented
    lines under it (source, carets)."""
    blocks = []
    at = 0
    while at < len(lines):
        if _FRAME.match(lines[at]):
            end = at + 1
            while end < len(lines) and lines[end].startswith("    ") and not _FRAME.match(lines[end]):
                end += 1
            blocks.append((at, end))
            at = end
        else:
            at += 1
    return blocks


def _tracebacks(blocks: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """The frames grouped by traceback: frames that follow each other without a line between."""
    groups: list[list[tuple[int, int]]] = []
    for block in blocks:
        if groups and groups[-1][-1][1] == block[0]:
            groups[-1].append(block)
        else:
            groups.append([block])
    return groups


def _is_ours(frame_line: str) -> bool:
    return bool(_OURS.search(_FRAME.match(frame_line).group("file")))
