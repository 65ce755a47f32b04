"""No network round trip in an async save's stall (issue #27, item 3).

``save()`` may wait for the copy into staging and for its collectives, not for the
store. Each test holds every request at the fault proxy (a ``hold`` rule) while
``save()`` runs: a save that waited for any answer could not return until the
test releases the hold, so returning at all is the proof. A manager knows which
steps are committed (its step list); a bare save asks "already committed?" on
rank 0 in the background, and its uploads wait for the answer: a committed URL
fails the save's handle on every rank with nothing uploaded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import stall_ranks
import torch
from helpers import save
from ranks import run_ranks
from store_bytes import assert_untouched, snapshot

from objckpt import AsyncCheckpointer, AsyncOptions, CheckpointManager, Location
from objckpt.errors import CheckpointExistsError
from objckpt.format.manifest import read_manifest
from objckpt.format.steps import step_name
from objckpt.testing import FaultProxy, MotoServer, Rule
from objckpt.testing.plugin import StoreTarget
from objckpt.testing.proxy import Seen
from objckpt.writers import open_store

#: Holds every request until the test releases it (the stall only ends a hang).
HOLD = Rule(action="hold", stall=600.0)
#: How long a save() may take to return while requests are held. Only a save that
#: waits for a held answer ever reaches it: the bound turns that hang into a failure.
HANG = 120.0
#: The requests that upload a save's bytes.
WRITES = ("PutObject", "CreateMultipartUpload", "UploadPart")


def _state(seed: int, extra: bool = False) -> dict[str, Any]:
    state: dict[str, Any] = {"w": torch.full((1 << 14,), float(seed)), "step": seed}
    if extra:  # another structure: planned anew instead of replaying the cached plan
        state["b"] = torch.arange(7) * seed
    return state


def _prefix(url: str) -> str:
    """``/<bucket>/<key prefix>/`` of ``url``, as the proxy records request paths."""
    return "/" + Location.parse(url).path + "/"


def _key_prefix(url: str) -> str:
    """The key prefix of ``url`` in its bucket (what :func:`snapshot` reads)."""
    return Location.parse(url).path.split("/", 1)[1] + "/"


def _writes_under(proxy: FaultProxy, url: str) -> list[str]:
    return [p for op in WRITES for p in proxy.paths(op) if p.startswith(_prefix(url))]


def _attempt(url: str, target: StoreTarget) -> str:
    store = open_store(Location.parse(url, target.storage_options))
    try:
        return read_manifest(store).attempt
    finally:
        store.close()


def _returns_while_held(proxy: FaultProxy, call: Callable[[], Any]) -> tuple[Any, list[Seen]]:
    """``call()`` (a save) on a thread while the proxy holds every request; returns
    its result and the requests that reached the proxy between its entry and its
    return. Fails when it does not return: it waits for a held answer."""
    box: dict[str, Any] = {}
    returned = threading.Event()
    entry = len(proxy.seen)

    def run() -> None:
        try:
            box["result"] = call()
        except BaseException as exc:
            box["error"] = exc
        box["during"] = proxy.seen[entry:]  # at the moment it returned
        returned.set()

    thread = threading.Thread(target=run, name="save-under-hold", daemon=True)
    thread.start()
    if not returned.wait(HANG):
        ops = sorted({s.operation for s in proxy.seen[entry:]})
        proxy.release()
        thread.join(HANG)
        pytest.fail(f"save() did not return while every request was held: it waited on {ops}")
    if "error" in box:
        raise box["error"]
    return box["result"], box["during"]


def test_a_managers_later_saves_make_no_request_before_save_returns(
    s3_proxy: FaultProxy, s3_bucket: StoreTarget
) -> None:
    opts = AsyncOptions(workers=1, max_saves_in_flight=2)
    root = s3_bucket.url("run")
    with CheckpointManager(
        root, storage_options=s3_proxy.storage_options(), async_options=opts
    ) as mgr:
        mgr.save(1, _state(1)).result(timeout=120)  # the first save proves the bucket
        s3_proxy.add(HOLD)
        handles = []
        for step in (2, 3):
            handle, during = _returns_while_held(s3_proxy, partial(mgr.save, step, _state(step)))
            handles.append(handle)
            # Between save() being called and returning, at most the payload uploads of
            # this save and of the saves queued before it started (in the workers, which
            # may pick an earlier save's item up only now, on a loaded machine): nothing
            # of save() itself.
            queued = [f".{h.attempt}." for h in handles]
            foreign = [
                (s.operation, s.path) for s in during if not any(a in s.path for a in queued)
            ]
            assert foreign == [], f"step {step}: requests while save() ran: {foreign}"
        s3_proxy.release()
        for handle in handles:
            assert handle.result(timeout=120) is not None
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2, 3]


@pytest.mark.parametrize("extra", [False, True], ids=["replayed", "planned"])
def test_a_bare_save_to_a_committed_url_returns_then_fails_with_nothing_uploaded(
    extra: bool, s3_proxy: FaultProxy, s3_bucket: StoreTarget, moto_server: MotoServer
) -> None:
    url = s3_bucket.url("done")
    save(_state(1), url, s3_bucket)  # committed, straight to the server
    before = snapshot(moto_server, s3_bucket.bucket, _key_prefix(url))
    assert before, "nothing committed to compare"
    options = AsyncOptions(workers=1)
    with AsyncCheckpointer(storage_options=s3_proxy.storage_options(), async_options=options) as c:
        c.save(_state(2), s3_bucket.url("warm")).result(timeout=120)  # the bucket's preflight
        s3_proxy.clear()
        s3_proxy.add(HOLD)
        handle, during = _returns_while_held(s3_proxy, lambda: c.save(_state(2, extra), url))
        assert s3_proxy.received_bytes("ListObjectsV2") == 0  # no listing answered in save()
        s3_proxy.release()
        with pytest.raises(CheckpointExistsError, match="already holds a committed checkpoint"):
            handle.result(timeout=120)
    assert s3_proxy.count("ListObjectsV2") >= 1  # it was asked, in the background
    assert _writes_under(s3_proxy, url) == []  # the refusal came before any upload
    after = snapshot(moto_server, s3_bucket.bucket, _key_prefix(url))
    assert after == before
    assert all(s.operation not in WRITES for s in during), during


def test_two_ranks_refused_in_the_background_both_fail_with_nothing_uploaded(
    s3_proxy: FaultProxy, s3_bucket: StoreTarget, moto_server: MotoServer, tmp_path: Any
) -> None:
    url = s3_bucket.url("done2")
    save(_state(1), url, s3_bucket)  # committed, straight to the server
    key_prefix = _key_prefix(url)
    before = snapshot(moto_server, s3_bucket.bucket, key_prefix)
    assert before, "nothing committed to compare"
    init_file = tmp_path / "init"
    body = stall_ranks.refused_in_the_background.__name__
    args = (body, 2, str(init_file), url, s3_proxy.storage_options())
    run_ranks(stall_ranks, *args)
    verdicts = [(tmp_path / f"init.rank{r}").read_text() for r in range(2)]
    assert verdicts[0].startswith("CheckpointExistsError: "), verdicts
    assert "already holds a committed checkpoint" in verdicts[0], verdicts
    assert verdicts[1].startswith("PeerRankError: "), verdicts
    assert "refused on rank 0: CheckpointExistsError" in verdicts[1], verdicts
    assert _writes_under(s3_proxy, url) == []
    assert snapshot(moto_server, s3_bucket.bucket, key_prefix) == before


def test_a_step_committed_behind_the_managers_back_loses_at_the_commit(
    s3_proxy: FaultProxy, s3_bucket: StoreTarget, moto_server: MotoServer
) -> None:
    """The step list is what the manager decides from; the create-only manifest is
    the guard against a writer it does not know about (another job)."""
    root = s3_bucket.url("run")
    opts = AsyncOptions(workers=1)
    with CheckpointManager(
        root, storage_options=s3_proxy.storage_options(), async_options=opts
    ) as mgr:
        mgr.save(1, _state(1)).result(timeout=120)
        step_url = f"{root}/{step_name(2)}"
        save(_state(9), step_url, s3_bucket)  # another job commits step 2
        key_prefix = _key_prefix(step_url)
        before = snapshot(moto_server, s3_bucket.bucket, key_prefix)
        handle = mgr.save(2, _state(2))  # the step list says absent: no request
        with pytest.raises(CheckpointExistsError, match=step_name(2)):
            handle.result(timeout=120)
        with pytest.raises(CheckpointExistsError):
            mgr.check_for_errors()
    after = snapshot(moto_server, s3_bucket.bucket, key_prefix)
    assert_untouched(before, after, _attempt(step_url, s3_bucket))
