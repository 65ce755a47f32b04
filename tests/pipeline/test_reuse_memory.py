"""The checkpointer's reuse memory keeps the manifest of the step loaded last (a
restarted job's first save takes it from there, #46) only while that step is what
was loaded: a save to the same step, queued, forgotten or committed, replaces it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from objckpt.format.manifest import Manifest
from objckpt.pipeline.reuse_memory import ReuseMemory

URL = "s3://bucket/run/step-0000000001"


def _manifest() -> Manifest:
    return Manifest(
        attempt="a" * 16,
        created="2026-12-05T00:00:00Z",
        world_size=1,
        objckpt_version="0",
        torch_version="0",
        objects=(),
        metadata={},
    )


def test_the_loaded_manifest_is_found_by_its_steps_url_only() -> None:
    memory = ReuseMemory()
    manifest = _manifest()
    memory.loaded(URL + "/", manifest)
    assert memory.loaded_manifest(URL) is manifest
    assert memory.loaded_manifest("s3://bucket/run/step-0000000002") is None
    assert memory.loaded_manifest("s3://backup/run/step-0000000001") is None


@pytest.mark.parametrize("then", ["wrote", "forget", "committed"])
def test_a_save_to_the_loaded_step_forgets_its_manifest(then: str) -> None:
    memory = ReuseMemory()
    memory.loaded(URL, _manifest())
    other = "s3://bucket/run/step-0000000002"
    writer = SimpleNamespace(pending=[], items=[])
    memory.wrote(other, writer)  # type: ignore[arg-type]
    memory.committed(other)
    assert memory.loaded_manifest(URL) is not None  # another step: kept
    if then == "wrote":
        memory.wrote(URL, writer)  # type: ignore[arg-type]
    elif then == "forget":
        memory.forget(URL)
    else:
        memory.wrote(URL, writer)  # type: ignore[arg-type]
        memory.committed(URL)
    assert memory.loaded_manifest(URL) is None
