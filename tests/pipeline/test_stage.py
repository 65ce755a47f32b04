"""Staging memory: bounded however many state-dict shapes a job saves."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from helpers import count_table_builds

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


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (run it where a GPU is lent)"
)
def test_cuda_tensors_stage_through_pinned_memory_and_save_the_values_at_call_time(
    tmp_path,
) -> None:
    import torch.distributed.checkpoint as dcp

    import objckpt

    state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.arange(10, device="cuda")}
    expected = {k: v.cpu().clone() for k, v in state.items()}
    with objckpt.AsyncCheckpointer() as ckpt:
        handle = ckpt.save(state, f"file://{tmp_path}/c")
        state["w"].add_(1.0)  # after save returned: the checkpoint holds the old values
        handle.result(timeout=120)
        assert all(b.segment.registered for b in ckpt._stager._all)  # page-locked
    got = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(got, storage_reader=objckpt.ObjectStoreReader(f"file://{tmp_path}/c"), no_dist=True)
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_a_view_kept_past_close_stays_readable_and_the_segment_name_goes() -> None:
    """A staged view can outlive its checkpointer (a failed save's traceback holds
    one in a frame); closing must not unmap memory it points at. In a child
    process: a regression here is a segfault, not an exception."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import os, torch
        from objckpt.pipeline.stage import Stager
        stager = Stager()
        staged = stager.stage({"w": torch.arange(1 << 20, dtype=torch.float32)})
        kept = staged.state["w"]
        path = staged.buffers.segment.path
        stager.release(staged)
        stager.close()
        print(os.path.exists(path), float(kept.sum()), float(kept[-1]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    expected = float(torch.arange(1 << 20, dtype=torch.float32).sum())
    assert out.stdout.split() == ["False", str(expected), str(float((1 << 20) - 1))]


def _rebound(s: dict[str, torch.Tensor]) -> None:
    s["w"] = torch.full((64, 64), 7.0)  # same layout, other memory


def _data_rebound(s: dict[str, torch.Tensor]) -> None:
    s["w"].data = torch.full((64, 64), 8.0)  # the same object, other memory


def _transposed(s: dict[str, torch.Tensor]) -> None:
    s["w"] = s["w"].t()  # same shape, dtype and address; not dense in order


def _conjugated(s: dict[str, torch.Tensor]) -> None:
    s["z"] = s["z"].conj()  # same address and dtype; the bytes are not the values


def _negated(s: dict[str, torch.Tensor]) -> None:
    s["n"] = torch._neg_view(s["n"])  # same address and dtype; the values are -bytes


def _state_for_table() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {  # every pair raw, so the copy keeps a piece table
        "w": torch.randn(64, 64, generator=g),
        "z": torch.randn(32, dtype=torch.complex64, generator=g),
        "n": torch.randn(32, generator=g),
        "b": torch.arange(100),
    }


@pytest.mark.parametrize("change", [_rebound, _data_rebound, _transposed, _conjugated, _negated])
def test_a_reused_staging_set_copies_what_the_tensors_hold_now(
    change: Callable[[dict[str, torch.Tensor]], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The piece table a staging set keeps is found by the layout, which does not see
    where the bytes are or whether they are the values: every save checks again,
    and a change the layout misses rebuilds the table."""
    built = count_table_builds(monkeypatch)
    stager = Stager(max_cached_sets=1)
    state = _state_for_table()
    for _ in range(2):
        staged = stager.stage(state)
        assert all(torch.equal(staged.state[k], state[k]) for k in state)
        stager.release(staged)
    assert len(built) == 1  # the second save copied by the first one's table
    change(state)
    staged = stager.stage(state)
    assert len(built) == 2  # the change was seen
    for k, v in state.items():
        assert torch.equal(staged.state[k], v.resolve_conj().resolve_neg()), k
    stager.release(staged)
    stager.close()
