"""objckpt's gcsfs subclass: the gcsfs internal it relies on, one retry loop, fast failures."""

from __future__ import annotations

import inspect
import time

import gcsfs
import pytest
from gcsfs import GCSFileSystem
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from objckpt import Location, RetryPolicy
from objckpt.testing import GcsEmulator
from objckpt.testing.plugin import StoreTarget
from objckpt.writers.accounting import RequestCounter, counting
from objckpt.writers.gcsclient import RetryingGCSFileSystem


def _supported(package: str, extra: str) -> SpecifierSet:
    from pathlib import Path

    import tomllib

    pyproject = Path(__file__).parents[2] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    spec = next(d for d in extras[extra] if d.startswith(package))
    return SpecifierSet(spec.removeprefix(package))


def test_the_gcsfs_internal_the_subclass_replaces_is_there() -> None:
    """``_request`` (every gcsfs request) wrapped by gcsfs's retry decorator, whose
    undecorated function objckpt calls instead."""
    assert Version(gcsfs.__version__) in _supported("gcsfs", "gcs"), gcsfs.__version__
    single = GCSFileSystem._request.__wrapped__
    assert inspect.iscoroutinefunction(single)
    names = list(inspect.signature(single).parameters)
    assert names[:3] == ["self", "method", "path"], names


def test_open_fs_builds_the_subclass(gcs_bucket: StoreTarget) -> None:
    policy = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.05, timeout=5)
    fs = Location.parse(gcs_bucket.root, gcs_bucket.storage_options, policy).open_fs(fresh=True)
    assert isinstance(fs, RetryingGCSFileSystem) and fs.retry_policy == policy


@pytest.mark.parametrize("which", ["invalid", "read_only"])
def test_wrong_credentials_fail_at_the_first_answer(
    gcs_emulator: GcsEmulator, gcs_bucket: StoreTarget, which: str
) -> None:
    """A 401 (invalid token) or 403 (read-only principal) is not retried: one request,
    and the error well before gcsfs's own loop would have given up (6 tries, ~31 s
    of backoff for a 401 "Invalid Credentials")."""
    opts = (
        gcs_emulator.invalid_credentials_options()
        if which == "invalid"
        else gcs_emulator.read_only_options()
    )
    policy = RetryPolicy(attempts=6, base_delay=1.0, max_delay=10.0, timeout=30)
    fs = Location.parse(gcs_bucket.root, opts, policy).open_fs(fresh=True)
    path = gcs_bucket.root.removeprefix("gs://") + "/obj"
    started = time.monotonic()
    refused = "Invalid Credentials" if which == "invalid" else "read-only principal"
    with counting(RequestCounter()) as counter, pytest.raises(Exception, match=refused):
        fs.pipe_file(path, b"payload")
    stats = counter.snapshot()
    assert stats.retries == 0 and sum(stats.requests.values()) == 1, stats
    assert time.monotonic() - started < 5
