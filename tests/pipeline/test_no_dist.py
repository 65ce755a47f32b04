"""``AsyncCheckpointer.save(..., no_dist=True)``: one process saves alone, inside a process group.

Lightning calls ``save_checkpoint`` on global rank 0 only; a save that made a
collective there would wait for ranks that never join it (the Lightning DDP test
in ``test_lightning.py`` runs that end to end). These tests drive the mode with
real gloo ranks against moto.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import no_dist_ranks
import pytest
import torch
from helpers import load
from ranks import run_ranks

import objckpt
from objckpt.errors import ConfigurationError
from objckpt.testing.plugin import StoreTarget


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state.items()}


@pytest.mark.timeout(400)
def test_a_rank_saves_alone_and_the_group_saves_together_after(
    s3_bucket: StoreTarget, tmp_path: Path
) -> None:
    """Each rank commits a whole checkpoint alone while the other waits on the c10d
    store (a collective in the save would never be joined: the group's timeout fails
    it); then collective saves with the same checkpointer, between ``no_dist`` saves
    on rank 0 alone, agree on their save numbers and plans and commit."""
    root = s3_bucket.url("no-dist")
    args = ("alone_then_together", 2, str(tmp_path / "init"), root, s3_bucket.storage_options)
    run_ranks(no_dist_ranks, *args)
    for rank in (0, 1):  # each checkpoint holds what its rank held, nothing of the other's
        want = no_dist_ranks.state(rank)
        got = _blank(want)
        reader = load(got, f"{root}/alone-{rank}", s3_bucket)
        assert reader.manifest is not None and reader.manifest.world_size == 1
        assert torch.equal(got[f"w{rank}"], want[f"w{rank}"]) and got[f"rank{rank}"] == rank
        assert set(reader.read_metadata().state_dict_metadata) == set(want)
    together = {**no_dist_ranks.state(0, scale=4), **no_dist_ranks.state(1, scale=4)}
    got = _blank(together)
    load(got, f"{root}/mixed-3", s3_bucket)
    assert all(torch.equal(got[k], together[k]) for k in ("w0", "w1"))


def test_no_dist_with_a_process_group_is_refused(tmp_path: Path) -> None:
    """The two say opposite things: which one was meant is not guessed."""
    state, url = {"x": torch.ones(2)}, f"file://{tmp_path}/c"
    with (
        objckpt.AsyncCheckpointer(start_workers=False) as ckpt,
        pytest.raises(ConfigurationError, match=r"no_dist=True .* process_group"),
    ):
        ckpt.save(state, url, no_dist=True, process_group=object())
