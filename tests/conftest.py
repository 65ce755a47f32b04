"""Shared fixtures: one store target per family, and state-dict builders."""

from __future__ import annotations

import os
import socket
import threading

# Before anything imports gcsfs: no gRPC bucket probes (each stalls ~60 s against
# the plain-HTTP emulator), for this suite and the processes it starts.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from objckpt.testing.plugin import StoreTarget


@pytest.fixture(params=["memory", "file", "s3", "gcs", "fake-gcs"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> StoreTarget:
    """The same test against every store family, on real servers where there are any
    (GCS twice: gcp-storage-emulator with objckpt's precondition launcher, and
    fake-gcs-server, which enforces preconditions itself)."""
    kind = request.param
    if kind == "memory":
        return StoreTarget(root=f"memory://objckpt-test/{uuid.uuid4().hex}", storage_options={})
    if kind == "file":
        return StoreTarget(root=f"file://{tmp_path}/root", storage_options={})
    if kind == "s3":
        return request.getfixturevalue("s3_bucket")
    if kind == "fake-gcs":
        return request.getfixturevalue("fake_gcs_bucket")
    return request.getfixturevalue("gcs_bucket")


@pytest.fixture(params=["file", "s3"])
def target(request: pytest.FixtureRequest, tmp_path: Any) -> StoreTarget:
    """A run's store, on the local filesystem and on moto (a module may define its own)."""
    if request.param == "file":
        return StoreTarget(root=f"file://{tmp_path}/root", storage_options={})
    return request.getfixturevalue("s3_bucket")


def sample_state(seed: int = 0, big: int = 3 * 1024 * 1024) -> dict[str, Any]:
    """A state dict with several dtypes, a large tensor, a view, and plain values."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, 64, generator=g)
    return {
        "model": {
            "w": torch.randn(256, 512, generator=g),
            "b": torch.randn(512, generator=g).to(torch.bfloat16),
            "big": torch.randn(big, generator=g),
            "view": base[8:16],  # a view of a larger storage
            "ids": torch.randint(0, 1000, (100,), generator=g),
            "mask": torch.rand(33, generator=g) > 0.5,
        },
        "step": 1234,
        "extra": {"name": "run-1", "lr": [0.1, 0.01]},
    }


def empty_like_state(state: dict[str, Any]) -> dict[str, Any]:
    def blank(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: blank(x) for k, x in v.items()}
        if isinstance(v, list):
            return [blank(x) for x in v]
        return None

    return blank(state)


def assert_state_equal(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert set(got) == set(want)
        for k in want:
            assert_state_equal(got[k], want[k])
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_state_equal(g, w)
    else:
        assert got == want


@pytest.fixture
def black_hole() -> Iterator[str]:
    """An endpoint that accepts connections and never answers (a frozen store)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join()
    for c in accepted:
        c.close()
    sock.close()


@pytest.fixture
def cli(moto_server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run the ``objckpt`` CLI in-process against the test's moto server."""
    from click.testing import CliRunner, Result
    from helpers import cli_env

    from objckpt.cli import main

    for k, v in cli_env(moto_server).items():
        monkeypatch.setenv(k, v)

    def run(*args: str) -> Result:
        return CliRunner().invoke(main, list(args), catch_exceptions=False)

    return run
