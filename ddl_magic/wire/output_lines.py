"""Cutting what a rank writes to stdout or stderr into the lines the run view shows.

A line ends with a newline or a carriage return. A line ending in a carriage return (a tqdm
bar redrawing itself) is a *replacing* line: it replaces the rank's previous replacing line
instead of adding one. So is the text that finishes such a bar with a newline, so that the
finished bar does not show twice.
"""

from __future__ import annotations

import codecs
from typing import Callable

Line = tuple[str, bool]  # (text without its ending, whether it replaces the previous line)


class LineSplitter:
    """Feed it bytes as they arrive, in pieces of any size; it returns the complete lines."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self._after_carriage_return = False

    def feed(self, data: bytes) -> list[Line]:
        self._pending += self._decoder.decode(data)
        lines = []
        while True:
            cut = min((i for i in (self._pending.find("\n"), self._pending.find("\r")) if i >= 0),
                      default=-1)
            if cut < 0:
                return lines
            text, ending = self._pending[:cut], self._pending[cut]
            self._pending = self._pending[cut + 1:]
            if ending == "\r":
                if text:  # tqdm starts each redraw with \r: an empty text is no line
                    lines.append((text, True))
                self._after_carriage_return = True
            else:
                if text or not self._after_carriage_return:  # "bar\r\n" adds no empty line
                    lines.append((text, self._after_carriage_return))
                self._after_carriage_return = False

    def finish(self) -> list[Line]:
        """The last line when the stream ended without a line ending (a rank that died mid-line)."""
        self._pending += self._decoder.decode(b"", final=True)
        text, self._pending = self._pending, ""
        return [(text, self._after_carriage_return)] if text else []


def forward_lines(read: Callable[[], bytes], send: Callable[[list[Line]], None]) -> None:
    """Read a stream to its end (`read()` returns b"" there) and `send` its lines as they
    complete, then its unfinished last line: what forwards a rank's output, wherever it is
    read (the rank itself, the Spark task that started it)."""
    splitter = LineSplitter()
    while chunk := read():
        if lines := splitter.feed(chunk):
            send(lines)
    if last := splitter.finish():
        send(last)
