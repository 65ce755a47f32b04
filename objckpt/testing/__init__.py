"""Test helpers shipped to users: real store servers and pytest fixtures.

Installed as a pytest plugin (entry point ``objckpt``), so a project that has
objckpt installed gets the fixtures ``moto_server``, ``s3_bucket``,
``gcs_emulator``, ``gcs_bucket``, ``fake_gcs_server``, ``fake_gcs_bucket``,
``azurite``, ``az_container``, ``rgw_server`` and ``rgw_bucket`` (Ceph RGW, from
:mod:`objckpt.testing.rgw`) without any conftest code. :class:`FaultProxy`
sits in front of the moto server to record S3 operations and inject faults.
"""

from objckpt.testing.azurite import Azurite, AzuriteUnavailable, start_azurite
from objckpt.testing.proxy import FaultProxy, Rule, s3_operation
from objckpt.testing.servers import (
    FakeGcsServer,
    GcsEmulator,
    MotoServer,
    free_port,
    offline_env,
    start_fake_gcs_server,
    start_gcs_emulator,
    start_moto_server,
)

__all__ = [
    "Azurite",
    "AzuriteUnavailable",
    "FakeGcsServer",
    "FaultProxy",
    "GcsEmulator",
    "MotoServer",
    "Rule",
    "free_port",
    "offline_env",
    "s3_operation",
    "start_azurite",
    "start_fake_gcs_server",
    "start_gcs_emulator",
    "start_moto_server",
]
