"""Collectives without a process group: every one is a plain local answer, and no
side group is built (the multi-rank cases: tests/distributed/test_fault_matrix.py)."""

from __future__ import annotations

import pytest

from objckpt.dcp.collective import Collectives, is_distributed


def test_without_a_process_group_each_collective_answers_locally() -> None:
    assert not is_distributed()
    collectives = Collectives()
    assert collectives.rank == 0 and collectives.world == 1
    assert collectives.from_rank0(lambda: "decided") == "decided"
    assert collectives.any_rank(True) and not collectives.any_rank(False)
    collectives.fail_together(None, "nothing")
    with pytest.raises(ValueError, match="mine"):
        collectives.fail_together(ValueError("mine"), "a step")
    assert collectives._side is None  # owned, and only built when a collective needs it
