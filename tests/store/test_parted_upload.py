"""The write side shared by S3's parts, Azure's blocks and GCS's composed pieces
(``PartedUpload``): parts of ``part_size`` in the order written, each with its CRC32C,
a ``write`` copied at once (the caller may reuse its buffer), a ``write_kept`` held
as it lies (a part refers to the caller's memory: no copy until it is sent, and none
at all where the body is streamed, S3's and Azure's)."""

from __future__ import annotations

import concurrent.futures

from objckpt.writers.base import PartedUpload
from objckpt.writers.body import Part
from objckpt.writers.checksum import crc32c_combine, crc32c_of, format_crc


class Parts(PartedUpload):
    """Keeps each part it would send."""

    def __init__(self, part_size: int) -> None:
        super().__init__("k", part_size)
        self.held: list[Part] = []
        self.parts: list[bytes] = []  # each part's bytes as they are when it is sent
        self.crc = 0

    def _part_full(self, part: Part) -> None:
        self.held.append(part)
        self.parts.append(b"".join(part.pieces))
        self.crc = crc32c_combine(self.crc, part.crc, part.size)

    def close(self) -> concurrent.futures.Future[None]:
        if self._part.size:
            self._part_full(self._take_part())
        self.crc32c = format_crc(self.crc)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        done.set_result(None)
        return done

    def abort(self) -> None:
        self._take_part()


def test_parts_hold_what_was_written_in_order_across_part_boundaries() -> None:
    upload = Parts(part_size=10)
    written = [b"abc", bytearray(b"defghijklmnop"), memoryview(b"qrstuvwxyz0123456789!")]
    for n, data in enumerate(written):
        upload.write_kept(data) if n % 2 else upload.write(data)
    upload.close().result()
    whole = b"".join(bytes(d) for d in written)
    assert upload.parts == [whole[at : at + 10] for at in range(0, len(whole), 10)]
    assert [p.crc for p in upload.held] == [crc32c_of(p) for p in upload.parts]
    assert upload.crc32c == f"{crc32c_of(whole):08x}"


def test_write_copies_and_write_kept_reads_the_callers_bytes_when_the_part_is_sent() -> None:
    """``write`` may be given a buffer the caller reuses at once: what was written is
    sent. ``write_kept``'s bytes are the caller's until the upload ends (its
    contract): not copied when written, so a part is one copy of them."""
    upload = Parts(part_size=12)
    reused, kept = bytearray(b"aaaa"), bytearray(b"bbbb")
    upload.write(reused)
    reused[:] = b"xxxx"
    upload.write_kept(kept)
    kept[:2] = b"BB"  # before its part is sent (the last part: at close)
    upload.close().result()
    assert upload.parts == [b"aaaaBBbb"]
    # The kept bytes are referenced where they lie, not copied.
    assert [bytes(p) for p in upload.held[0].pieces] == [b"aaaa", b"BBbb"]
    assert upload.held[0].pieces[1].obj is kept  # type: ignore[union-attr]


def test_an_abort_drops_what_was_held() -> None:
    upload = Parts(part_size=8)
    upload.write(b"abc")
    upload.abort()
    upload.write(b"12345678")
    assert upload.parts == [b"12345678"]
