import json

import pytest

from objckpt.errors import ManifestError
from objckpt.format.manifest import Manifest, ObjectEntry


def _manifest(**kw) -> Manifest:
    base = dict(
        attempt="0123456789abcdef",
        created=Manifest.now(),
        world_size=2,
        objckpt_version="0.1.0",
        torch_version="2.13.0",
        objects=(
            ObjectEntry("__0_0.0123456789abcdef.distcp", 10, "0000abcd"),
            ObjectEntry(".metadata", 5, "ffffffff"),
        ),
        metadata={"state_dict": {}, "storage": []},
    )
    base.update(kw)
    return Manifest(**base)


def test_roundtrip() -> None:
    m = _manifest()
    doc = json.loads(m.to_json_bytes())
    assert doc["format"] == "objckpt.manifest" and doc["version"] == 2 and doc["total_bytes"] == 15
    assert Manifest.from_json_bytes(m.to_json_bytes(), url="u") == m


def _mutate(fn) -> bytes:
    doc = json.loads(_manifest().to_json_bytes())
    fn(doc)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"not json", "not valid JSON"),
        (b"[]", "not an objckpt manifest"),
        (_mutate(lambda d: d.update(version=5)), "newer than this objckpt"),
        (_mutate(lambda d: d.update(version=0)), "no valid format version"),
        (
            _mutate(lambda d: d["objects"][0].update(key="../../etc/passwd")),
            "escapes the checkpoint",
        ),
        (_mutate(lambda d: d["objects"][0].update(key="/abs")), "escapes the checkpoint"),
        (_mutate(lambda d: d["objects"][0].update(crc32c="xyz")), "crc32c"),
        (_mutate(lambda d: d["objects"][0].update(size=-1)), "size"),
        (_mutate(lambda d: d.update(total_bytes=1)), "total_bytes"),
        (_mutate(lambda d: d.pop("attempt")), "'attempt'"),
    ],
)
def test_bad_manifests_are_refused_with_the_url(data: bytes, needle: str) -> None:
    with pytest.raises(ManifestError) as info:
        Manifest.from_json_bytes(data, url="s3://b/c/manifest.json")
    assert needle in str(info.value) and "s3://b/c/manifest.json" in str(info.value)


def _text(fn) -> bytes:
    """The manifest's JSON text, edited as text (what json.dumps cannot write)."""
    return fn(_manifest().to_json_bytes())


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        # Nesting that json.loads would answer with a RecursionError naming nothing.
        (
            _text(
                lambda t: t.replace(
                    b'"user":{}', b'"user":{"x":' + b"[" * 10**5 + b"]" * 10**5 + b"}"
                )
            ),
            "nests 100002 levels deep",
        ),
        (_text(lambda t: t.replace(b'"size":10', b'"size":' + str(2**70).encode())), "64-bit"),
        (_text(lambda t: t.replace(b'"size":10', b'"size":' + b"9" * 5000)), "64-bit"),
        (_text(lambda t: t.replace(b'"size":10', b'"size":1e400')), "not finite"),
        (_text(lambda t: t.replace(b'"size":10', b'"size":NaN')), "NaN, which is not"),
        (_mutate(lambda d: d["objects"][0].update(key="a\x00b")), "escapes the checkpoint"),
    ],
)
def test_crafted_json_is_refused_naming_the_manifest(data: bytes, needle: str) -> None:
    with pytest.raises(ManifestError) as info:
        Manifest.from_json_bytes(data, url="s3://b/c/manifest.json")
    assert needle in str(info.value) and "s3://b/c/manifest.json" in str(info.value)


def test_a_manifest_over_the_size_cap_is_refused_naming_the_option() -> None:
    data = _manifest().to_json_bytes()
    assert Manifest.from_json_bytes(data, url="u", max_bytes=len(data)) == _manifest()
    with pytest.raises(ManifestError) as info:
        Manifest.from_json_bytes(data, url="s3://b/c/manifest.json", max_bytes=len(data) - 1)
    message = str(info.value)
    assert "s3://b/c/manifest.json" in message and "max_metadata_bytes" in message
    assert f"is {len(data)} bytes" in message and str(len(data) - 1) in message
