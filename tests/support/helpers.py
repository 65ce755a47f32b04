"""Small helpers shared by test modules."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import fsspec
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import objckpt
from objckpt.testing.plugin import StoreTarget

#: The default policy with a 3 s window: a refusal that lasts ends its request in
#: seconds, for tests whose subject is not the window's length (60 s by default).
SHORT_WINDOW = objckpt.RetryPolicy(base_delay=0.05, max_delay=0.5, give_up_after=3.0)


def carried(exc: BaseException) -> BaseException:
    """The error torch's CheckpointException carries (rank 0's), or ``exc`` itself."""
    if isinstance(exc, CheckpointException):
        failure = next(iter(exc.failures.values()))
        # torch stores (exception, traceback frames) per rank
        return failure[0] if isinstance(failure, tuple) else failure
    return exc


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save(
    state: dict[str, Any], url: str, target: StoreTarget, **kw: Any
) -> objckpt.ObjectStoreWriter:
    writer = objckpt.ObjectStoreWriter(url, storage_options=target.storage_options, **kw)
    with quiet():
        dcp.save(state, storage_writer=writer)
    return writer


def load(
    state: dict[str, Any], url: str, target: StoreTarget, **kw: Any
) -> objckpt.ObjectStoreReader:
    reader = objckpt.ObjectStoreReader(url, storage_options=target.storage_options, **kw)
    with quiet():
        dcp.load(state, storage_reader=reader)
    return reader


def fs_of(target: StoreTarget) -> fsspec.AbstractFileSystem:
    loc = objckpt.Location.parse(target.root, target.storage_options)
    return loc.open_fs(fresh=True)


def path_of(target: StoreTarget, url: str) -> str:
    return objckpt.Location.parse(url).path


def cli_env(moto_server: Any) -> dict[str, str]:
    """The environment that points the ``objckpt`` CLI at the test's moto server."""
    from objckpt.testing.servers import TEST_KEY, TEST_SECRET

    return {
        "AWS_ENDPOINT_URL": moto_server.endpoint_url,
        "AWS_ACCESS_KEY_ID": TEST_KEY,
        "AWS_SECRET_ACCESS_KEY": TEST_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def s3_client(opts: Any) -> Any:
    """A boto3 client for the S3 server of the storage options ``opts`` (endpoint
    and credentials): for what a test sets up or breaks by hand, never for what
    objckpt does."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=opts["endpoint_url"],
        aws_access_key_id=opts["key"],
        aws_secret_access_key=opts["secret"],
        region_name="us-east-1",
    )


def count_table_builds(monkeypatch: Any) -> list[int]:
    """A list that grows by one each time the host copier builds a piece table."""
    from objckpt.pipeline import host_copy

    built: list[int] = []
    real = host_copy._pieces

    def counting(*args: Any) -> Any:
        built.append(1)
        return real(*args)

    monkeypatch.setattr(host_copy, "_pieces", counting)
    return built
