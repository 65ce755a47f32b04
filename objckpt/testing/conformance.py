"""A conformance suite every store family passes (subclass it, as zarr's ``StoreTests``).

objckpt's guarantees rest on a few properties of each store family: ``create`` is
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

Attributes a subclass sets (the defaults are the weakest promise):
    atomic_create: ``create`` is create-only even against a concurrent writer
        (checked with racing threads). False: only the sequential refusal is checked.
    keeps_crc32c: ``digest`` returns the CRC32C the store computed itself.
    lists_open_uploads: unfinished multipart uploads are listed by ``open_uploads``.
    part_size: the part size the suite's uploads use (multipart where the family has it).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Iterator

import crc32c
import pytest

from objckpt.format.layout import list_names
from objckpt.options import UploadOptions
from objckpt.writers import ObjectStore, open_store
from objckpt.writers.location import Location

__all__ = ["StoreConformance"]

MiB = 1024 * 1024


def _crc(data: bytes) -> str:
    return f"{crc32c.crc32c(data):08x}"


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
        names = list_names(store.fs, store.location.path)
        assert sorted(names) == ["manifest.json", "x.distcp", "y.distcp"], names

    # -- streamed uploads ------------------------------------------------------------------
    @pytest.mark.parametrize("size", [0, 100, 2 * MiB + 3, 11 * MiB + 7])
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
