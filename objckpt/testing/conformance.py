"""A conformance suite every store family passes (subclass it, as zarr's ``StoreTests``).

objckpt's guarantees rest on a few properties of each store family: the whole
protocol (reads, ranged reads, listings, HEADs, deletes) behaves alike, ``create`` is
create-only and atomic (the commit), an aborted upload leaves nothing visible,
``digest`` tells size and CRC32C without reading, open multipart uploads can be
found and aborted (``gc``), a server-side copy is byte-exact (backups). This suite
states them once; each family's test module subclasses :class:`StoreConformance`
and provides a ``store_location`` fixture (an empty :class:`~objckpt.Location`
per test). A new family, or a third-party store behind fsspec, proves itself the
same way::

    from objckpt.testing.conformance import StoreConformance

    class TestMyStore(StoreConformance):
        atomic_create = True            # what the family promises (see attributes)

        @pytest.fixture
        def store_location(self, tmp_path):
            return Location.parse(f"mystore://bucket/{tmp_path.name}", {...})

Attributes a subclass sets (the defaults are the weakest promise): what this
server was shown to do, checked against the store's own capability flags of the
same names (:class:`~objckpt.writers.base.ObjectStore`), which may promise more
for the family (S3 keeps CRC32C, moto does not):
    atomic_create: ``create`` is create-only even against a concurrent writer
        (checked with racing threads). False: only the sequential refusal is checked.
    keeps_crc32c: ``digest`` returns the CRC32C the store computed itself.
    lists_open_uploads: unfinished multipart uploads are listed by ``open_uploads``.
    part_size: the part size the suite's uploads use (multipart where the family has it).

The last group holds crafted checkpoints: bucket contents are untrusted, and a
reader's bounds rest on the store too (a ranged read stops where asked, a range
past an object's end reads as empty, a listing tells sizes), so each family shows
that a crafted manifest, index object or stock ``.metadata`` is refused naming it,
and that an object emptied after the commit is a size mismatch naming it. Real
stores answer a range of an empty object 416 (AWS S3, Ceph RGW, MinIO, GCS,
Azure), each client reporting it its own way; these cases hold on every family.

Listings: a store may list keys in any order (S3 Express One Zone directory buckets
do), so the suite checks that the steps and objects objckpt finds come out ordered
by objckpt, and a family tested through a proxy that reverses every listing (S3)
proves it.

One group states what objckpt must *not* need from a store, because a real S3 server
lacks it (Ceph RGW 16.2): a conditional CompleteMultipartUpload (the commit is
create-only at any size) and checksums kept or checked by the store (altered bytes
fail the load on objckpt's own CRC32C).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pickle
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp

from objckpt._torch import storage_info
from objckpt.dcp.storage_reader import ObjectStoreReader
from objckpt.dcp.storage_writer import ObjectStoreWriter
from objckpt.errors import ChecksumMismatchError, ManifestError, SizeMismatchError
from objckpt.format.layout import MANIFEST_KEY, METADATA_KEY
from objckpt.format.steps import committed_steps, step_name
from objckpt.options import UploadOptions
from objckpt.writers import ObjectStore, open_store
from objckpt.writers.location import Location
from objckpt.writers.reads import SpanSink

__all__ = ["StoreConformance"]

MiB = 1024 * 1024


def _crc(data: bytes) -> str:
    return f"{crc32c.crc32c(data):08x}"


def _save_alone(state: dict, location: Location) -> None:
    """``dcp.save`` of ``state`` to ``location`` by objckpt's writer, in one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            state,
            storage_writer=ObjectStoreWriter(
                location.url, storage_options=location.storage_options
            ),
            no_dist=True,
        )


class StoreConformance:
    """The properties objckpt needs from a store family; subclass to run them."""

    atomic_create: bool = False
    keeps_crc32c: bool = False
    lists_open_uploads: bool = False
    part_size: int = 5 * MiB

    @pytest.fixture
    def store_location(self) -> Location:
        raise NotImplementedError("a StoreConformance subclass provides store_location")

    @pytest.fixture
    def store(self, store_location: Location) -> Iterator[ObjectStore]:
        store = open_store(store_location, UploadOptions(part_size=self.part_size))
        try:
            yield store
        finally:
            store.close()

    def _upload(self, store: ObjectStore, key: str, data: bytes) -> None:
        upload = store.begin(key, len(data))
        try:
            for at in range(0, len(data), MiB):
                upload.write(data[at : at + MiB])
            upload.close().result()
        except BaseException:
            upload.abort()
            raise
        if upload.tracks_crc32c:
            assert upload.crc32c == _crc(data), (upload.crc32c, _crc(data))

    # -- plain objects ---------------------------------------------------------------------
    def test_put_read_exists_delete(self, store: ObjectStore) -> None:
        assert not store.exists("a.bin")
        store.put("a.bin", b"first")
        store.put("a.bin", b"second")  # put overwrites
        assert store.exists("a.bin") and store.read("a.bin") == b"second"
        store.delete("a.bin")
        assert not store.exists("a.bin")
        store.delete("a.bin")  # absent is fine

    def test_read_of_a_missing_object_raises_file_not_found(self, store: ObjectStore) -> None:
        with pytest.raises(FileNotFoundError):
            store.read("missing.bin")
        with pytest.raises(FileNotFoundError):
            store.digest("missing.bin")

    def test_listing_names_what_was_written(self, store: ObjectStore) -> None:
        for name in ("x.distcp", "y.distcp", "manifest.json"):
            store.put(name, name.encode())
        names = list(store.listing())
        assert sorted(names) == ["manifest.json", "x.distcp", "y.distcp"], names

    def test_steps_and_objects_are_in_order_whatever_order_the_store_lists(
        self, store: ObjectStore
    ) -> None:
        """objckpt orders what it lists itself: S3 Express One Zone directory buckets
        list keys in no particular order (other stores in lexicographic order)."""
        for step, key in ((3, MANIFEST_KEY), (1, MANIFEST_KEY), (20, MANIFEST_KEY),
                          (2, MANIFEST_KEY), (4, "x.distcp")):  # fmt: skip
            store.child(step_name(step)).put(key, b"{}")
        steps = committed_steps(store)
        assert [s.step for s in steps] == [1, 2, 3, 20], steps
        keys = [o.key for o in store.inventory()]
        assert keys == sorted(keys) and len(keys) == 5, keys

    def test_capability_flags_are_what_the_family_promises(self, store: ObjectStore) -> None:
        """The store's own flags (what objckpt's code consults) promise at least what
        this server was shown to do, and never a listing of uploads it cannot make."""
        assert store.atomic_create or not self.atomic_create, type(store).__name__
        assert store.keeps_crc32c or not self.keeps_crc32c, type(store).__name__
        assert store.lists_open_uploads == self.lists_open_uploads, type(store).__name__

    def test_a_listing_tells_names_and_sizes(self, store: ObjectStore) -> None:
        assert store.listing() == {}
        store.put("x.distcp", b"12345")
        store.put("manifest.json", b"")
        self._upload(store, "sub/inner.bin", b"abc")  # as a prefix-entropy payload is
        listed = store.listing()
        assert {k: v for k, v in listed.items() if k != "sub"} == {
            "x.distcp": 5,
            "manifest.json": 0,
        }, listed
        assert "sub" in listed, listed  # a sub-prefix is listed by its name
        assert store.listing("sub") == {"inner.bin": 3}
        assert store.listing("missing") == {}

    def test_ranged_reads_through_the_store(self, store: ObjectStore) -> None:
        store.put("five.bin", b"01234")
        assert store.read_range("five.bin", 1, 3) == b"12"
        assert store.read_range("five.bin", 3, 100) == b"34"
        assert store.read_range("five.bin", 5, 6) == b""
        assert store.read_range("five.bin", 2, 2) == b""
        assert store.read_bounded("five.bin", 2) == b"012"
        got = store.read_ranges(["five.bin", "five.bin", "missing.bin"], [0, 4, 0], [2, 9, 1])
        assert got[:2] == [b"01", b"4"], got
        assert isinstance(got[2], FileNotFoundError), got
        with pytest.raises(FileNotFoundError):
            store.read_range("missing.bin", 0, 1)
        data = os.urandom(MiB + 5)
        store.put("streamed.bin", data)
        with store.open_read("streamed.bin", block_size=MiB // 4) as f:
            assert f.read() == data

    def test_large_ranges_land_in_their_sinks(self, store: ObjectStore) -> None:
        """A load's ranges of a MiB and more, read into the memory the reader lays out
        (S3, GCS and Azure write them in as received, the others copy their answers
        in): bytes land across the buffers' edges, a range the object ends inside
        counts what it had, one past the end counts none, a missing object is its
        error, and an answer longer than its sink is counted, not written past it (the
        next read on the store is whole)."""
        data = os.urandom(3 * MiB + 7)
        store.put("big.bin", data)
        first, second = bytearray(MiB - 1), bytearray(5)
        third = bytearray(2 * MiB + 3 - len(first) - len(second))
        tail, past, gone = bytearray(2 * MiB), bytearray(2 * MiB), bytearray(2 * MiB)
        short, guard = bytearray(MiB), bytearray(8)
        got = store.read_ranges_into(
            ["big.bin", "big.bin", "big.bin", "missing.bin", "big.bin"],
            [100, 2 * MiB, len(data), 0, 0],
            [100 + 2 * MiB + 3, 4 * MiB, len(data) + 2 * MiB, 2 * MiB, 2 * MiB],
            [
                SpanSink([memoryview(first), memoryview(second), memoryview(third)]),
                SpanSink([memoryview(tail)]),
                SpanSink([memoryview(past)]),
                SpanSink([memoryview(gone)]),
                SpanSink([memoryview(short), memoryview(guard)]).window(0, MiB),
            ],
        )
        assert got[:3] == [2 * MiB + 3, MiB + 7, 0], got[:3]
        assert isinstance(got[3], FileNotFoundError), got[3]
        assert got[4] == 2 * MiB, got[4]
        assert bytes(first + second + third) == data[100 : 100 + 2 * MiB + 3]
        assert bytes(tail[: MiB + 7]) == data[2 * MiB :] and not any(tail[MiB + 7 :])
        assert not any(past) and not any(gone) and not any(guard)
        assert bytes(short) == data[:MiB]
        assert store.read_range("big.bin", 0, len(data)) == data

    def test_a_head_tells_size_and_a_tag_that_follows_the_bytes(self, store: ObjectStore) -> None:
        store.put("h.bin", b"first")
        first = store.head("h.bin")
        assert first.size == 5
        store.put("h.bin", b"second!")
        second = store.head("h.bin")
        assert second.size == 7
        if first.tag is not None:
            assert second.tag is not None and second.tag != first.tag, (first, second)
        with pytest.raises(FileNotFoundError):
            store.head("missing.bin")

    def test_delete_many_removes_what_it_names(self, store: ObjectStore) -> None:
        for name in ("a.bin", "b.bin", "c.bin"):
            store.put(name, b"x")
        store.delete_many(["a.bin", "b.bin", "never-written.bin"])
        assert sorted(store.listing()) == ["c.bin"]
        store.delete_many([])

    # -- streamed uploads ------------------------------------------------------------------
    @pytest.mark.parametrize("size", [0, 100, 2 * MiB + 3, 16 * MiB + 7])
    def test_an_upload_stores_exactly_its_bytes(self, store: ObjectStore, size: int) -> None:
        data = os.urandom(size)
        self._upload(store, "obj.bin", data)
        assert store.read("obj.bin") == data
        got_size, crc = store.digest("obj.bin")
        assert got_size == size
        if self.keeps_crc32c:
            assert crc == _crc(data), (crc, _crc(data))
        else:
            assert crc in (None, _crc(data))

    @pytest.mark.parametrize("ending", [b"\r", b"\r\n"], ids=["cr", "crlf"])
    def test_bytes_ending_in_a_line_break_round_trip(
        self, store: ObjectStore, ending: bytes
    ) -> None:
        """Every byte comes back where an object, or each part of it, ends in a line
        break or a part of one: a server that parses an upload as MIME must not take
        a trailing CR for its own line break (gcp-storage-emulator did, for one object
        of random bytes in 256: the ``cr`` rows). Through a PUT, a create and a
        streamed upload of several parts."""
        small = b"--x\r\n" + os.urandom(100) + ending
        store.put("put.bin", small)
        store.create("created.bin", small)
        size = 3 * self.part_size + 4_731
        data = (ending * (size // len(ending) + 1))[:size]  # each part ends in CR or LF
        self._upload(store, "parts.bin", data)
        assert store.read("put.bin") == small
        assert store.read("created.bin") == small
        assert store.read("parts.bin") == data

    def test_an_aborted_upload_leaves_nothing(self, store: ObjectStore) -> None:
        upload = store.begin("gone.bin", 3 * self.part_size)
        upload.write(os.urandom(3 * self.part_size))  # parts went out where there are parts
        upload.abort()
        assert not store.exists("gone.bin")
        assert [u for u in store.open_uploads() if u.key == "gone.bin"] == []

    def test_open_uploads_are_listed_and_can_be_aborted(self, store: ObjectStore) -> None:
        if not self.lists_open_uploads:
            assert store.open_uploads() == []
            return
        upload = store.begin("open.bin", 3 * self.part_size)
        upload.write(os.urandom(3 * self.part_size))  # two parts sent, never completed
        try:
            found = [u for u in store.open_uploads() if u.key == "open.bin"]
            assert len(found) == 1, store.open_uploads()
            store.abort_upload(found[0])
            assert [u for u in store.open_uploads() if u.key == "open.bin"] == []
        finally:
            upload.abort()
        assert not store.exists("open.bin")

    # -- the commit ------------------------------------------------------------------------
    def test_create_is_create_only(self, store: ObjectStore) -> None:
        store.create("manifest.json", b"one")
        with pytest.raises(FileExistsError):
            store.create("manifest.json", b"two")
        assert store.read("manifest.json") == b"one"
        store.create("manifest.json", b"three", overwrite=True)
        assert store.read("manifest.json") == b"three"

    def test_racing_creates_have_exactly_one_winner(self, store: ObjectStore) -> None:
        if not self.atomic_create:
            pytest.skip(f"{type(store).__name__} does not promise an atomic create")
        writers = 8
        start = threading.Barrier(writers)

        def attempt(n: int) -> bool:
            start.wait()
            try:
                store.create("race.json", f"writer {n}".encode())
            except FileExistsError:
                return False
            return True

        with concurrent.futures.ThreadPoolExecutor(writers) as pool:
            won = list(pool.map(attempt, range(writers)))
        assert won.count(True) == 1, won
        assert store.read("race.json") == f"writer {won.index(True)}".encode()

    # -- copies ----------------------------------------------------------------------------
    def test_server_side_copy_is_byte_exact_or_declined(
        self, store: ObjectStore, store_location: Location
    ) -> None:
        data = os.urandom(3 * MiB + 11)
        self._upload(store, "src.bin", data)
        other = open_store(store_location.child("copy"), store.options)
        try:
            copied = other.copy_from(store, "src.bin", len(data))
            assert copied is store.server_side_copy
            if copied:
                assert other.read("src.bin") == data
                assert other.digest("src.bin")[0] == len(data)
            else:
                assert not other.exists("src.bin")  # declined: nothing was written
        finally:
            other.close()

    # -- untrusted contents ----------------------------------------------------------------
    def test_a_bounded_read_stops_at_its_limit(self, store: ObjectStore) -> None:
        """What the manifest's size cap rests on: one ranged read of ``limit + 1``
        bytes, whatever the object's size (an empty one reads as empty)."""
        store.put("big.json", b"x" * (MiB + 10))
        store.put("small.json", b"{}")
        store.put("empty.json", b"")
        assert store.read_bounded("big.json", 1000) == b"x" * 1001
        assert store.read_bounded("small.json", 1000) == b"{}"
        assert store.read_bounded("empty.json", 1000) == b""
        with pytest.raises(FileNotFoundError):
            store.read_bounded("missing.json", 1000)

    def test_a_range_past_the_end_of_an_object_reads_as_empty(self, store: ObjectStore) -> None:
        """What every size check of a reader rests on: a range reads what lies in it,
        fewer bytes where the object ends inside it and none where it ends before it
        (any range of an empty object), and an empty range reads as empty."""
        store.put("empty.bin", b"")
        store.put("five.bin", b"01234")
        empty, five = "empty.bin", "five.bin"
        got = store.read_ranges(
            [empty, five, five, five, five, empty],
            [0, 0, 3, 5, 10, 0],
            [1000, 5, 1000, 6, 20, 0],
        )
        assert got == [b"", b"01234", b"34", b"", b"", b""], got
        missing = store.read_ranges(["missing.bin"], [0], [10])
        assert isinstance(missing[0], FileNotFoundError), missing

    @pytest.mark.parametrize("emptied", ["payload", "index"])
    def test_an_object_emptied_after_the_commit_is_a_size_mismatch_naming_it(
        self, store_location: Location, emptied: str
    ) -> None:
        """A payload or index object replaced by an empty one (a truncating tool, a
        damaged bucket) fails the load as the size mismatch it is, naming the
        object: the reader's ranges past its end read as empty, whatever the store
        answers them (416 on real stores), never as a store error."""
        location = store_location.child("ck")
        state = {"w": torch.arange(4096, dtype=torch.float32), "step": 3}
        _save_alone(state, location)
        ck = open_store(location, UploadOptions(part_size=self.part_size))
        try:
            manifest = json.loads(ck.read(MANIFEST_KEY))
            keys = [o["key"] for o in manifest["objects"]]
            marker = ".distcp" if emptied == "payload" else "__index_"
            culprit = next(k for k in keys if marker in k)
            ck.put(culprit, b"")
        finally:
            ck.close()
        with pytest.raises(BaseException) as info:
            reader = ObjectStoreReader(location.url, storage_options=location.storage_options)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({"w": torch.zeros(4096), "step": 0}, storage_reader=reader)
        err = _carried(info.value)
        assert isinstance(err, SizeMismatchError), repr(err)
        assert location.url_of(culprit) in str(err), str(err)

    def test_persistent_prefixes_save_load_and_retire_whole(
        self, store: ObjectStore, store_location: Location
    ) -> None:
        """A root's steps saved with persistent prefixes (#46): every payload in a
        spread directory in front of its step, a step that reuses the other's bytes
        loads, and retiring both leaves nothing behind on the store."""
        from objckpt.format.layout import is_objckpt_payload
        from objckpt.ops.maintain.retire import retire_steps

        store.put("beside-the-root", b"x")  # the bucket stays (an empty one is checked)
        root = store_location.child("run")
        upload = UploadOptions(
            part_size=self.part_size,
            object_size=64 * 1024,
            prefix_entropy=1,
            persistent_prefixes=True,
        )
        one, two = root.child(step_name(1)), root.child(step_name(2))
        frozen = torch.arange(64 * 1024, dtype=torch.float32)
        for n, (loc, base) in enumerate(((one, None), (two, one.url)), 1):
            writer = ObjectStoreWriter(
                loc.url, storage_options=loc.storage_options, upload=upload, reuse_from=base
            )
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                state = {"frozen": frozen, "w": torch.full((128, 128), float(n))}
                dcp.save(state, storage_writer=writer, no_dist=True)
        keys = [o.key for o in store.at(root).inventory()]
        payloads = [k for k in keys if is_objckpt_payload(k)]
        assert payloads and all(k.startswith("spread-") for k in payloads), keys
        assert {k.split("/")[1] for k in payloads} == {step_name(1), step_name(2)}, keys
        got = {"frozen": torch.zeros_like(frozen), "w": torch.zeros(128, 128)}
        reader = ObjectStoreReader(two.url, storage_options=two.storage_options)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(got, storage_reader=reader, no_dist=True)
        assert torch.equal(got["frozen"], frozen) and torch.equal(
            got["w"], torch.full((128, 128), 2.0)
        )
        report = retire_steps(root, [1], grace=0)
        assert report.kept and all(k.startswith("spread-") for k in report.kept), report
        assert any(k.startswith("spread-") for k in report.deleted), report  # step 1's own
        # (an hour ahead: the store's clock may be ahead of this one's)
        retire_steps(root, [2], grace=0, now=time.time() + 3600)
        assert store.at(root).inventory() == []

    @pytest.mark.parametrize("craft", ["index-claims-a-tib", "deep-manifest", "chunk-count"])
    def test_a_crafted_checkpoint_is_refused_naming_the_object(
        self, store: ObjectStore, store_location: Location, craft: str
    ) -> None:
        location = store_location.child("ck")
        state = {"w": torch.arange(1024, dtype=torch.float32), "step": 1}
        _save_alone(state, location)
        ck = open_store(location, store.options)
        try:
            culprit = _craft(ck, craft)
            with pytest.raises(BaseException) as info:
                reader = ObjectStoreReader(location.url, storage_options=location.storage_options)
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp.load({"w": torch.zeros(1024), "step": 0}, storage_reader=reader)
        finally:
            ck.close()
        err = _carried(info.value)
        assert isinstance(err, ManifestError), repr(err)
        assert location.url_of(culprit) in str(err), str(err)

    def test_a_stock_metadata_naming_a_path_outside_is_refused(
        self, store: ObjectStore, store_location: Location, tmp_path: Path
    ) -> None:
        stock = tmp_path / "stock"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"w": torch.ones(8)}, storage_writer=dcp.FileSystemWriter(str(stock)))
        metadata = pickle.loads((stock / METADATA_KEY).read_bytes())
        metadata.storage_data = {
            index: storage_info("../outside/" + info.relative_path, info.offset, info.length)
            for index, info in metadata.storage_data.items()
        }
        location = store_location.child("ck")
        for where in (location, store_location.child("outside")):
            target = open_store(where, store.options)
            try:
                for f in stock.iterdir():
                    target.put(f.name, f.read_bytes())
                if where is location:
                    target.put(METADATA_KEY, pickle.dumps(metadata))
            finally:
                target.close()
        with pytest.raises(ManifestError, match="escapes the checkpoint") as info:
            ObjectStoreReader(location.url, storage_options=location.storage_options)
        assert location.url_of(METADATA_KEY) in str(info.value)

    # -- what objckpt must not need from a store (Ceph RGW 16.2 lacks each) ----------------
    def test_create_is_create_only_for_a_body_of_several_parts(self, store: ObjectStore) -> None:
        """The commit never rests on a conditional CompleteMultipartUpload, which some
        S3 servers ignore (Ceph RGW 16.2 overwrites): a create larger than a part
        still refuses a second one and keeps the first bytes."""
        first = os.urandom(2 * self.part_size + self.part_size // 2)
        store.create("big.json", first)
        with pytest.raises(FileExistsError):
            store.create("big.json", os.urandom(len(first)))
        assert store.read("big.json") == first

    def test_bytes_altered_at_rest_fail_the_load_naming_the_object(
        self, store: ObjectStore, store_location: Location
    ) -> None:
        """objckpt checks its own CRC32C of what it reads and never relies on the store
        having checked one (Ceph RGW 16.2 keeps none and accepts a wrong one): a
        payload rewritten with its size kept fails the load, naming the object."""
        location = store_location.child("ck")
        state = {"w": torch.arange(4096, dtype=torch.float32), "step": 3}
        _save_alone(state, location)
        ck = open_store(location, store.options)
        try:
            manifest = json.loads(ck.read(MANIFEST_KEY))
            culprit = next(o["key"] for o in manifest["objects"] if ".distcp" in o["key"])
            data = bytearray(ck.read(culprit))
            data[len(data) // 2] ^= 0xFF
            ck.put(culprit, bytes(data))
        finally:
            ck.close()
        with pytest.raises(BaseException) as info:
            reader = ObjectStoreReader(location.url, storage_options=location.storage_options)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({"w": torch.zeros(4096), "step": 0}, storage_reader=reader)
        err = _carried(info.value)
        assert isinstance(err, ChecksumMismatchError), repr(err)
        assert location.url_of(culprit) in str(err), str(err)


def _craft(ck: ObjectStore, craft: str) -> str:
    """Edit the checkpoint in ``ck`` as an attacker would (recorded sizes and
    CRC32Cs kept matching); the key of the object that is now wrong."""
    manifest = json.loads(ck.read(MANIFEST_KEY))
    if craft == "index-claims-a-tib":
        key = next(k for k in manifest["metadata"]["index"] if k)
        index = json.loads(ck.read(key))
        index["length"] = [1 << 40] * (len(index["crc32c"]) // 8)
        data = json.dumps(index).encode()
        ck.put(key, data)
        entry = next(o for o in manifest["objects"] if o["key"] == key)
        entry.update(size=len(data), crc32c=_crc(data))
        manifest["total_bytes"] = sum(o["size"] for o in manifest["objects"])
    elif craft == "chunk-count":
        key, n = MANIFEST_KEY, 300_000_000
        manifest["metadata"]["state_dict"]["w"].update(
            chunks=n,
            offsets=[{"runs": [0, 0, n]}],
            sizes=[{"runs": [1024, 0, n]}],
            writer={"runs": [0, 0, n]},
        )
    else:
        key = MANIFEST_KEY
        manifest["user"] = {"x": 0}
        deep = b"[" * 100_000 + b"]" * 100_000
        ck.create(
            MANIFEST_KEY, json.dumps(manifest).encode().replace(b'{"x": 0}', deep), overwrite=True
        )
        return key
    ck.create(MANIFEST_KEY, json.dumps(manifest).encode(), overwrite=True)
    return key


def _carried(exc: BaseException) -> BaseException:
    """The error torch's CheckpointException carries, or ``exc`` itself."""
    failures = getattr(exc, "failures", None)
    if failures:
        failure = next(iter(failures.values()))
        return failure[0] if isinstance(failure, tuple) else failure
    return exc
