"""objckpt's s3fs subclass: the s3fs internals it relies on, and one retry loop only."""

from __future__ import annotations

import inspect

import pytest
import s3fs
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from s3fs import S3FileSystem

from objckpt import Location, RetryPolicy
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.writers.s3client import RetryingS3FileSystem


def _supported_s3fs() -> SpecifierSet:
    from pathlib import Path

    import tomllib

    pyproject = Path(__file__).parents[2] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    spec = next(d for d in extras["s3"] if d.startswith("s3fs"))
    return SpecifierSet(spec.removeprefix("s3fs"))


def test_the_s3fs_internals_the_subclass_overrides_are_there() -> None:
    """``_call_s3`` (every request passes it) and ``retries`` (s3fs's own loop) in
    the installed s3fs, which must lie in the range pyproject declares."""
    assert Version(s3fs.__version__) in _supported_s3fs(), s3fs.__version__
    assert inspect.iscoroutinefunction(S3FileSystem._call_s3)
    params = list(inspect.signature(S3FileSystem._call_s3).parameters.values())
    assert [p.name for p in params[:2]] == ["self", "method"]
    assert {p.kind for p in params[2:]} == {
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    }
    assert isinstance(S3FileSystem.retries, int)
    # _exists (a bucket's existence under requester-pays) and the sync exists that
    # s3fs defines on its class (replaced beside it).
    assert inspect.iscoroutinefunction(S3FileSystem._exists)
    assert "exists" in vars(S3FileSystem)
    assert "requester_pays" in inspect.signature(S3FileSystem.__init__).parameters


def test_open_fs_builds_the_subclass_and_leaves_s3fs_alone(s3_bucket: StoreTarget) -> None:
    policy = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05, timeout=5)
    fs = Location.parse(s3_bucket.root, s3_bucket.storage_options, policy).open_fs(fresh=True)
    assert isinstance(fs, RetryingS3FileSystem)
    assert fs.retry_policy == policy and fs.retries == 1
    assert S3FileSystem.retries == 5  # nothing patched on s3fs itself
    assert "_call_s3" not in vars(fs)  # no instance attribute replaced


@pytest.mark.parametrize("attempts", [1, 3])
def test_a_failing_request_is_tried_exactly_policy_attempts_times(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy, attempts: int
) -> None:
    """One retry loop: with every GET answered 500, the proxy sees ``attempts`` GETs,
    not ``attempts`` times s3fs's own 5 or botocore's. (A *reset* connection is
    also resent once by aiohttp itself, per RFC 9112, below every SDK layer.)"""
    policy = RetryPolicy(attempts=attempts, base_delay=0.01, max_delay=0.05, timeout=5)
    fs = Location.parse(s3_bucket.root, s3_proxy.storage_options(), policy).open_fs(fresh=True)
    path = s3_bucket.root.removeprefix("s3://") + "/obj"
    fs.pipe_file(path, b"payload")
    s3_proxy.add(Rule("GetObject", action="status", status=500))
    with pytest.raises(OSError):
        fs.cat_file(path)
    assert s3_proxy.count("GetObject") == attempts
    s3_proxy.clear()
    assert fs.cat_file(path) == b"payload"
