"""The one door to a node's disk: no write through a link, nothing half-written left.

A local tier's directory is reachable by users and other tools, so a link may sit
anywhere under it; :class:`objckpt.writers.node_store.NodeStore` checks every component
under the tier's root without following one, and a write either lands whole under
its name or leaves nothing (not even its temporary file).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from objckpt.errors import LinkRefusedError, ObjckptError
from objckpt.writers.node_store import NodeStore


def _all(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_file_lands_whole_under_its_name_and_directories_are_made(tmp_path: Path) -> None:
    store = NodeStore(str(tmp_path))
    store.write_bytes("replicas/step-0000000001/3f/a.bin", b"abc")
    assert (tmp_path / "replicas/step-0000000001/3f/a.bin").read_bytes() == b"abc"
    with store.create("replicas/step-0000000001/b.bin") as f:
        f.write(memoryview(b"xy"))
        f.write(b"z")
        f.commit()
    assert (tmp_path / "replicas/step-0000000001/b.bin").read_bytes() == b"xyz"
    assert not [n for n in _all(tmp_path) if n.endswith(".tmp")]


@pytest.mark.parametrize(
    "link", ["replicas", "replicas/step-0000000001", "replicas/step-0000000001/3f"]
)
def test_a_link_at_any_component_is_refused_and_nothing_is_written_through_it(
    tmp_path: Path, link: str
) -> None:
    root = tmp_path / "tier"
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / link).parent.mkdir(parents=True, exist_ok=True)
    (root / link).symlink_to(outside, target_is_directory=True)
    store = NodeStore(str(root))
    with pytest.raises(LinkRefusedError, match="symbolic link") as info:
        store.write_bytes("replicas/step-0000000001/3f/a.bin", b"abc")
    assert str(root / link) in str(info.value) and isinstance(info.value, ObjckptError)
    assert _all(outside) == []


def test_a_link_at_the_file_name_is_refused_not_replaced_or_followed(tmp_path: Path) -> None:
    target = tmp_path / "target.txt"
    target.write_bytes(b"keep")
    (tmp_path / "tier").mkdir()
    (tmp_path / "tier" / "a.bin").symlink_to(target)
    with pytest.raises(LinkRefusedError):
        NodeStore(str(tmp_path / "tier")).write_bytes("a.bin", b"new")
    assert target.read_bytes() == b"keep" and (tmp_path / "tier" / "a.bin").is_symlink()


def test_a_missing_root_is_made(tmp_path: Path) -> None:
    NodeStore(str(tmp_path / "new" / "tier")).write_bytes("a.bin", b"1")
    assert (tmp_path / "new" / "tier" / "a.bin").read_bytes() == b"1"


def test_the_root_itself_may_be_a_link(tmp_path: Path) -> None:
    real = tmp_path / "disk"
    real.mkdir()
    (tmp_path / "tier").symlink_to(real, target_is_directory=True)
    NodeStore(str(tmp_path / "tier")).write_bytes("x/a.bin", b"1")
    assert (real / "x" / "a.bin").read_bytes() == b"1"


@pytest.mark.parametrize("rel", ["../a.bin", "/etc/a.bin", "x/./a.bin", "x//a.bin", ""])
def test_a_name_leaving_the_root_is_refused(tmp_path: Path, rel: str) -> None:
    with pytest.raises(ObjckptError):
        NodeStore(str(tmp_path)).write_bytes(rel, b"1")
    assert _all(tmp_path) == []


def test_a_failed_write_removes_its_temporary_file(tmp_path: Path) -> None:
    store = NodeStore(str(tmp_path))
    with pytest.raises(RuntimeError), store.create("d/a.bin") as f:
        f.write(b"partial")
        assert [n for n in _all(tmp_path) if n.endswith(".tmp")]  # it was there
        raise RuntimeError("the sender died")
    assert _all(tmp_path) == ["d"]
    pending = store.create("d/b.bin")
    pending.write(b"x")
    pending.discard()
    assert _all(tmp_path) == ["d"]


def test_a_write_that_is_not_committed_is_discarded(tmp_path: Path) -> None:
    with NodeStore(str(tmp_path)).create("a.bin") as f:
        f.write(b"x")  # no commit(): leaving the block discards it
    assert _all(tmp_path) == []


def test_a_failed_rename_removes_its_temporary_file(tmp_path: Path) -> None:
    (tmp_path / "a.bin").mkdir()  # a directory where the file goes: rename fails
    (tmp_path / "a.bin" / "inside").write_bytes(b"")
    with pytest.raises(OSError):
        NodeStore(str(tmp_path)).write_bytes("a.bin", b"x")
    assert _all(tmp_path) == ["a.bin", "a.bin/inside"]


def test_a_create_only_write_never_replaces_what_is_there(tmp_path: Path) -> None:
    """How a restore keeps a manifest it fetched from another node: created once, a
    second write with other bytes refused, the first intact and no temporary left."""
    store = NodeStore(str(tmp_path))
    store.write_bytes("replicas/step-0000000002/manifest.json", b"first", create_only=True)
    with pytest.raises(FileExistsError):
        store.write_bytes("replicas/step-0000000002/manifest.json", b"other", create_only=True)
    assert (tmp_path / "replicas/step-0000000002/manifest.json").read_bytes() == b"first"
    assert _all(tmp_path) == [
        "replicas",
        "replicas/step-0000000002",
        "replicas/step-0000000002/manifest.json",
    ]
    store.write_bytes("replicas/step-0000000002/manifest.json", b"replaced")  # the default
    assert (tmp_path / "replicas/step-0000000002/manifest.json").read_bytes() == b"replaced"


def test_a_create_only_write_refuses_a_link_at_its_name(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_bytes(b"theirs")
    (tmp_path / "replicas").mkdir()
    (tmp_path / "replicas" / "manifest.json").symlink_to(tmp_path / "elsewhere")
    with pytest.raises((LinkRefusedError, FileExistsError)):
        NodeStore(str(tmp_path)).write_bytes("replicas/manifest.json", b"x", create_only=True)
    assert (tmp_path / "elsewhere").read_bytes() == b"theirs"
