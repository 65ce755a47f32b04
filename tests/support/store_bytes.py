"""Every byte under a prefix of the moto server, read straight from the server.

Tests that promise "nothing committed changed" compare two of these: they list
the prefix and read every object, so a changed ``.metadata`` is as visible as a
changed payload, and nothing goes through objckpt (whose reader never reads
``.metadata`` and would not notice).
"""

from __future__ import annotations

from objckpt.format.layout import is_objckpt_object
from objckpt.testing import MotoServer


def snapshot(moto_server: MotoServer, bucket: str, prefix: str) -> dict[str, bytes]:
    """Key -> bytes of every object whose key starts with ``prefix``."""
    client = moto_server.boto3_client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def assert_untouched(before: dict[str, bytes], after: dict[str, bytes], attempt: str) -> None:
    """Every object of ``before`` is still there with every byte the same; anything
    added is an object only objckpt writes, of another attempt than ``attempt``
    (the committed one): a failed or losing attempt's garbage."""
    assert before, "nothing was committed to compare"
    changed = sorted(k for k in before if after.get(k) != before[k])
    assert not changed, f"committed objects changed or gone: {changed}"
    added = sorted(set(after) - set(before))
    assert all(is_objckpt_object(k) and attempt not in k for k in added), added
