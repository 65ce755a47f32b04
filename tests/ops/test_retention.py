"""Retention policies: pure decisions over committed steps."""

from __future__ import annotations

import pytest

from objckpt import RetentionPolicy
from objckpt.errors import ConfigurationError
from objckpt.format.steps import StepInfo, parse_step, step_name

NOW = 1_000_000.0


def _steps(*numbers: int, age: float = 0.0, uncommitted: tuple[int, ...] = ()) -> list[StepInfo]:
    return [
        StepInfo(n, f"memory://r/{step_name(n)}", n not in uncommitted, 1, 1, NOW - age)
        for n in numbers
    ]


def test_no_rule_keeps_everything() -> None:
    assert RetentionPolicy().to_delete(_steps(1, 2, 3), NOW) == []


def test_keep_last() -> None:
    assert RetentionPolicy(keep_last=2).to_delete(_steps(1, 2, 3, 4), NOW) == [1, 2]


def test_rules_combine_by_union() -> None:
    policy = RetentionPolicy(keep_last=1, keep_every=2)
    assert policy.to_delete(_steps(1, 2, 3, 4, 5, 6, 7), NOW) == [1, 3, 5]


def test_keep_newer_than_uses_commit_time() -> None:
    old = _steps(1, 2, age=7200)
    new = _steps(3, 4, age=60)
    assert RetentionPolicy(keep_newer_than=3600).to_delete(old + new, NOW) == [1, 2]
    assert RetentionPolicy(keep_newer_than=3600, keep_every=2).to_delete(old + new, NOW) == [1]


def test_uncommitted_steps_are_never_considered_and_the_newest_committed_stays() -> None:
    steps = _steps(1, 2, 3, uncommitted=(3,))
    # step 3 is in flight: it neither counts towards keep_last nor gets deleted
    assert RetentionPolicy(keep_last=1).to_delete(steps, NOW) == [1]
    # every old step outside the window: the newest committed one is still kept
    assert RetentionPolicy(keep_newer_than=1).to_delete(_steps(5, 6, age=100), NOW) == [5]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep_last": 0},
        {"keep_every": -1},
        {"keep_last": 1.5},
        {"keep_newer_than": 0},
        {"keep_last": True},
    ],
)
def test_bad_rules_are_named(kwargs) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ConfigurationError, match=f"option {name}="):
        RetentionPolicy(**kwargs)


def test_step_names_sort_and_parse() -> None:
    assert step_name(42) == "step-0000000042"
    assert parse_step("s3://b/r/step-0000000042/") == 42
    assert parse_step("step-42") is None and parse_step("steps") is None
    names = [step_name(n) for n in (100, 9, 1000)]
    assert sorted(names) == [step_name(9), step_name(100), step_name(1000)]
    with pytest.raises(ConfigurationError, match="step must be an int"):
        step_name(-1)
