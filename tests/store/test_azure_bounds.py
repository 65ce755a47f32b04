"""Azure under objckpt's time bounds (issue #48, item 3).

Against a stopped Azurite, azure-core's own retries (3 per kind, backing off 15, 18
and 24 s) and timeouts used to run instead of objckpt's: a save's result
failed only after 80-87 s and ``CheckpointManager()`` took as long. Now the service
client adlfs talks through carries objckpt's retry policy and timeouts
(:mod:`objckpt.writers.azureclient`): the :class:`~objckpt.RetryPolicy`,
``preflight_timeout`` and the save's deadline bound every Azure request, and the
error says what the store answered (or that it never did), with no secret in it.

No timing assertions: each test sets small bounds and a generous outer wait
(pytest-timeout, ``result(timeout=...)``) that only an unbounded request reaches.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers import carried, save

from objckpt import CheckpointManager, Location, RetryPolicy, UploadOptions
from objckpt.errors import StoreRefusedError, StoreUnreachableError
from objckpt.testing import Azurite, FaultProxy, Rule
from objckpt.testing.azure_operations import azure_operation
from objckpt.testing.azurite import AZURITE_KEY, AzuriteUnavailable, start_azurite
from objckpt.testing.plugin import StoreTarget
from objckpt.writers.azureclient import ObjckptRetry, RetryingAzureBlobFileSystem

#: Short bounds, so that a bounded failure costs seconds and an unbounded one (the
#: SDK's 80 s) runs into the tests' outer waits.
SHORT = RetryPolicy(base_delay=0.05, max_delay=0.5, give_up_after=3.0, request_deadline=5.0)


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 64, generator=g), "step": step}


def _no_secret(message: str) -> None:
    assert AZURITE_KEY not in message and "AccountKey" not in message, message


@pytest.fixture
def own_azurite() -> Iterator[Azurite]:
    """An Azurite of this test's own, which the test stops (the session's serves
    others)."""
    try:
        server = start_azurite()
    except AzuriteUnavailable as exc:
        pytest.skip(f"Azure Blob tests need Azurite: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(40)  # the SDK's own retries took 83 s here
def test_a_manager_against_a_stopped_azurite_fails_within_the_retry_policy(
    own_azurite: Azurite,
) -> None:
    """``CheckpointManager()`` lists the root; with the endpoint gone, that listing
    fails with ``StoreUnreachableError`` after the policy's attempts, naming the
    endpoint's silence and no secret."""
    container = own_azurite.create_container()
    options = own_azurite.storage_options()
    own_azurite.stop()
    with pytest.raises(StoreUnreachableError) as info:
        CheckpointManager(f"az://{container}/run", storage_options=options, retry=SHORT)
    message = str(info.value)
    assert container in message, message
    _no_secret(message)


@pytest.mark.timeout(40)
def test_a_save_preflight_against_a_stopped_azurite_fails_within_preflight_timeout(
    own_azurite: Azurite,
) -> None:
    """A plain DCP save's preflight is bounded by ``preflight_timeout`` (3 s here)
    in the retry layer, which says the store did not answer, how often, and which
    bound ended it (before, azure-core was still retrying when the outer wait ran
    out, and the message said only "no answer within 3 s")."""
    container = own_azurite.create_container()
    target = StoreTarget(
        root=f"az://{container}/t", storage_options=own_azurite.storage_options(), bucket=container
    )
    own_azurite.stop()
    slow = RetryPolicy(base_delay=0.5, max_delay=2.0, give_up_after=None, request_deadline=None)
    with pytest.raises(BaseException) as info:
        save(
            _state(1),
            target.url("x"),
            target,
            upload=UploadOptions(preflight_timeout=3),
            retry=slow,
        )
    err = carried(info.value)
    assert isinstance(err, StoreUnreachableError), repr(err)
    assert "preflight_timeout" in str(err) and "attempts" in str(err), str(err)
    _no_secret(str(err))


@pytest.mark.timeout(60)
def test_a_save_after_azurite_stopped_fails_within_give_up_after(own_azurite: Azurite) -> None:
    """A manager that saved once (its preflight done) saves again after Azurite
    stopped: the save's result is ``StoreUnreachableError`` once ``give_up_after``
    (3 s) has passed since the first refused connection, well before the save's
    deadline, and the outer wait (30 s) is never reached."""
    container = own_azurite.create_container()
    options = own_azurite.storage_options()
    with CheckpointManager(f"az://{container}/run", storage_options=options, retry=SHORT) as mgr:
        mgr.save(1, _state(1)).result(timeout=60)
        own_azurite.stop()
        handle = mgr.save(2, _state(2))
        with pytest.raises(BaseException) as info:
            handle.result(timeout=30)  # TimeoutError here: the save was not bounded
        err = carried(info.value)
        assert isinstance(err, StoreUnreachableError), repr(err)
        assert "give_up_after" in str(err) or "deadline" in str(err), str(err)
        _no_secret(str(err))


@pytest.mark.timeout(60)
def test_an_azurite_answering_500_fails_naming_the_answer(
    azurite: Azurite, az_container: StoreTarget
) -> None:
    """Every request answered 500: objckpt's policy retries it (once per attempt,
    through the proxy) and gives up after ``give_up_after`` with
    ``StoreRefusedError`` naming HTTP 500, not after azure-core's own retries."""
    with FaultProxy(azurite.endpoint_url, seed=3, operation_of=azure_operation) as proxy:
        options = azurite.storage_options(proxy.endpoint_url)
        proxy.add(Rule(status=500))
        target = StoreTarget(
            root=az_container.root, storage_options=options, bucket=az_container.bucket
        )
        with pytest.raises(BaseException) as info:
            save(
                _state(1),
                target.url("refused"),
                target,
                upload=UploadOptions(preflight_timeout=20),
                retry=SHORT,
            )
    err = carried(info.value)
    assert isinstance(err, StoreRefusedError), repr(err)
    assert "HTTP 500" in str(err), str(err)
    _no_secret(str(err))


def test_the_client_carries_objckpt_s_policy_unless_the_user_set_azure_retries(
    azurite: Azurite,
) -> None:
    """objckpt's retry policy and ``RetryPolicy.timeout`` go into the service
    client; a user's own azure-storage-blob retry settings (and adlfs's timeouts)
    win over them."""
    policy = RetryPolicy(timeout=7.0)
    loc = Location.parse("az://c/x", azurite.storage_options(), policy)
    fs = loc.open_fs(fresh=True)
    assert isinstance(fs, RetryingAzureBlobFileSystem)
    ours = fs.client_options()
    assert isinstance(ours["retry_policy"], ObjckptRetry) and ours["retry_policy"].policy is policy
    assert ours["connection_timeout"] == ours["read_timeout"] == 7.0

    mine = {**azurite.storage_options(), "retry_total": 2, "read_timeout": 30}
    fs = Location.parse("az://c/x", mine, policy).open_fs(fresh=True)
    theirs = fs.client_options()
    assert "retry_policy" not in theirs and theirs["retry_total"] == 2
    assert theirs["read_timeout"] == 30 and theirs["connection_timeout"] == 7.0


def test_messages_name_the_endpoint_without_a_sas_token() -> None:
    """A SAS token is a secret: what the retry layer names (the endpoint, each
    request's URL) carries no query string. (No request is sent here.)"""
    from objckpt.writers.azureclient import _without_query

    fs = RetryingAzureBlobFileSystem(
        account_name="acct", sas_token="sv=x&sig=SECRET", skip_instance_cache=True
    )
    assert isinstance(fs.service_client._config.retry_policy, ObjckptRetry)
    assert fs.endpoint() == "https://acct.blob.core.windows.net"
    url = _without_query("https://acct.blob.core.windows.net/c/b?sv=x&sig=SECRET")
    assert url == "https://acct.blob.core.windows.net/c/b"


def test_the_adlfs_and_sdk_internals_a_ranged_read_into_memory_uses_are_there() -> None:
    """What ``_cat_file_into`` relies on: adlfs's ``split_path`` (container, blob,
    version), its ``_timeout_kwargs`` (the transport timeouts it passes with every
    download), and azure-storage-blob's ``readinto``, which with one chunk at a time
    only writes to the file it is given."""
    import inspect

    from azure.storage.blob.aio import StorageStreamDownloader

    fs = RetryingAzureBlobFileSystem(
        account_name="devstoreaccount1", account_key=AZURITE_KEY, skip_instance_cache=True
    )
    assert fs.split_path("c/a/b.bin") == ("c", "a/b.bin", None)
    assert isinstance(fs._timeout_kwargs, dict)
    assert list(inspect.signature(StorageStreamDownloader.readinto).parameters) == [
        "self",
        "stream",
    ]
