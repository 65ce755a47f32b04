"""Staging memory: bounded however many state-dict shapes a job saves."""

from __future__ import annotations

import os

import torch

from objckpt.pipeline.stage import Stager


def _segments(stager: Stager) -> list[str]:
    return [b.segment.path for b in stager._all]


def test_idle_staging_sets_are_capped_across_shapes_and_freed_on_close() -> None:
    stager = Stager(max_cached_sets=1)
    paths = []
    for n in range(4):  # four different structures, one after another
        staged = stager.stage({f"w{n}": torch.ones(1024 * (n + 1))})
        paths.append(staged.buffers.segment.path)
        stager.release(staged)
        assert len(_segments(stager)) == 1  # only the newest idle set is kept
    assert [os.path.exists(p) for p in paths] == [False, False, False, True]
    again = stager.stage({"w3": torch.zeros(4096)})  # the kept shape is reused
    assert again.buffers.segment.path == paths[3]
    stager.release(again)
    stager.close()
    assert not os.path.exists(paths[3]) and _segments(stager) == []
