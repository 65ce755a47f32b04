"""The model of S3's request-rate partitions (objckpt/testing/throttle.py, #46).

The model's rules on a hand-stepped clock (no sleeps), then one save through the
fault proxy in front of moto with the model on: the store's 503 SlowDown answers are
ridden out, counted as throttled, and the save commits.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from objckpt.testing import FaultProxy
from objckpt.testing.plugin import StoreTarget
from objckpt.testing.servers import MotoServer
from objckpt.testing.throttle import PartitionModel, PrefixRates


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _model(**kw: float) -> tuple[PartitionModel, Clock]:
    clock = Clock()
    rates = PrefixRates(writes=10, reads=20, burst=1.0, split_after=2.0, fanout=4, **kw)
    return PartitionModel(rates, clock), clock


def test_a_partition_serves_its_rate_and_refuses_the_rest() -> None:
    model, clock = _model()
    served = [model.admit(f"run/step-1/__{i}_0", write=True) for i in range(15)]
    assert served == [True] * 10 + [False] * 5  # a second's worth held, then refused
    clock.now = 0.5  # half a second refills half the writes
    assert [model.admit("run/step-1/x", write=True) for _ in range(6)] == [True] * 5 + [False]
    assert all(model.admit(f"run/step-1/__{i}_0", write=False) for i in range(20))  # reads apart


def test_a_partition_that_keeps_refusing_splits_where_its_keys_are() -> None:
    model, clock = _model()
    keys = [f"run/step-1/__{rank}_0" for rank in range(100, 200)]
    for second in range(4):
        clock.now = float(second)
        for key in keys:
            model.admit(key, write=True)
    assert model.splits == 1
    lows = model.partitions
    assert len(lows) == 4 and lows[0] == ""
    assert all(low.startswith("run/step-1/__1") for low in lows[1:]), lows


def test_a_quiet_second_ends_the_streak_before_a_split() -> None:
    model, clock = _model()
    for second in (0.0, 1.5, 3.0, 4.5):  # each burst refused, a quiet second between
        clock.now = second
        for i in range(30):
            model.admit(f"k{i}", write=True)
    assert model.splits == 0 and model.refused > 0


def test_the_next_step_s_keys_meet_one_partition_however_the_last_step_split() -> None:
    """Why a fresh step directory throttles again: its keys sort after every key of the
    step before, so they all fall into the last range; keys under prefixes that
    persist across steps fall into ranges split already."""

    def two_steps(key: str) -> tuple[PartitionModel, int, int]:
        """Step 1's keys for 6 s, then step 2's for 6 s: the model, each step's refusals."""
        model, clock = _model()
        refused = []
        for step in (1, 2):
            before = model.refused
            keys = [key.format(step=step, h=f"{h:x}", r=r) for h in range(16) for r in range(8)]
            for second in range(6 * (step - 1), 6 * step):
                clock.now = float(second)
                for k in keys:
                    model.admit(k, write=True)
            refused.append(model.refused - before)
        return model, refused[0], refused[1]

    per_step, first, again = two_steps("run/step-{step}/{h}/__{r}_0")
    _, spread_first, spread_again = two_steps("run/{h}/step-{step}/__{r}_0")
    assert per_step.splits > 1  # step 1 was split, and step 2 had to be split again:
    assert again >= first * 0.5, (first, again)  # a fresh directory throttled about as much
    assert spread_again < spread_first * 0.5, (spread_first, spread_again)  # but not this


def test_rates_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        PrefixRates(scale=0)
    with pytest.raises(ValueError, match="fanout"):
        PrefixRates(fanout=1)


def test_a_save_through_the_throttling_proxy_rides_out_slowdown_and_commits(
    moto_server: MotoServer, s3_bucket: StoreTarget
) -> None:
    import torch.distributed.checkpoint as dcp

    import objckpt

    # The model's clock moves 0.25 s per request with a key, whatever the machine's
    # load: two writes a second and a bucket of one make a write refused when the
    # request before it was an admitted write, as a save's PUTs of payload, index,
    # manifest and .metadata follow each other (reads are not limited here).
    ticks = itertools.count()
    rates = PrefixRates(writes=2.0, reads=1e6, burst=0.5, split_after=1e6)
    model = PartitionModel(rates, clock=lambda: next(ticks) / 4)
    with FaultProxy(moto_server.endpoint_url, throttle=model) as proxy:
        state = {f"t{i}": torch.full((64,), float(i)) for i in range(8)}
        options = proxy.storage_options()
        url = s3_bucket.url("step-1")
        dcp.save(state, storage_writer=objckpt.ObjectStoreWriter(url, storage_options=options))
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(got, storage_reader=objckpt.ObjectStoreReader(url, storage_options=options))
    assert all(torch.equal(got[k], state[k]) for k in state)
    assert model.refused > 0 and proxy.count("PutObject", faulted=True) > 0
    assert {s.fault for s in proxy.seen if s.fault} == {"throttle"}
