"""The commit is create-only on every store, and a retried commit settles by read-back."""

from __future__ import annotations

import concurrent.futures
import os
import threading

import pytest
import torch
from commit_strategies import STRATEGIES, commit_via, one_value_save
from helpers import carried, fs_of, load, path_of, save
from torch.distributed.checkpoint.metadata import Metadata

from objckpt import Location, UploadOptions
from objckpt.errors import CheckpointExistsError
from objckpt.format.layout import MANIFEST_KEY
from objckpt.format.settle import put_manifest
from objckpt.testing.plugin import StoreTarget
from objckpt.writers import open_store


def _store(target: StoreTarget, name: str):
    return open_store(Location.parse(target.url(name), target.storage_options), UploadOptions())


def test_create_is_exclusive_under_a_race(store: StoreTarget) -> None:
    s = _store(store, "race")
    if s.location.protocol == "file":
        import os

        os.makedirs(s.location.path, exist_ok=True)
    barrier = threading.Barrier(6)

    def attempt(n: int) -> bool:
        barrier.wait()
        try:
            s.create("k", f"writer {n}".encode())
            return True
        except FileExistsError:
            return False

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        wins = list(pool.map(attempt, range(6)))
    assert wins.count(True) == 1
    assert s.read("k") == f"writer {wins.index(True)}".encode()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_retried_commit_of_the_same_attempt_is_settled(store: StoreTarget, strategy: str) -> None:
    """A manifest PUT retried after its answer was lost meets its own write: the same
    bytes are ours. Other bytes, even of the same attempt, are another commit's."""
    s = _store(store, "c")
    if strategy == "helper" and s.location.protocol == "memory":
        pytest.skip("memory:// is private to its process: its commit never uses the helper")
    if s.location.protocol == "file":
        import os

        os.makedirs(s.location.path, exist_ok=True)
    empty = Metadata(state_dict_metadata={})
    commit_via(strategy, s, empty, [], attempt="aaaaaaaaaaaaaaaa", world_size=1, overwrite=False)
    ours = s.read(MANIFEST_KEY)
    put_manifest(s, ours)  # the retried PUT: settled as committed
    with pytest.raises(CheckpointExistsError, match=r"already committed by attempt a{16}"):
        put_manifest(s, ours.replace(b'"world_size":1', b'"world_size":2'))
    with pytest.raises(
        CheckpointExistsError, match="already committed by attempt aaaaaaaaaaaaaaaa"
    ):
        commit_via(
            strategy, s, empty, [], attempt="bbbbbbbbbbbbbbbb", world_size=1, overwrite=False
        )
    assert s.read(MANIFEST_KEY) == ours


def test_two_jobs_saving_the_same_step(store: StoreTarget) -> None:
    url = store.url("step")
    states = [{"w": torch.full((1000,), float(n))} for n in range(2)]
    barrier = threading.Barrier(2)

    def job(n: int) -> BaseException | None:
        barrier.wait()
        try:
            save(states[n], url, store)
        except BaseException as exc:
            return carried(exc)
        return None

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(job, range(2)))
    winners = [n for n, o in enumerate(outcomes) if o is None]
    assert len(winners) == 1, outcomes
    loser = outcomes[1 - winners[0]]
    assert isinstance(loser, CheckpointExistsError)
    got = {"w": torch.zeros(1000)}
    load(got, url, store)
    assert torch.equal(got["w"], states[winners[0]]["w"])


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_overwriting_deletes_what_only_the_replaced_manifest_named(
    kind: str, tmp_path, request: pytest.FixtureRequest
) -> None:
    """Twelve saves to one URL (as torch's own resharding test does) leave exactly one
    checkpoint's objects, and each save stays loadable until the next commits."""
    target = (
        StoreTarget(root=f"file://{tmp_path}", storage_options={})
        if kind == "file"
        else request.getfixturevalue("s3_bucket")
    )
    url = target.url("again")
    for n in range(12):
        writer = save({"w": torch.full((1000,), float(n))}, url, target, overwrite=True)
    manifest = writer.last_manifest
    assert manifest is not None
    fs = fs_of(target)
    path = path_of(target, url)
    left = sorted(p.rsplit("/", 1)[-1] for p in fs.find(path))
    assert left == sorted([MANIFEST_KEY, *(o.key for o in manifest.objects)])
    got = {"w": torch.zeros(1000)}
    load(got, url, target)
    assert torch.equal(got["w"], torch.full((1000,), 11.0))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_overwrite_commit_leaves_only_the_new_checkpoint(tmp_path, strategy: str) -> None:
    """Whichever strategy commits, an overwrite deletes what only the replaced manifest
    named once the new ``.metadata`` is written, and stock readers see the new save."""
    import pickle

    s = open_store(Location.parse(f"file://{tmp_path}/c"), UploadOptions())
    os.makedirs(s.location.path, exist_ok=True)
    for attempt, value in (("a" * 16, b"first"), ("b" * 16, b"second!")):
        metadata, results = one_value_save(s, attempt, value)
        manifest = commit_via(
            strategy, s, metadata, results, attempt=attempt, world_size=1, overwrite=True
        )
    left = sorted(os.listdir(s.location.path))
    # (.metadata named or not: the helper builds it after the commit, #46)
    assert left == sorted({MANIFEST_KEY, ".metadata", *(o.key for o in manifest.objects)})
    stock = pickle.loads(s.read(".metadata"))
    assert stock.storage_meta.save_id == "b" * 16
    assert {info.relative_path for info in stock.storage_data.values()} == {
        f"__0_0.{'b' * 16}.distcp"
    }
