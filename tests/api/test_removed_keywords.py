"""A keyword removed from a public entry point says what replaced it (#45 item 1).

Each row is a keyword docs/changes.md says was removed or renamed, with the text the
``TypeError`` must carry: the new spelling, with the value given where it is one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

import objckpt

ROOT = "memory://objckpt-removed/run"

#: (entry point, removed keyword, value given, what the message must contain)
REMOVED: list[tuple[str, str, Any, str]] = [
    ("CheckpointManager", "keep_last", 3, "retention=objckpt.RetentionPolicy(keep_last=3)"),
    ("CheckpointManager", "keep_every", 1000, "retention=objckpt.RetentionPolicy(keep_every=1000)"),
    (
        "CheckpointManager",
        "keep_newer_than",
        3600.0,
        "retention=objckpt.RetentionPolicy(keep_newer_than=3600.0)",
    ),
    ("LocalTier", "keep_last", 2, "retention=objckpt.RetentionPolicy(keep_last=2)"),
    (
        "ObjectStoreWriter",
        "preflight_timeout",
        5.0,
        "upload=objckpt.UploadOptions(preflight_timeout=5.0)",
    ),
    ("ObjectStoreReader", "verify", False, "read=objckpt.ReadOptions(verify=False)"),
    ("ObjectStoreReader", "broadcast", False, "read=objckpt.ReadOptions(broadcast=False)"),
    ("ObjectStoreReader", "allow_stock", False, "read=objckpt.ReadOptions(allow_stock=False)"),
    ("ObjectStoreReader", "local", "/nvme/x", "read=objckpt.ReadOptions(local='/nvme/x')"),
    ("ReadOptions", "share_replicated", True, "objckpt.AsyncOptions(share_replicated=True)"),
    ("ReadOptions", "max_inflight_bytes", 1 << 28, f"max_in_flight_bytes={1 << 28}"),
    ("UploadOptions", "max_inflight", 4, "max_parts_in_flight=4"),
    ("UploadOptions", "max_in_flight", 4, "max_parts_in_flight=4"),
    ("AsyncOptions", "max_in_flight", 2, "max_saves_in_flight=2"),
    ("AsyncCheckpointer", "options", None, "async_options="),
    ("async_save", "options", None, "async_options="),
]


def _call(entry: str) -> Callable[..., Any]:
    """The entry point with its required positional arguments filled in."""
    target = getattr(objckpt, entry)
    if entry in ("CheckpointManager", "ObjectStoreReader", "ObjectStoreWriter", "LocalTier"):
        return lambda **kw: target(ROOT, **kw)
    if entry == "async_save":
        return lambda **kw: target({}, ROOT, **kw)
    return target


@pytest.mark.parametrize(
    ("entry", "name", "value", "replacement"),
    REMOVED,
    ids=[f"{entry}-{name}" for entry, name, _, _ in REMOVED],
)
def test_a_removed_keyword_names_its_replacement(
    entry: str, name: str, value: Any, replacement: str
) -> None:
    with pytest.raises(TypeError) as raised:
        _call(entry)(**{name: value})
    message = str(raised.value)
    assert replacement in message, message
    assert f"{name}=" in message and entry in message, message


def test_two_removed_keywords_are_both_named() -> None:
    with pytest.raises(TypeError) as raised:
        objckpt.CheckpointManager(ROOT, keep_last=2, keep_every=10)  # type: ignore[call-arg]
    assert "RetentionPolicy(keep_last=2)" in str(raised.value)
    assert "RetentionPolicy(keep_every=10)" in str(raised.value)


def test_other_keywords_are_untouched() -> None:
    """An unknown keyword is Python's own TypeError; current ones work; signatures (what
    help() and the API reference show) are the wrapped ones."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such'"):
        objckpt.UploadOptions(no_such=1)  # type: ignore[call-arg]
    assert objckpt.UploadOptions(max_parts_in_flight=4).max_parts_in_flight == 4
    assert objckpt.AsyncOptions(max_saves_in_flight=2).max_saves_in_flight == 2
    assert objckpt.ReadOptions(max_in_flight_bytes=1 << 28).max_in_flight_bytes == 1 << 28
    assert "max_parts_in_flight" in inspect.signature(objckpt.UploadOptions).parameters
    assert "max_saves_in_flight" in inspect.signature(objckpt.AsyncOptions).parameters
    assert "retention" in inspect.signature(objckpt.CheckpointManager).parameters
    assert "async_options" in inspect.signature(objckpt.async_save).parameters or (
        "kwargs" in inspect.signature(objckpt.async_save).parameters
    )


def test_from_config_overrides_say_the_same(tmp_path: Any) -> None:
    config = tmp_path / "objckpt.toml"
    config.write_text(f'root = "{ROOT}"\n')
    with pytest.raises(TypeError, match=r"retention=objckpt\.RetentionPolicy\(keep_last=2\)"):
        objckpt.CheckpointManager.from_config(str(config), keep_last=2)
