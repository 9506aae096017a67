"""The distributed test harness: results by rank, child tracebacks re-raised, hangs killed."""
import time

import pytest
import torch.distributed as dist

from parallel.testing import DistributedError, DistributedTimeout, run_distributed


def _rank_and_world(offset):
    return dist.get_rank() + offset, dist.get_world_size()


def _rank2_raises():
    if dist.get_rank() == 2:
        raise KeyError("boom from rank two")
    dist.barrier()  # the others block here until the harness kills them
    return dist.get_rank()


def _rank1_hangs():
    if dist.get_rank() == 1:
        time.sleep(3600)
    return dist.get_rank()


def test_results_are_returned_by_rank():
    assert run_distributed(_rank_and_world, 3, 10) == [(10, 3), (11, 3), (12, 3)]


def test_child_exception_is_reraised_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as info:
        run_distributed(_rank2_raises, 4, timeout=60)
    assert info.value.rank == 2
    assert "KeyError: 'boom from rank two'" in info.value.remote_traceback
    assert "_rank2_raises" in info.value.remote_traceback  # the child's frame, not the parent's
    assert time.monotonic() - t0 < 45  # the blocked ranks were killed, not waited for


def test_hang_is_killed_by_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(DistributedTimeout) as info:
        run_distributed(_rank1_hangs, 2, timeout=6)  # rank 0 is done in about a second; rank 1 never
    assert info.value.pending == [1]
    assert time.monotonic() - t0 < 30


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size=0"):
        run_distributed(_rank_and_world, 0, 0)


def test_a_failed_rendezvous_is_relaunched_once_then_reported(capfd):
    """A rank whose init_process_group fails (here: a backend that does not exist, so both launches
    fail the same way) makes the harness stop every rank and relaunch once, saying so on stderr; the
    second failure raises DistributedError naming the initialisation, with the child's traceback. The
    test function never runs."""
    with pytest.raises(DistributedError) as info:
        run_distributed(_rank_and_world, 2, 0, backend="no_such_backend", timeout=60)
    assert "process group initialisation failed 2 times" in info.value.remote_traceback
    assert "no_such_backend" in info.value.remote_traceback.lower()
    assert "_rank_and_world" not in info.value.remote_traceback
    assert capfd.readouterr().err.count("relaunching all ranks once") == 1
