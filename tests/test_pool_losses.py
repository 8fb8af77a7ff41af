"""What a pool says and decides about lost ranks (`driver/pool_losses.py`): pure."""

from ddl_magic.driver.pool_losses import describe_lost, replaced_message, why_not_replaced


def test_lost_ranks_are_told_by_host_each_host_with_its_first_reason():
    said = describe_lost({1: "host-b stopped answering", 3: "connection lost", 2: "exit 1"},
                         ["a", "host-b", "a", "host-b"], "while the pool was idle")
    assert said == ("ranks 1 and 3 (host-b) were lost (host-b stopped answering) while the "
                    "pool was idle; rank 2 (a) was lost (exit 1) while the pool was idle")


def test_a_plain_pool_breaks_and_an_elastic_one_replaces_while_min_np_are_left():
    assert why_not_replaced(4, 1, None) == ""  # not elastic: it breaks, the loss says why
    assert why_not_replaced(4, 2, 2) is None
    assert why_not_replaced(4, 3, 2) == "1 rank left, fewer than min_np=2"
    assert why_not_replaced(4, 4, 1) == "0 ranks left, fewer than min_np=1"


def test_the_user_is_told_which_ranks_start_empty_and_what_they_lost():
    said = replaced_message("rank 2 (a) was lost (killed by SIGKILL) in cell 3", [2],
                            {"model", "hvd"})
    assert said.endswith("rank 2 replaced by a fresh rank, which starts empty: what earlier "
                         "cells assigned there (hvd, model) is gone; the other ranks keep theirs")
    plural = replaced_message("...", [1, 2], set())
    assert ("ranks 1 and 2 replaced by fresh ranks, which start empty: what earlier cells "
            "assigned there is gone") in plural
