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
        ({"max_parts_in_flight": 0}, "max_parts_in_flight"),
        ({"preflight_timeout": -1}, "preflight_timeout"),
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
    from objckpt.ops.maintain.gc import collect_garbage

    assert inspect.signature(collect_garbage).parameters["dry_run"].default is True
    assert inspect.signature(CheckpointManager.gc).parameters["dry_run"].default is True


def test_how_a_load_reads_is_one_value(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``broadcast``, ``allow_stock`` and ``local`` are ``ReadOptions`` fields (#45), checked
    where written; ``local`` is kept as one hashable tuple however it was spelt."""
    import pathlib

    from objckpt import ReadOptions

    assert ReadOptions(local="/a").local == ("/a",)
    assert ReadOptions(local=[pathlib.Path("/a"), "/b"]).local == ("/a", "/b")
    assert ReadOptions(local=()).local is None
    assert hash(ReadOptions(local=["/a"])) == hash(ReadOptions(local="/a"))
    with pytest.raises(ConfigurationError, match="option broadcast='yes'"):
        ReadOptions(broadcast="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="option allow_stock=None"):
        ReadOptions(allow_stock=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="option local=3"):
        ReadOptions(local=3)  # type: ignore[arg-type]


def test_the_reader_takes_allow_stock_from_its_read_options(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A stock DCP checkpoint loads by default and is refused with
    ``ReadOptions(allow_stock=False)``: the field reaches the reader."""
    import torch
    import torch.distributed.checkpoint as dcp
    from helpers import quiet

    from objckpt import ObjectStoreReader, ReadOptions
    from objckpt.errors import CheckpointNotFoundError

    with quiet():
        dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    url = f"file://{tmp_path}"
    assert ObjectStoreReader(url).manifest is None  # the stock checkpoint, read
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        ObjectStoreReader(url, read=ReadOptions(allow_stock=False))


def test_the_manager_refuses_read_options_it_decides(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``CheckpointManager.load`` picks the group, committed steps and its local tier
    itself: a ``read`` that sets them is refused, naming them, not silently overridden."""
    from objckpt import CheckpointManager, ReadOptions

    with (
        CheckpointManager(f"file://{tmp_path}/run") as mgr,
        pytest.raises(ConfigurationError, match=r"local=\('/nvme',\).*decides these"),
    ):
        mgr.load({}, read=ReadOptions(local="/nvme"))


def test_the_preflight_bound_is_an_upload_option() -> None:
    """``preflight_timeout`` is ``UploadOptions``' (#45): the writer takes it from there,
    so async saves and the manager, which pass ``upload=``, can set it too."""
    from objckpt import ObjectStoreWriter

    writer = ObjectStoreWriter("memory://b/c", upload=UploadOptions(preflight_timeout=5))
    assert writer.preflight_timeout == 5
    assert ObjectStoreWriter("memory://b/c").preflight_timeout == 30
