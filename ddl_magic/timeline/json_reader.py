"""Reading a JSON trace (ours, Horovod's, any Chrome trace) a chunk at a time.

``json.loads`` on a whole trace holds the file's text and every event as a Python dict at
once: about ten times the file's size, so a few-gigabyte Horovod timeline does not fit. This
reader keeps one chunk of text and one batch of events in memory: it finds the event array
(the file itself, or the ``traceEvents`` of a Chrome trace object) and parses its events a
chunk's worth at a time, handing them on in batches for the caller to turn into columns.

A batch is the held text up to the last place where one event ends and the next begins
(``}`` then ``,`` then ``{``), parsed in one call as a JSON array, whatever the layout:
one event per line (ours, Horovod's), the whole file on one line, or pretty-printed. A cut
in the wrong place (a ``}, {`` inside a list in some event's ``args``) can only give text
that does not parse, never other events: that stretch is then decoded event by event
(``JSONDecoder.raw_decode``), as is a file's last event. Where ``orjson`` is installed
(``pip install 'ddl_magic[fast-json]'``) it parses the batches, about twice as fast as the
standard library's C parser.

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
from typing import Any, Callable

try:
    from orjson import JSONDecodeError as _OrjsonError, loads as _orjson_loads
except ImportError:  # the standard library's parser does the same, about half as fast
    _OrjsonError, _orjson_loads = json.JSONDecodeError, json.loads

CHUNK_BYTES = 16 << 20
EVENTS_PER_BATCH = 100_000

_SEPARATORS = re.compile(r"[\s,]*")
_NEXT_EVENT = re.compile(r"\s*,\s*\{")
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
        one_by_one_until = 0  # a stretch whose batch did not parse: decoded event by event
        while True:
            position = _SEPARATORS.match(reader.text, position).end()
            if position >= len(reader.text):
                one_by_one_until -= position
                position = reader.keep_from(position)
                if reader.read_more():
                    continue
                self.truncated = True  # no closing "]"
                break
            if reader.text[position] == "]":
                break
            if position >= one_by_one_until:
                cut = _last_event_end(reader.text, position)
                if cut > position:
                    events = _parsed_events(reader.text[position:cut], _orjson_loads, _OrjsonError)
                    if events is None:  # cut inside an event: decode this stretch one by one
                        one_by_one_until = cut
                    else:
                        batch += [event for event in events if type(event) is dict]
                        position = cut
                        if len(batch) >= EVENTS_PER_BATCH:
                            yield batch
                            batch = []
                        continue
            try:
                event, position = decode(reader.text, position)
            except json.JSONDecodeError:
                # Half an event at the end of the chunk: read on, or the file was cut here.
                one_by_one_until -= position
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


def _last_event_end(text: str, position: int) -> int:
    """Just past the last ``}`` after ``position`` that the next event's ``{`` follows (with
    a comma between): the end of a run of whole events, if the ``}`` closes an event. -1 if
    there is none."""
    end = len(text)
    while (end := text.rfind("}", position, end)) >= 0:
        if _NEXT_EVENT.match(text, end + 1):
            return end + 1
    return -1


def _parsed_events(text: str, loads: Callable[[str], Any], error: type[Exception]) -> list | None:
    """The events of ``text``, a run of whole events separated by commas; None if it is not
    one (it was cut inside an event)."""
    try:
        return loads(f"[{text}]")
    except error:
        return None


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
