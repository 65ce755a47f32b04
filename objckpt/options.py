"""Tuning knobs, one small frozen value per concern.

Defaults were chosen by measurement against a moto server on a 2-core machine and
by the stores' documented limits (S3: parts of 5 MiB to 5 GiB, at most 10,000 per
upload). Validation happens on construction, so a bad value is reported where it
was written, not halfway through a save.
"""

from __future__ import annotations

import dataclasses

from objckpt.errors import ConfigurationError

__all__ = ["ReadOptions", "UploadOptions"]

MiB = 1024 * 1024
S3_MIN_PART = 5 * MiB
S3_MAX_PART = 5 * 1024 * MiB
MAX_PARTS = 10_000


def _require(cond: bool, option: str, value: object, expected: str) -> None:
    if not cond:
        raise ConfigurationError(f"option {option}={value!r} is invalid: expected {expected}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class UploadOptions:
    """How payload bytes are cut into objects and parts.

    Attributes:
        part_size: Bytes per multipart part. Objects up to twice this go up in one
            request; larger ones as multipart uploads. Grown automatically so an
            object never needs more than 10,000 parts.
        object_size: Target size of a payload object. Small tensors are packed
            together up to this size; a larger tensor gets an object of its own.
            Moderate objects keep ranged reads cheap and let uploads run in parallel.
        max_inflight: Parts (or small objects) uploading at once per writer; also
            bounds the memory held by part buffers to ``max_inflight * part_size``.
        prefix_entropy: Hex digits of hashed sub-prefix in front of each payload
            key (0 = off). S3 serves about 3,500 PUT/s per prefix: a save whose
            ranks write more than that per second at once (e.g. 512 ranks x 8 parts
            in flight, parts finishing every ~1 s = 4,096 PUT/s) can meet 503s on
            one prefix; 1 digit spreads them over 16 prefixes, 2 over 256.
    """

    part_size: int = 16 * MiB
    object_size: int = 64 * MiB
    max_inflight: int = 8
    prefix_entropy: int = 0

    def __post_init__(self) -> None:
        _require(
            isinstance(self.part_size, int) and S3_MIN_PART <= self.part_size <= S3_MAX_PART,
            "part_size",
            self.part_size,
            "an int between 5 MiB and 5 GiB (S3's part limits)",
        )
        _require(
            isinstance(self.object_size, int) and self.object_size >= 1,
            "object_size",
            self.object_size,
            "a positive int (bytes)",
        )
        _require(
            isinstance(self.max_inflight, int) and 1 <= self.max_inflight <= 256,
            "max_inflight",
            self.max_inflight,
            "an int between 1 and 256",
        )
        _require(
            isinstance(self.prefix_entropy, int)
            and not isinstance(self.prefix_entropy, bool)
            and 0 <= self.prefix_entropy <= 8,
            "prefix_entropy",
            self.prefix_entropy,
            "an int between 0 (off) and 8 hex digits",
        )

    def part_size_for(self, size_hint: int) -> int:
        """The part size for an object of about ``size_hint`` bytes (<= 10,000 parts)."""
        needed = -(-size_hint // (MAX_PARTS - 100))  # keep headroom for the estimate
        needed = -(-needed // MiB) * MiB
        return min(max(self.part_size, needed), S3_MAX_PART)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReadOptions:
    """How payload bytes are fetched on load.

    Attributes:
        verify: Check every item's CRC32C against the manifest.
        range_size: Largest single ranged GET; bigger spans are split so they
            download in parallel.
        coalesce_gap: Ranges of one object closer than this are fetched as one.
        max_inflight_bytes: Bytes fetched but not yet copied into tensors.
        trust_pickles: Let non-tensor values be unpickled with full pickle (custom
            classes). Off: they are read with ``torch.load(weights_only=True)``,
            which admits plain values only, so a crafted checkpoint cannot run code.
    """

    verify: bool = True
    range_size: int = 16 * MiB
    coalesce_gap: int = 1 * MiB
    max_inflight_bytes: int = 256 * MiB
    trust_pickles: bool = False

    def __post_init__(self) -> None:
        _require(isinstance(self.verify, bool), "verify", self.verify, "True or False")
        _require(
            isinstance(self.trust_pickles, bool),
            "trust_pickles",
            self.trust_pickles,
            "True or False",
        )
        _require(
            isinstance(self.range_size, int) and self.range_size >= 64 * 1024,
            "range_size",
            self.range_size,
            "an int >= 64 KiB",
        )
        _require(
            isinstance(self.coalesce_gap, int) and self.coalesce_gap >= 0,
            "coalesce_gap",
            self.coalesce_gap,
            "an int >= 0",
        )
        _require(
            isinstance(self.max_inflight_bytes, int) and self.max_inflight_bytes >= self.range_size,
            "max_inflight_bytes",
            self.max_inflight_bytes,
            "an int >= range_size",
        )
