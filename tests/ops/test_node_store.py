"""The one door to a node's disk: no access through a link, nothing half-written left.

A local tier's directory is reachable by users and other tools, so a link may sit
anywhere under it; :class:`objckpt.writers.node_store.NodeStore` checks every component
under the tier's root without following one, and a write either lands whole under
its name or leaves nothing (not even its temporary file).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from objckpt.errors import LinkRefusedError, ManifestError, ObjckptError
from objckpt.writers.node_store import Entry, NodeStore, tier_store


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


def test_each_directory_made_is_made_durable_in_its_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file committed into directories made for it is found by its path after a
    power loss only if each new directory's entry reached its parent's disk: every
    parent of a directory made is fsynced (and the file's own directory)."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    (tmp_path / "replicas").mkdir()  # there already: its parent is not synced for it
    NodeStore(str(tmp_path)).write_bytes("replicas/step-0000000001/3f/a.bin", b"abc")
    dirs = {p for p in synced if os.path.isdir(p)}
    assert dirs == {
        str(tmp_path / "replicas"),
        str(tmp_path / "replicas/step-0000000001"),
        str(tmp_path / "replicas/step-0000000001/3f"),
    }


def test_a_directory_moves_whole_never_through_a_link_nor_over_a_name(tmp_path: Path) -> None:
    store = NodeStore(str(tmp_path))
    store.write_bytes("step-0000000007/a.bin", b"abc")
    store.move_dir("step-0000000007", "set-aside/step-0000000007.x")
    assert (tmp_path / "set-aside/step-0000000007.x/a.bin").read_bytes() == b"abc"
    assert not (tmp_path / "step-0000000007").exists()
    store.write_bytes("step-0000000008/a.bin", b"new")
    with pytest.raises(FileExistsError):
        store.move_dir("step-0000000008", "set-aside/step-0000000007.x")
    assert (tmp_path / "step-0000000008/a.bin").read_bytes() == b"new"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "step-0000000009").symlink_to(elsewhere)
    with pytest.raises(LinkRefusedError):
        store.move_dir("step-0000000009", "set-aside/step-0000000009.x")
    assert (tmp_path / "step-0000000009").is_symlink() and elsewhere.is_dir()


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


# -- reads, listings, status and removals: no link followed either ---------------------
def _tier_with_a_step(tmp_path: Path) -> tuple[Path, Path]:
    """A tier holding ``replicas/step-0000000001/3f/a.bin`` (and a manifest beside
    ``3f``), and a directory outside it holding files of the same names."""
    root = tmp_path / "tier"
    step = root / "replicas/step-0000000001"
    (step / "3f").mkdir(parents=True)
    (step / "3f/a.bin").write_bytes(b"ours")
    (step / "manifest.json").write_bytes(b"{}")
    outside = tmp_path / "outside"
    (outside / "3f").mkdir(parents=True)
    (outside / "3f/a.bin").write_bytes(b"theirs")
    (outside / "a.bin").write_bytes(b"theirs")
    (outside / "manifest.json").write_bytes(b"theirs")
    return root, outside


def _swap_for_link(root: Path, link: str, outside: Path) -> None:
    """Replace ``root/link`` (a directory) by a link to ``outside``."""
    path = root / link
    path.rename(root.parent / f"moved-{path.name}")
    path.symlink_to(outside, target_is_directory=True)


def test_reads_listings_and_status_see_the_tiers_own_files(tmp_path: Path) -> None:
    root, _ = _tier_with_a_step(tmp_path)
    store = NodeStore(str(root))
    assert store.read_bytes("replicas/step-0000000001/3f/a.bin") == b"ours"
    with store.open_read("replicas/step-0000000001/3f/a.bin") as f:
        f.seek(1)
        assert f.read() == b"urs"
    assert store.entries("replicas/step-0000000001") == [
        Entry("3f", "dir"),
        Entry("manifest.json", "file", 2),
    ]
    assert [e.name for e in store.entries()] == ["replicas"]
    assert store.stat("replicas/step-0000000001/3f/a.bin").st_size == 4
    assert store.exists("replicas/step-0000000001/manifest.json")
    assert not store.exists("replicas/step-0000000002/manifest.json")
    with pytest.raises(FileNotFoundError):
        store.read_bytes("replicas/step-0000000001/b.bin")
    with pytest.raises(FileNotFoundError):
        store.entries("replicas/step-0000000002")


@pytest.mark.parametrize(
    "link", ["replicas", "replicas/step-0000000001", "replicas/step-0000000001/3f"]
)
def test_a_link_at_any_directory_is_refused_for_reads_listings_and_removals(
    tmp_path: Path, link: str
) -> None:
    root, outside = _tier_with_a_step(tmp_path)
    _swap_for_link(root, link, outside)
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    store = NodeStore(str(root))
    deep = "replicas/step-0000000001/3f/a.bin"
    for call in (
        lambda: store.read_bytes(deep),
        lambda: store.open_read(deep),
        lambda: store.stat(deep),
        lambda: store.entries("replicas/step-0000000001/3f"),
        lambda: store.remove(deep),
        lambda: store.remove_dir("replicas/step-0000000001/3f/x"),
    ):
        with pytest.raises(LinkRefusedError, match="symbolic link") as info:
            call()
        assert str(root / link) in str(info.value)
    assert store.exists(deep)  # something is there: a link, refused when used
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before


def test_a_link_at_the_files_own_name_is_refused_for_reads_and_removed_itself(
    tmp_path: Path,
) -> None:
    root, outside = _tier_with_a_step(tmp_path)
    name = root / "replicas/step-0000000001/3f/a.bin"
    name.unlink()
    name.symlink_to(outside / "a.bin")
    store = NodeStore(str(root))
    rel = "replicas/step-0000000001/3f/a.bin"
    for call in (lambda: store.read_bytes(rel), lambda: store.open_read(rel)):
        with pytest.raises(LinkRefusedError, match=f"{name} is a symbolic link to {outside}"):
            call()
    with pytest.raises(LinkRefusedError):
        store.stat(rel)
    assert store.entries("replicas/step-0000000001/3f") == [
        Entry("a.bin", "link", target=str(outside / "a.bin"))
    ]
    store.remove(rel)  # the link goes, never its target
    assert not name.is_symlink() and (outside / "a.bin").read_bytes() == b"theirs"


def test_a_link_swapped_in_after_a_listing_is_refused_at_the_read(tmp_path: Path) -> None:
    """The check is the open itself (``O_NOFOLLOW`` at every component): a link that
    appears after the listing that found the file is refused, not read."""
    root, outside = _tier_with_a_step(tmp_path)
    store = NodeStore(str(root))
    assert [e.name for e in store.entries("replicas/step-0000000001")] == ["3f", "manifest.json"]
    _swap_for_link(root, "replicas/step-0000000001", outside)
    with pytest.raises(LinkRefusedError):
        store.read_bytes("replicas/step-0000000001/manifest.json")


def test_removals_remove_only_what_they_name(tmp_path: Path) -> None:
    root, outside = _tier_with_a_step(tmp_path)
    store = NodeStore(str(root))
    with pytest.raises(OSError):
        store.remove_dir("replicas/step-0000000001/3f")  # not empty: kept
    store.remove("replicas/step-0000000001/3f/a.bin")
    store.remove_dir("replicas/step-0000000001/3f")
    assert _all(root) == [
        "replicas",
        "replicas/step-0000000001",
        "replicas/step-0000000001/manifest.json",
    ]
    with pytest.raises(FileNotFoundError):
        store.remove("replicas/step-0000000001/3f/a.bin")
    assert _all(outside) == ["3f", "3f/a.bin", "a.bin", "manifest.json"]


def test_a_read_is_bounded_before_it_is_read_whole(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_bytes(b"x" * 11)
    store = NodeStore(str(tmp_path))
    assert store.read_bytes("manifest.json", max_bytes=11) == b"x" * 11
    with pytest.raises(ManifestError, match="larger than 10 bytes"):
        store.read_bytes("manifest.json", max_bytes=10)


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    os.mkfifo(tmp_path / "fifo")  # an open would block for a writer: refused at once
    store = NodeStore(str(tmp_path))
    with pytest.raises(IsADirectoryError):
        store.read_bytes("d")
    with pytest.raises(OSError, match="not a regular file"):
        store.read_bytes("fifo")
    assert store.entries() == [Entry("d", "dir"), Entry("fifo", "other")]


@pytest.mark.parametrize("rel", ["../tier2/a.bin", "/etc/passwd", "x/../a.bin"])
def test_a_name_leaving_the_root_is_refused_for_reads_and_removals(
    tmp_path: Path, rel: str
) -> None:
    (tmp_path / "tier").mkdir()
    (tmp_path / "tier2").mkdir()
    (tmp_path / "tier2" / "a.bin").write_bytes(b"theirs")
    store = NodeStore(str(tmp_path / "tier"))
    for call in (lambda: store.read_bytes(rel), lambda: store.remove(rel), lambda: store.stat(rel)):
        with pytest.raises(ObjckptError, match="not a plain relative path"):
            call()
    assert (tmp_path / "tier2" / "a.bin").read_bytes() == b"theirs"


def test_the_probe_leaves_nothing_and_says_the_room(tmp_path: Path) -> None:
    store = NodeStore(str(tmp_path / "new"))
    assert store.probe() > 0
    assert _all(tmp_path / "new") == []
    assert store.identity() == NodeStore(str(tmp_path / "new" / ".")).identity()


def test_a_tier_directory_is_reached_from_the_tier(tmp_path: Path) -> None:
    tier = str(tmp_path / "tier")
    assert tier_store(f"{tier}/replicas/step-0000000001") == (
        NodeStore(tier),
        "replicas/step-0000000001",
    )
    assert tier_store(f"{tier}/step-0000000001/") == (NodeStore(tier), "step-0000000001")


def test_a_link_swapped_in_between_the_check_and_the_open_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race itself: the component's check still sees the directory that was there
    (``os.stat`` answers from before the swap, once), then the ``O_NOFOLLOW`` open
    meets the link. It is refused as a link, naming it, and nothing outside is read."""
    root, outside = _tier_with_a_step(tmp_path)
    store = NodeStore(str(root))
    _swap_for_link(root, "replicas/step-0000000001", outside)
    real = os.stat
    stale = {"step-0000000001": real(root.parent / "moved-step-0000000001")}

    def before_the_swap(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if isinstance(path, str) and path in stale:
            return stale.pop(path)
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", before_the_swap)
    with pytest.raises(LinkRefusedError, match="step-0000000001"):
        store.read_bytes("replicas/step-0000000001/manifest.json")
    assert not stale, "the check never looked at the swapped directory"
