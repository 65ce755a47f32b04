import pytest

from objckpt import Location
from objckpt.errors import ConfigurationError


@pytest.mark.parametrize(
    ("url", "protocol", "path"),
    [
        ("s3://bkt/run/step-1", "s3", "bkt/run/step-1"),
        ("s3://bkt/run/", "s3", "bkt/run"),
        ("gs://bkt/a", "gs", "bkt/a"),
        ("memory://bkt/a", "memory", "/bkt/a"),
        ("file:///tmp/x/", "file", "/tmp/x"),
    ],
)
def test_parse(url: str, protocol: str, path: str) -> None:
    loc = Location.parse(url)
    assert (loc.protocol, loc.path) == (protocol, path)


def test_plain_path_is_local(tmp_path) -> None:
    loc = Location.parse(str(tmp_path / "c"))
    assert loc.protocol == "file" and loc.url == f"file://{tmp_path}/c"


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("nosuch://b/c", "unknown protocol 'nosuch'"),
        ("s3://", "names no bucket"),
        ("s3://bucket-only", "names only a bucket"),
        ("", "non-empty"),
        ("s3://b/c?x=1", "query"),
    ],
)
def test_bad_urls_are_named(url: str, needle: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        Location.parse(url)
    assert needle in str(info.value)


def test_storage_options_stay_out_of_repr() -> None:
    loc = Location.parse("s3://b/c", {"secret": "hunter2-secret"})
    assert "hunter2" not in repr(loc)
    child = loc.child("step-1")
    assert child.url == "s3://b/c/step-1" and child.storage_options == {"secret": "hunter2-secret"}
