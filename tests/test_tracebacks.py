"""A rank's traceback as shown: the user's frames, with ddl_magic's own left out and counted."""

from ddl_magic.driver.tracebacks import without_machinery_frames

COLLECTIVE_ERROR = '''Traceback (most recent call last):
  File "<cell>", line 4, in <module>
    hvd.allreduce(torch.ones(1), process_set=odd)
  File "/venv/lib/python3.11/site-packages/ddl_magic/torch/ops.py", line 120, in allreduce
    return synchronize(allreduce_async(tensor, average, name, op, process_set=process_set))
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/ddl_magic/torch/ops.py", line 98, in allreduce_async
    return _submit(...)
  File "/venv/lib/python3.11/site-packages/ddl_magic/torch/ops.py", line 60, in _submit
    return queue.submit(request)
  File "/venv/lib/python3.11/site-packages/ddl_magic/runtime/op_queue.py", line 300, in submit
    process_sets.check(request)
  File "/venv/lib/python3.11/site-packages/ddl_magic/runtime/process_sets.py", line 40, in check
    raise ValueError("rank 5 is not in this run")
ValueError: rank 5 is not in this run
'''


def test_ddl_magics_frames_under_the_users_line_are_left_out_and_counted():
    shown = without_machinery_frames(COLLECTIVE_ERROR, "/tmp/run/rank-1.log")
    assert shown == '''Traceback (most recent call last):
  File "<cell>", line 4, in <module>
    hvd.allreduce(torch.ones(1), process_set=odd)
  [5 frames inside ddl_magic not shown; /tmp/run/rank-1.log has them all]
ValueError: rank 5 is not in this run
'''


def test_every_traceback_of_a_chain_is_trimmed_and_the_lines_between_them_kept():
    chained = COLLECTIVE_ERROR + "\nThe above exception was the direct cause of the following exception:\n\n" + (
        COLLECTIVE_ERROR.replace("ValueError", "RuntimeError"))
    shown = without_machinery_frames(chained)
    assert shown.count("inside ddl_magic not shown") == 2
    assert "The above exception was the direct cause" in shown
    assert shown.count('File "<cell>", line 4') == 2 and "ops.py" not in shown


def test_a_traceback_of_ddl_magic_alone_is_kept_whole_as_the_only_clue():
    ours_only = "Traceback (most recent call last):\n" + COLLECTIVE_ERROR.split("\n", 4)[4]
    assert without_machinery_frames(ours_only) == ours_only


def test_library_frames_and_text_without_frames_stay():
    torch_frame = COLLECTIVE_ERROR.replace("ddl_magic/torch/ops.py", "torch/nn/modules/module.py")
    shown = without_machinery_frames(torch_frame)
    assert shown.count("torch/nn/modules/module.py") == 3 and "2 frames inside" in shown
    assert without_machinery_frames("SystemExit: 3\n") == "SystemExit: 3\n"
