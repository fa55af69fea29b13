"""The spawned groups' harness itself: groups run in the background give each batch its own
results, and a failure, in the batch or of the background process, is said by every test
that reads its group."""

from __future__ import annotations

import os
import signal
import time

import pytest

import spawned


def ranks_times_ten(rank: int, world: int) -> int:
    return 10 * rank


def ranks_plus_world(rank: int, world: int) -> int:
    return rank + world


def fails_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    return rank


def sleeps(rank: int, world: int) -> None:
    time.sleep(300)


@pytest.fixture
def harness(monkeypatch):
    """The harness with no group declared or read, and none in the background."""
    monkeypatch.setattr(spawned, "_declared", {})
    monkeypatch.setattr(spawned, "_groups", {})
    monkeypatch.setattr(spawned, "_background", None)
    yield
    spawned.stop_background()


def test_groups_in_the_background_give_each_batch_its_results_and_a_failure_its_rank_and_traceback(harness,
                                                                                                   tmp_path) -> None:
    spawned.declare("times ten", ranks_times_ten, 2, timeout_s=30)
    spawned.declare("fails", fails_on_rank_1, 3, timeout_s=30)
    spawned.declare("plus world", ranks_plus_world, 2, timeout_s=30)
    spawned.run_in_background(tmp_path)
    assert spawned._background.groups == [["fails"], ["times ten", "plus world"]]  # the largest first
    assert spawned.results("plus world") == [2, 3]
    assert spawned.results("times ten") == [0, 10]
    for _ in range(2):  # read again: the same failure, not a second run
        with pytest.raises(RuntimeError, match="the spawned group running batch 'fails' failed") as e:
            spawned.results("fails")
        said = str(e.value.__cause__)
        assert "rank 1" in said and "ValueError: rank 1 fails on purpose" in said
        assert "raised by the spawned batch test_spawned.fails_on_rank_1" in said
    assert spawned._background.process.wait(timeout=30) == 0


def test_a_background_process_that_dies_is_said_by_the_tests_that_read_its_groups(harness, tmp_path) -> None:
    spawned.declare("sleeps", sleeps, 2, timeout_s=30)
    spawned.run_in_background(tmp_path)
    os.kill(spawned._background.process.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="batch 'sleeps' failed") as e:
        spawned.results("sleeps")
    assert "the background process running the spawned groups ended (status -9) before the group of 'sleeps'" in str(
        e.value.__cause__)
