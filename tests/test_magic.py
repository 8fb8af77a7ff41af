"""The %%horovod magic's help and its answers to mistyped lines (no kernel needed)."""

import pytest

from ddl_magic.frontends.magic import HorovodMagics, HorovodUsageError


def run_line(line: str) -> None:
    HorovodMagics(shell=None).horovod(line, "1")


def test_the_help_opens_with_the_cell_magics_own_usage_line():
    usage = HorovodMagics.horovod.__doc__.split("\n\n")[1].strip()
    assert usage.startswith("%%horovod [-np NP] ") and "[--timeline [PATH]]" in usage


@pytest.mark.parametrize("line, suggestion", [
    ("-np 2 --timline", "did you mean --timeline?"),
    ("-np 2 --quite --gpuu", "did you mean --quiet and --gpu?"),
])
def test_a_mistyped_option_gets_the_closest_real_one(line, suggestion):
    with pytest.raises(HorovodUsageError, match="unrecognized arguments") as error:
        run_line(line)
    assert suggestion in str(error.value) and "See %%horovod? for every option" in str(error.value)


def test_an_unknown_word_that_resembles_nothing_gets_no_guess():
    with pytest.raises(HorovodUsageError) as error:
        run_line("-np 2 --zzzzzz")
    assert "did you mean" not in str(error.value)


def test_the_capture_line_wraps_between_names_never_inside_one():
    from ddl_magic.driver.capture import REPORT_WIDTH, CapturedCell

    names = {f"feature_matrix_{i}": "Tensor" for i in range(8)} | {"make_mlp": "function"}
    report = CapturedCell(b"x" * 6144, names, ["model", "optimizer"]).report()
    lines = report.splitlines()
    assert len(lines) > 1 and all(len(line) <= REPORT_WIDTH for line in lines), report
    assert all(line.startswith("  ") for line in lines[1:])
    joined = " ".join(line.strip() for line in lines)
    assert joined == ("ddl_magic: captured " + ", ".join(f"{n} ({k})" for n, k in names.items())
                      + " · the ranks' own: model, optimizer · payload 6.0 KB")
