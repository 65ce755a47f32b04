"""The pytest plugin objckpt ships: it must not change projects that only install it."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]


def test_the_plugin_leaves_the_environment_alone_outside_its_fixtures(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED", raising=False)
    monkeypatch.delenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", raising=False)
    pytester.makepyfile(
        """
        import os

        def test_untouched():
            assert "AWS_EC2_METADATA_DISABLED" not in os.environ
            assert "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT" not in os.environ

        def test_set_while_objckpt_s3_fixture_is_used(moto_server):
            assert os.environ["AWS_EC2_METADATA_DISABLED"] == "true"
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")  # objckpt: entry point
    result.assert_outcomes(passed=2)
