import pytest

from objckpt import AsyncOptions, ReadOptions, UploadOptions
from objckpt.errors import ConfigurationError
from objckpt.options import MAX_PARTS, MiB


def test_part_size_grows_under_the_part_limit() -> None:
    opts = UploadOptions()
    assert opts.part_size_for(10 * MiB) == opts.part_size
    huge = 400 * 1024 * MiB  # 400 GiB
    part = opts.part_size_for(huge)
    assert part > opts.part_size and -(-huge // part) <= MAX_PARTS and part % MiB == 0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"part_size": 1024}, "part_size"),
        ({"object_size": 0}, "object_size"),
        ({"max_in_flight": 0}, "max_in_flight"),
    ],
)
def test_bad_upload_options_name_the_option(kwargs: dict, name: str) -> None:
    with pytest.raises(ConfigurationError, match=f"option {name}="):
        UploadOptions(**kwargs)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
def test_bad_worker_and_thread_counts_name_the_option(value: object) -> None:
    for name in ("workers", "uploads_per_worker", "staging_threads"):
        with pytest.raises(ConfigurationError, match=f"option {name}="):
            AsyncOptions(**{name: value})  # type: ignore[arg-type]


def test_bad_read_options() -> None:
    with pytest.raises(ConfigurationError, match="option range_size="):
        ReadOptions(range_size=10)
    with pytest.raises(ConfigurationError, match="option verify="):
        ReadOptions(verify="yes")  # type: ignore[arg-type]


def test_verify_is_one_switch_on_the_reader(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed.checkpoint as dcp
    from helpers import quiet

    from objckpt import ObjectStoreReader, ObjectStoreWriter, ReadOptions

    url = f"file://{tmp_path}/ck"
    with quiet():
        dcp.save({"w": torch.ones(3)}, storage_writer=ObjectStoreWriter(url))
    assert ObjectStoreReader(url).options.verify is True
    off = ObjectStoreReader(url, read=ReadOptions(verify=False))
    assert off.options.verify is False  # read= is no longer overridden by verify's default
    # One way to say it: the verify= shorthand is gone (read=ReadOptions(verify=...)).
    with pytest.raises(TypeError, match="verify"):
        ObjectStoreReader(url, verify=False)  # type: ignore[call-arg]


def test_the_manager_can_load_without_verification(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A flipped byte inside a payload fails a verified load and passes an unverified
    one, so ``load(read=ReadOptions(verify=False))`` really switches checking off."""
    import torch

    from objckpt import CheckpointManager, ReadOptions
    from objckpt.errors import ChecksumMismatchError
    from objckpt.format.layout import is_objckpt_payload

    state = {"w": torch.arange(4096, dtype=torch.float32)}
    with CheckpointManager(f"file://{tmp_path}") as mgr:
        mgr.save(1, state).result(timeout=120)
    payload = next(p for p in tmp_path.rglob("*") if is_objckpt_payload(p.name))
    data = bytearray(payload.read_bytes())
    data[-2000] ^= 0xFF  # inside the tensor's bytes, far from the zip directory
    payload.write_bytes(bytes(data))
    with CheckpointManager(f"file://{tmp_path}") as mgr:
        with pytest.raises(ChecksumMismatchError):
            mgr.load({"w": torch.zeros(4096)})
        got = {"w": torch.zeros(4096)}
        assert mgr.load(got, read=ReadOptions(verify=False)) == 1
        assert not torch.equal(got["w"], state["w"])  # the flipped byte came through


def test_async_options_keyword_is_the_same_on_checkpointer_and_manager() -> None:
    import inspect

    from objckpt import AsyncCheckpointer, CheckpointManager

    for cls in (AsyncCheckpointer, CheckpointManager):
        params = inspect.signature(cls).parameters
        assert "async_options" in params and "options" not in params, cls


def test_gc_is_a_dry_run_unless_asked_everywhere() -> None:
    import inspect

    from objckpt import CheckpointManager
    from objckpt.ops.gc import collect_garbage

    assert inspect.signature(collect_garbage).parameters["dry_run"].default is True
    assert inspect.signature(CheckpointManager.gc).parameters["dry_run"].default is True
