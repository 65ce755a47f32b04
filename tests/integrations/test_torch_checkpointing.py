"""torch_checkpointing's CheckpointManager on objckpt's Storage, on moto and Ceph RGW.

What torch_checkpointing asks of a ``Storage`` (``storage/base_storage.py``: the
``rename`` table, ``exists``/``ls``/``getsize``/``isdir``, ``stream_read`` with
``readinto`` and ``seek``) is run here against :class:`ObjckptStorage` on two S3
implementations, then its own ``CheckpointManager`` saves and loads through it, and a
training loop saving asynchronously is SIGKILLed mid-save and resumed bit-exact.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import s3_client

from objckpt.errors import (
    CheckpointExistsError,
    ChecksumMismatchError,
    ConfigurationError,
    IntegrityError,
    ManifestError,
    UploadError,
)
from objckpt.format.layout import MANIFEST_KEY
from objckpt.testing.plugin import StoreTarget

if os.environ.get("OBJCKPT_REQUIRE_TORCH_CHECKPOINTING", "").strip() not in ("", "0"):
    import torch_checkpointing  # noqa: F401  (make test-torch-checkpointing: fail, never skip)
else:
    pytest.importorskip("torch_checkpointing", reason="the torch-checkpointing extra is absent")

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage.base_storage import ReadArgs

import objckpt.torch_checkpointing as tco
from objckpt.torch_checkpointing import ObjckptStorage, ObjckptStorageConfig

TRAIN = Path(__file__).resolve().parents[1] / "support" / "tc_train.py"


@pytest.fixture(params=["moto", "rgw"])
def target(request: pytest.FixtureRequest) -> StoreTarget:
    """The same test on moto and on Ceph RGW (skipped, saying why, where RGW is absent)."""
    return request.getfixturevalue("s3_bucket" if request.param == "moto" else "rgw_bucket")


def _config(target: StoreTarget, **kw: Any) -> ObjckptStorageConfig:
    return ObjckptStorageConfig(root=target.root, storage_options=target.storage_options, **kw)


def _storage(target: StoreTarget) -> ObjckptStorage:
    return _config(target).create_storage()


def _stage(storage: ObjckptStorage, name: str, files: dict[str, bytes]) -> None:
    storage.mkdir(Path(f"tmp_{name}"))
    for path, data in files.items():
        with storage.stream_write(Path(f"tmp_{name}/{path}")) as f:
            f.write(data)


def test_the_final_name_exists_only_once_its_manifest_commits_it(target: StoreTarget) -> None:
    storage = _storage(target)
    files = {"model_0.pt": os.urandom(3000), "nested/opt_0.pt": b"x" * 10, "empty": b""}
    _stage(storage, "step_1", files)

    # Staged: only the temporary name is there, as on a filesystem before the rename.
    assert storage.exists(Path("tmp_step_1"))
    assert not storage.exists(Path("step_1"))
    assert not storage.exists(Path("step_1/model_0.pt"))
    assert storage.ls(Path("")) == ["tmp_step_1"]
    with pytest.raises(FileNotFoundError):
        storage.read(Path("step_1/model_0.pt"))

    storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)

    assert storage.ls(Path("")) == ["step_1"]
    assert not storage.exists(Path("tmp_step_1"))
    assert storage.exists(Path("step_1")) and storage.isdir(Path("step_1"))
    assert storage.ls(Path("step_1")) == ["empty", "model_0.pt", "nested"]
    assert storage.isdir(Path("step_1/nested")) and not storage.isdir(Path("step_1/model_0.pt"))
    assert storage.getsize(Path("step_1/nested/opt_0.pt")) == 10
    assert storage.glob(f"{target.root}/step_*") == [f"{target.root}/step_1"]
    # A full URL works as a path too (pathlib spells it s3:/bucket/...).
    assert storage.read(Path(f"{target.root}/step_1/model_0.pt")) == files["model_0.pt"]
    assert storage.read(Path("step_1/empty")) == b""
    # The manifest lists every file with size and CRC32C; no byte was copied.
    manifest = json.loads(storage._store.read(f"step_1/{MANIFEST_KEY}"))
    assert sorted(o["key"] for o in manifest["objects"]) == sorted(files)
    assert not storage._store.listing("step_1/" + tco.SUMS_DIR)  # records removed


def test_stream_write_takes_any_buffer_as_torch_checkpointings_writers_pass(
    target: StoreTarget,
) -> None:
    import array

    import numpy as np

    storage = _storage(target)
    parts = [
        b"bytes ",
        bytearray(b"bytearray "),
        np.arange(5, dtype=np.int32),
        torch.arange(4, dtype=torch.float64).numpy(),
        array.array("i", [7, 8, 9]),
        memoryview(b"view"),
    ]
    with storage.stream_write(Path("tmp_step_1/mixed.bin")) as f:
        for part in parts:
            f.write(part)
        torch.save({"t": torch.ones(3)}, f)  # what the writer does with its stream
    storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)
    head = b"".join(memoryview(p).cast("B").tobytes() for p in parts)
    data = storage.read(Path("step_1/mixed.bin"))
    assert data[: len(head)] == head
    assert torch.equal(torch.load(io.BytesIO(data[len(head) :]))["t"], torch.ones(3))


def test_a_second_commit_of_a_name_is_refused(target: StoreTarget) -> None:
    storage = _storage(target)
    _stage(storage, "step_1", {"a.pt": b"first"})
    storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)

    # A new save of that name is refused before any byte of the committed one changes...
    with pytest.raises(CheckpointExistsError):
        storage.mkdir(Path("tmp_step_1"))
    with pytest.raises(CheckpointExistsError):
        storage.write(Path("tmp_step_1/a.pt"), b"second")
    # ...and so is a commit onto it (a FileExistsError, an OSError as the table asks).
    with pytest.raises(FileExistsError):
        storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)
    assert storage.read(Path("step_1/a.pt")) == b"first"


def test_rename_refuses_what_would_be_a_copy_on_an_object_store(target: StoreTarget) -> None:
    storage = _storage(target)
    _stage(storage, "step_1", {"a.pt": b"a"})
    with pytest.raises(OSError, match="not of"):
        storage.rename(Path("tmp_step_1"), Path("step_2"), is_directory=True)
    with pytest.raises(OSError, match="copy"):
        storage.rename(Path("tmp_step_1/a.pt"), Path("tmp_step_1/b.pt"))
    with pytest.raises(ConfigurationError, match="write_to_temp_dir"):
        storage.write(Path("step_1/a.pt"), b"in place")
    with pytest.raises(ConfigurationError, match="objckpt's own name"):
        storage.write(Path("tmp_step_1/manifest.json"), b"{}")


def test_a_file_whose_upload_did_not_finish_blocks_the_commit(target: StoreTarget) -> None:
    storage = _storage(target)
    _stage(storage, "step_1", {"a.pt": b"a"})
    storage._store.put("step_1/stray.pt", b"not through the storage")
    with pytest.raises(UploadError, match=r"stray\.pt"):
        storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)
    assert not storage.exists(Path("step_1"))
    # A record is bucket content too: a crafted one is refused, naming it.
    storage.delete(Path("tmp_step_1/stray.pt"))
    storage._checkpoint_store("step_1").create(
        f"{tco.SUMS_DIR}/a.pt.json", b'{"size": -1, "crc32c": "x"}', overwrite=True
    )
    with pytest.raises(ManifestError, match=r"a\.pt\.json"):
        storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)
    assert not storage.exists(Path("step_1"))


def test_a_failed_write_aborts_its_upload_and_records_nothing(target: StoreTarget) -> None:
    storage = _storage(target)
    with pytest.raises(RuntimeError), storage.stream_write(Path("tmp_step_1/a.pt")) as f:
        f.write(b"x" * 100)
        raise RuntimeError("serialisation failed")
    assert not storage.exists(Path("tmp_step_1"))
    assert storage._store.open_uploads() == []

    # A file staged by an earlier save whose rewrite then failed: its old record no
    # longer vouches for it, so the commit is refused instead of listing stale bytes.
    _stage(storage, "step_2", {"b.pt": b"old"})
    with pytest.raises(RuntimeError), storage.stream_write(Path("tmp_step_2/b.pt")) as f:
        f.write(b"new")
        raise RuntimeError("serialisation failed")
    with pytest.raises(UploadError, match=r"b\.pt"):
        storage.rename(Path("tmp_step_2"), Path("step_2"), is_directory=True)


def test_every_read_byte_is_checked_against_the_manifest(target: StoreTarget) -> None:
    storage = _config(target, read_block_size=1000).create_storage()
    data = os.urandom(4500)
    _stage(storage, "step_1", {"a.pt": data})
    storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)
    ranged = ReadArgs(pre_read_full_file=False, known_size_bytes=len(data))

    # Front to back in bounded ranges, with readinto: every byte arrives.
    buf = bytearray(len(data))
    with storage.stream_read(Path("step_1/a.pt"), ranged) as f:
        got = 0
        while got < len(data):
            n = f.readinto(memoryview(buf)[got:])
            assert 0 < n <= 1000
            got += n
        assert f.readinto(bytearray(10)) == 0
    assert bytes(buf) == data
    with storage.stream_read(Path("step_1/a.pt"), ranged) as f:
        f.seek(4000)
        assert f.read(10) == data[4000:4010]

    # The same key rewritten behind objckpt's back: each way of reading refuses it.
    bad = bytearray(data)
    bad[4321] ^= 1
    storage._store.put("step_1/a.pt", bytes(bad))
    fresh = _storage(target)
    with pytest.raises(ChecksumMismatchError, match=r"a\.pt"):
        fresh.read(Path("step_1/a.pt"))
    with pytest.raises(ChecksumMismatchError):
        fresh.stream_read(Path("step_1/a.pt"))
    with pytest.raises(ChecksumMismatchError), fresh.stream_read(Path("step_1/a.pt"), ranged) as f:
        f.read()
    with pytest.raises(ChecksumMismatchError), fresh.stream_read(Path("step_1/a.pt"), ranged) as f:
        f.seek(10)
        f.read(1)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
        "optimizer": {"step": seed, "m": torch.randn(64, 32, generator=g).to(torch.bfloat16)},
    }


def test_checkpoint_manager_saves_and_loads_through_the_manifest(target: StoreTarget) -> None:
    from torch_checkpointing import ItemSpec
    from torch_checkpointing.default_resharder import DefaultResharder

    # A resharder on the model: metadata.pkl is written, and the load reads slices.
    config = CheckpointManager.Config(
        items={"model": ItemSpec(resharder=DefaultResharder())},
        save=SyncCheckpointSaverConfig(),
        storage_config=_config(target),
    )
    manager = CheckpointManager(config)
    try:
        state = _state(1)
        manager.save("step_1", state)
        manager.save(f"{target.root}/step_2", _state(2))
        storage = _storage(target)
        assert storage.ls(Path("")) == ["step_1", "step_2"]
        assert "metadata.pkl" in storage.ls(Path("step_1"))
        into = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}, "optimizer": None}
        loaded = manager.load("step_1", into=into)
        torch.testing.assert_close(loaded["model"], state["model"], rtol=0, atol=0)
        assert loaded["model"]["w"] is into["model"]["w"]  # loaded in place
        assert loaded["optimizer"]["step"] == 1
        assert torch.equal(loaded["optimizer"]["m"], state["optimizer"]["m"])
        with pytest.raises(FileNotFoundError):
            manager.load("step_3", into=into)
        # A second save of a committed name is refused, and the first stays whole.
        with pytest.raises(CheckpointExistsError):
            manager.save("step_1", _state(9))
        blank = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(32)}, "optimizer": None}
        again = manager.load("step_1", into=blank)
        assert torch.equal(again["model"]["w"], state["model"]["w"])
    finally:
        manager.close()


def test_pickled_metadata_is_refused_unless_it_is_what_the_job_wrote(target: StoreTarget) -> None:
    """torch_checkpointing passes metadata.pkl to ``pickle.loads``: a tampered one is
    refused by its CRC32C before a byte of it reaches the unpickler."""
    from torch_checkpointing.metadata_serialization import TorchDistributedMetadataFormat

    storage = _storage(target)
    _stage(storage, "step_1", {"metadata.pkl": b"\x80\x04}\x94."})  # pickle of {}
    storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)
    storage._store.put("step_1/metadata.pkl", b"cos\nsystem\n(S'echo pwned'\ntR.")
    with pytest.raises(IntegrityError, match=r"metadata\.pkl"):
        TorchDistributedMetadataFormat.maybe_load(Path("step_1"), _storage(target))


def test_rmdir_deletes_the_manifest_first_and_clears_leftovers(target: StoreTarget) -> None:
    storage = _storage(target)
    _stage(storage, "step_1", {"a.pt": b"a"})
    storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)
    _stage(storage, "step_2", {"a.pt": b"b"})  # a failed save's leftovers...
    client = s3_client(target.storage_options)
    key = f"{target.root.split('/', 3)[3]}/step_2/big.pt"  # ...and a writer killed mid-upload
    upload = client.create_multipart_upload(Bucket=target.bucket, Key=key)
    client.upload_part(
        Bucket=target.bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 99
    )
    assert storage._store.open_uploads()
    storage.rmdir(Path("tmp_step_2"))
    assert storage._store.open_uploads() == []
    storage.rmdir(Path("step_1"))
    assert storage.ls(Path("")) == []
    assert storage._store.listing() == {}
    for gone in ("step_1", "tmp_step_2"):
        with pytest.raises(FileNotFoundError):
            storage.rmdir(Path(gone))


def test_the_config_pickles_for_the_writer_subprocess(target: StoreTarget) -> None:
    import pickle

    config = _config(target)
    assert pickle.loads(pickle.dumps(config)) == config
    with pytest.raises(ConfigurationError, match="temp_dir_prefix"):
        _config(target, temp_dir_prefix="")


def test_two_ranks_save_their_files_and_rank_0_commits_them_once(
    target: StoreTarget, tmp_path: Path
) -> None:
    import tc_ranks
    from ranks import run_ranks

    args = (str(tmp_path / "init"), target.root, target.storage_options)
    run_ranks(tc_ranks, tc_ranks.save_and_load, 2, *args)


def _expected_after(steps: int) -> dict[str, torch.Tensor]:
    """The training loop's state after ``steps`` steps, computed here (deterministic)."""
    sys.path.insert(0, str(TRAIN.parent))
    try:
        import tc_train
    finally:
        sys.path.remove(str(TRAIN.parent))
    model, opt = tc_train.build()
    for step in range(1, steps + 1):
        tc_train.train_step(model, opt, step)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_killed_async_save_leaves_no_checkpoint_and_training_resumes_bit_exact(
    target: StoreTarget, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TRAIN.parent), os.environ.get("PYTHONPATH", "")]),
    }
    args = [sys.executable, str(TRAIN), target.root, json.dumps(target.storage_options)]
    with subprocess.Popen(
        [*args, "--hang-at", "3"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its writer subprocess goes with it
    ) as child:
        try:
            assert child.stdout is not None
            lines = []
            for line in child.stdout:  # blocks until the next event line
                lines.append(line.strip())
                if line.startswith("staged 3"):
                    break
            assert lines and lines[-1] == "staged 3", lines
            assert "committed 2" in lines
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL

    storage = _storage(target)
    # Step 3's files are on the store, but step 3 does not exist for any reader.
    assert storage.ls(Path("")) == ["step_1", "step_2", "tmp_step_3"]
    assert not storage.exists(Path("step_3"))
    with pytest.raises(FileNotFoundError):
        storage.read(Path("step_3/metadata.pkl"))

    # Resume: load the newest committed step, train on, save step 3 over the leftovers.
    resumed = subprocess.run(
        [*args, "--resume", str(tmp_path / "resumed.pt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step_2" in resumed.stdout
    got = torch.load(tmp_path / "resumed.pt")
    for key, value in _expected_after(2).items():
        assert torch.equal(got["at_resume"][key], value), key
    for key, value in _expected_after(4).items():
        assert torch.equal(got["final"][key], value), key
    assert _storage(target).ls(Path("")) == ["step_1", "step_2", "step_3", "step_4"]


def test_stream_write_of_large_objects_is_a_multipart_upload(target: StoreTarget) -> None:
    from objckpt import UploadOptions

    mib = 1024 * 1024
    storage = _config(target, upload=UploadOptions(part_size=5 * mib)).create_storage()
    data = os.urandom(12 * mib)
    with storage.stream_write(Path("tmp_step_1/big.pt")) as f:
        for i in range(0, len(data), mib):
            f.write(data[i : i + mib])
    storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)
    head = storage._store.fresh_info("step_1/big.pt")
    assert "-" in str(head.get("ETag", "")).strip('"')  # a multipart ETag: <md5>-<parts>
    assert io.BytesIO(storage.read(Path("step_1/big.pt"))).getvalue() == data


@pytest.fixture(params=["memory", "file", "fake-gcs", "azure"])
def other_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    """The other store families objckpt has (Azure skipped, saying why, without Azurite)."""
    if request.param == "memory":
        return StoreTarget(root=f"memory://objckpt-test/{os.urandom(6).hex()}", storage_options={})
    if request.param == "file":
        return StoreTarget(root=f"file://{tmp_path}/root", storage_options={})
    return request.getfixturevalue(
        "fake_gcs_bucket" if request.param == "fake-gcs" else "az_container"
    )


def test_every_store_family_commits_by_manifest_and_checks_reads(other_store: StoreTarget) -> None:
    storage = _storage(other_store)
    data = os.urandom(2000)
    _stage(storage, "step_1", {"model_0.pt": data, "sub/x.json": b"{}"})
    assert not storage.exists(Path("step_1")) and storage.exists(Path("tmp_step_1"))
    storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)
    assert storage.ls(Path("")) == ["step_1"]
    assert storage.read(Path("step_1/model_0.pt")) == data
    with pytest.raises(FileExistsError):
        storage.rename(Path("tmp_step_1"), Path("step_1"), is_directory=True)
    bad = bytearray(data)
    bad[7] ^= 1
    storage._checkpoint_store("step_1").put("model_0.pt", bytes(bad))
    with pytest.raises(ChecksumMismatchError):
        _storage(other_store).read(Path("step_1/model_0.pt"))
