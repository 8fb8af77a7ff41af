"""Old run folders are pruned before a run makes its own; recent ones and other files stay."""

import os
import tempfile

import pytest

from ddl_magic.driver.run_folders import (DEFAULT_KEEP_RUNS, RECENT_S, new_run_folder, new_run_id,
                                          prune_run_folders, runs_to_keep)

NOW = 2_000_000_000.0


def make_runs(runs_dir, count, age_s):
    names = [f"20260101-{index:06d}-abcdef" for index in range(count)]
    for name in names:
        folder = runs_dir / name
        folder.mkdir(parents=True)
        (folder / "rank-0.log").write_text("hello")
        for path in (folder / "rank-0.log", folder):
            os.utime(path, (NOW - age_s, NOW - age_s))
    return names


def test_the_newest_runs_stay_with_room_for_the_next(tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_MAGIC_KEEP_RUNS", "5")
    names = make_runs(tmp_path, 12, age_s=3600)
    (tmp_path / "notes.txt").write_text("not a run")
    removed = prune_run_folders(str(tmp_path), now=NOW)
    assert sorted(os.listdir(tmp_path)) == sorted([*names[-4:], "notes.txt"])
    assert [os.path.basename(path) for path in removed] == names[:8]


def test_a_run_written_to_in_the_last_minutes_is_never_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_MAGIC_KEEP_RUNS", "1")
    (old,) = make_runs(tmp_path, 1, age_s=3600)
    os.utime(tmp_path / old / "rank-0.log", (NOW - 30, NOW - 30))  # another notebook's run, going on
    assert prune_run_folders(str(tmp_path), now=NOW) == []
    assert os.listdir(tmp_path) == [old]


def test_no_folder_yet_is_nothing_to_prune(tmp_path):
    assert prune_run_folders(str(tmp_path / "absent")) == []


@pytest.mark.parametrize("value", ["0", "ten", "-3", "2.5"])
def test_a_bad_setting_says_what_to_set(monkeypatch, value):
    monkeypatch.setenv("DDL_MAGIC_KEEP_RUNS", value)
    with pytest.raises(ValueError, match=r"DDL_MAGIC_KEEP_RUNS=.*a whole number of at least 1"):
        runs_to_keep()


def test_fifty_by_default(monkeypatch):
    monkeypatch.delenv("DDL_MAGIC_KEEP_RUNS", raising=False)
    assert runs_to_keep() == DEFAULT_KEEP_RUNS == 50


def test_a_pools_folders_are_pruned_like_a_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_MAGIC_KEEP_RUNS", "3")
    names = ["20260101-000000-abcdef", "pool-20260101-000001-fedcba", "20260101-000002-abcdef",
             "pool-20260101-000003-fedcba"]  # oldest first
    for name in names:
        (tmp_path / name / "cell-1").mkdir(parents=True)
        for path in (tmp_path / name / "cell-1", tmp_path / name):
            os.utime(path, (NOW - 3600, NOW - 3600))
    removed = prune_run_folders(str(tmp_path), now=NOW)
    assert [os.path.basename(path) for path in removed] == names[:2]
    assert sorted(os.listdir(tmp_path)) == sorted(names[2:])


def test_a_folder_its_run_holds_is_never_removed_and_goes_once_released(tmp_path, monkeypatch):
    monkeypatch.setenv("DDL_MAGIC_KEEP_RUNS", "1")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = new_run_folder(new_run_id(pool=True))  # a pool idle for an hour: its files are old
    os.utime(folder, (NOW - 3600, NOW - 3600))
    runs_dir = os.path.dirname(folder)
    assert prune_run_folders(runs_dir, now=NOW) == []
    folder.release()
    assert prune_run_folders(runs_dir, now=NOW + RECENT_S + 1) == [folder]
