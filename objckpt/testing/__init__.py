"""Test helpers shipped to users: real store servers and pytest fixtures.

Installed as a pytest plugin (entry point ``objckpt``), so a project that has
objckpt installed gets the fixtures ``moto_server``, ``s3_bucket``,
``gcs_emulator`` and ``gcs_bucket`` without any conftest code.
"""

from objckpt.testing.servers import (
    GcsEmulator,
    MotoServer,
    free_port,
    offline_env,
    start_gcs_emulator,
    start_moto_server,
)

__all__ = [
    "GcsEmulator",
    "MotoServer",
    "free_port",
    "offline_env",
    "start_gcs_emulator",
    "start_moto_server",
]
