"""Cutting a rank's output into lines: endings, progress bars, pieces of any size."""

from ddl_magic.wire.output_lines import LineSplitter


def lines_of(*pieces: bytes, finish: bool = True) -> list:
    splitter = LineSplitter()
    lines = [line for piece in pieces for line in splitter.feed(piece)]
    return lines + (splitter.finish() if finish else [])


def test_lines_end_with_a_newline_and_empty_lines_count():
    assert lines_of(b"one\n\ntwo\n") == [("one", False), ("", False), ("two", False)]


def test_a_bar_redrawn_with_carriage_returns_replaces_itself_and_its_newline_adds_nothing():
    assert lines_of(b"\r10%\r50%\r100%\r\nnext\n") == [
        ("10%", True), ("50%", True), ("100%", True), ("next", False)]
    assert lines_of(b"\r10%\r100%\n") == [("10%", True), ("100%", True)]  # finished by its newline


def test_a_character_cut_between_two_reads_arrives_whole():
    text = "température ✓\n".encode()
    cut = text.index("✓".encode()) + 1  # inside the three bytes of the check mark
    assert lines_of(text[:cut], text[cut:]) == [("température ✓", False)]


def test_an_unfinished_last_line_is_kept_for_the_end_of_the_stream():
    assert lines_of(b"done\nhalf a li", b"ne", finish=False) == [("done", False)]
    assert lines_of(b"done\nhalf a li", b"ne") == [("done", False), ("half a line", False)]
    assert lines_of(b"\r40%") == [("40%", True)]
    assert lines_of(b"") == []
