"""Reading a JSON trace (ours, Horovod's, any Chrome trace) a chunk at a time.

``json.loads`` on a whole trace holds the file's text and every event as a Python dict at
once: about ten times the file's size, so a few-gigabyte Horovod timeline does not fit. This
reader keeps one chunk of text and one batch of events in memory: it finds the event array
(the file itself, or the ``traceEvents`` of a Chrome trace object) and decodes its events
with the standard library's C parser, handing them on in batches for the caller to turn into
columns. Writers that put one event on a line (ours, Horovod's, most tools') are parsed a
chunk's whole lines at a time, as fast as ``json.loads`` on the whole file; any other layout
is decoded event by event (``JSONDecoder.raw_decode``), about half as fast.

A file cut short is read up to its last complete event: Horovod's timelines often have no
closing ``]`` (and older ones end every line with a comma), and a killed writer can leave
half an event.

Example:
    >>> events = JsonTraceEvents("horovod_timeline.json")       # doctest: +SKIP
    >>> for batch in events:                                    # doctest: +SKIP
    ...     print(events.kind, len(batch))
    array 100000
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Iterator
from typing import Any

CHUNK_BYTES = 16 << 20
EVENTS_PER_BATCH = 100_000

_SEPARATORS = re.compile(r"[\s,]*")
_ARRAY_END_LINE = re.compile(r"\n[ \t]*\]")
_TRACE_EVENTS_KEY = re.compile(r'"traceEvents"\s*:\s*\[')
_NOT_A_TRACE = "the file is neither a JSON array of events nor a Chrome trace object"


class JsonTraceEvents:
    """Iterates over a JSON trace's events in batches (lists of dicts).

    After iterating: ``kind`` is "array" (a bare array of events: Horovod's) or "object" (a
    Chrome trace object with ``traceEvents``: ours and most tools'), and ``truncated`` says
    the file ended before its event array did. A file that is no trace raises ``ValueError``
    when iteration starts.
    """

    def __init__(self, path: str | os.PathLike[str], chunk_bytes: int = CHUNK_BYTES) -> None:
        self.path = path
        self.chunk_bytes = chunk_bytes
        self.kind: str | None = None
        self.truncated = False

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        with open(self.path, "rb") as file:
            reader = _TextChunks(file, self.chunk_bytes)
            position = self._find_event_array(reader)
            if position is not None:
                yield from self._events_from(reader, position)

    def _find_event_array(self, reader: _TextChunks) -> int | None:
        """Where the first event starts in ``reader.text``; None for an empty trace."""
        while not reader.text.strip() and reader.read_more():
            pass
        start = len(reader.text) - len(reader.text.lstrip())
        if start == len(reader.text):  # Horovod creates the file before it writes its "["
            self.kind, self.truncated = "array", True
            return None
        if reader.text[start] == "[":
            self.kind = "array"
            return start + 1
        if reader.text[start] == "{":
            self.kind = "object"
            while (found := _TRACE_EVENTS_KEY.search(reader.text)) is None:
                if not reader.read_more():
                    return self._object_without_events(reader.text)
            return found.end()
        try:
            document = json.loads(reader.text + reader.read_rest())
        except json.JSONDecodeError:
            raise ValueError(_NOT_A_TRACE) from None
        raise ValueError(f"{self.path} is not a Chrome trace: its JSON is a {type(document).__name__}")

    def _object_without_events(self, text: str) -> None:
        """A whole JSON object with no ``traceEvents``: a trace of no events, if it parses."""
        try:
            json.loads(text)
        except json.JSONDecodeError:
            if '"traceEvents"' not in text:
                raise ValueError(_NOT_A_TRACE) from None
            self.truncated = True  # cut inside the key itself
        return None

    def _events_from(self, reader: _TextChunks, position: int) -> Iterator[list[dict[str, Any]]]:
        decode = json.JSONDecoder().raw_decode
        batch: list[dict[str, Any]] = []
        one_event_per_line = True  # until a block of whole lines fails to parse as events
        while True:
            position = _SEPARATORS.match(reader.text, position).end()
            if position >= len(reader.text):
                position = reader.keep_from(position)
                if reader.read_more():
                    continue
                self.truncated = True  # no closing "]"
                break
            if reader.text[position] == "]":
                break
            if one_event_per_line:
                lines = _whole_lines_of_events(reader.text, position)
                if lines:
                    try:
                        events = json.loads(f"[{lines.rstrip().rstrip(',')}]")
                    except json.JSONDecodeError:
                        one_event_per_line = False
                    else:
                        batch.extend(event for event in events if isinstance(event, dict))
                        position += len(lines)
                        if len(batch) >= EVENTS_PER_BATCH:
                            yield batch
                            batch = []
                        continue
            try:
                event, position = decode(reader.text, position)
            except json.JSONDecodeError:
                # Half an event at the end of the chunk: read on, or the file was cut here.
                position = reader.keep_from(position)
                if reader.read_more():
                    continue
                self.truncated = True
                break
            if isinstance(event, dict):
                batch.append(event)
                if len(batch) >= EVENTS_PER_BATCH:
                    yield batch
                    batch = []
        if batch:
            yield batch


def _whole_lines_of_events(text: str, position: int) -> str:
    """The text from ``position`` to the last line break held, short of a line closing the
    event array: whole events, if the writer put one on each line."""
    end = text.rfind("\n", position)
    if end <= position:
        return ""
    lines = text[position:end]
    closing = _ARRAY_END_LINE.search(lines)
    return lines[:closing.start()] if closing else lines


class _TextChunks:
    """A binary file read as text a chunk at a time; ``text`` is what is held now."""

    def __init__(self, file: Any, chunk_bytes: int) -> None:
        self._file = file
        self._chunk_bytes = chunk_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.read_more()

    def read_more(self) -> bool:
        """Append the next chunk to ``text``; False at the end of the file."""
        data = self._file.read(self._chunk_bytes)
        self.text += self._decoder.decode(data, final=not data)
        return bool(data)

    def read_rest(self) -> str:
        """The text not read yet, to the end of the file."""
        return self._decoder.decode(self._file.read(), final=True)

    def keep_from(self, position: int) -> int:
        """Drop the text before ``position``; returns where ``position`` now is (0)."""
        self.text = self.text[position:]
        return 0
