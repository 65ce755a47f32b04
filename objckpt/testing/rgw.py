"""Ceph RADOS Gateway (RGW) on loopback: an S3 server that is not a mock.

Why a second S3 server beside moto: moto is a Python mock and more lenient than S3
(a ranged GET of an empty object answers an empty body where S3 answers 416, a
wrong ``Content-MD5`` is accepted), so a guarantee proven only on moto may rest on
its leniency. RGW is an independent implementation that clusters run in
production, with its own differences (it ignores ``If-None-Match`` on
CompleteMultipartUpload, keeps no ``x-amz-checksum-*``); objckpt's suites run on
both.

What runs: one monitor, one OSD and one radosgw (beast frontend), started without
systemd from a ``ceph.conf`` in a directory of your choice, every address on
127.0.0.1. cephx is off (``auth_* = none``), with ``ms_mon_client_mode = crc``
(radosgw's default secure mode cannot work without cephx: it retries
``get_initial_auth_request returned -13`` forever). Pools have one replica. The
OSD is bluestore on a sparse 10 GiB file kept outside its data folder (mkfs
refuses a block file inside it, "Too many levels of symbolic links"); memstore
would be faster to make but cannot restart (it comes back with no placement
groups). ceph-mgr is not needed. Monitor proposals are made every 50 ms instead
of every second (each pool RGW makes costs two), so from nothing to a usable
bucket takes about 10 s; a restart of an existing directory about 7 s. The
directory must not be on tmpfs (bluestore opens its block file with
``O_DIRECT``). radosgw serves plain HTTP and, where ``cryptography`` is installed,
TLS with a self-signed certificate (``<dir>/ca.pem``): over https botocore's
default request shape (aws-chunked bodies with trailing checksums) is refused by
RGW 16.2, and objckpt must not send it. ``rgw_dns_name = localhost``: a request
for ``<bucket>.localhost`` is virtual-hosted (reached through a forward proxy, as
nothing here resolves that name).

Each daemon runs in the foreground of a process of its own session, and its pid
is written to ``<dir>/run/<daemon>.pid`` by this module, so :func:`stop_rgw` ends
exactly what :func:`start_rgw` started (a pid whose command line does not name
this directory's ``ceph.conf`` is left alone).

From a shell (the Makefile's ``rgw`` target runs ``install``)::

    python -m objckpt.testing.rgw install     # apt-get the packages when absent (root)
    python -m objckpt.testing.rgw start DIR   # create, or restart, the cluster in DIR
    python -m objckpt.testing.rgw stop DIR    # stop what start started

``start`` prints ``OBJCKPT_RGW_ENDPOINT=http://127.0.0.1:<port>``; with that
variable set, the ``rgw_server`` fixture uses the running server instead of
starting its own.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from objckpt.testing.servers import TEST_KEY, TEST_SECRET, free_port, s3_test_options
from objckpt.testing.tls import make_certificate

__all__ = [
    "RgwServer",
    "RgwUnavailable",
    "install_packages",
    "missing_binaries",
    "start_rgw",
    "stop_rgw",
]

logger = logging.getLogger(__name__)

#: The Debian packages that hold the binaries below.
PACKAGES = ("ceph-mon", "ceph-osd", "radosgw", "ceph-common")
#: Everything :func:`start_rgw` runs.
BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph")
#: The daemons, in start order (stopped in reverse).
DAEMONS = ("mon.a", "osd.0", "client.rgw")

_UID = "objckpt"
_STATE = "rgw.json"  # what start_rgw chose: ports, keys; written once the cluster is made
_WARMUP_BUCKET = "objckpt-warmup"


class RgwUnavailable(RuntimeError):
    """The Ceph binaries are absent and could not be installed here."""


@dataclasses.dataclass(frozen=True)
class RgwServer:
    """An RGW endpoint and a user that may do everything on it.

    Attributes:
        endpoint_url: ``http://127.0.0.1:<port>``.
        key, secret: The user's S3 credentials.
        https_endpoint_url: ``https://127.0.0.1:<port>`` (None: no TLS endpoint),
            whose self-signed certificate is ``ca_file``.
        ca_file: The certificate to verify ``https_endpoint_url`` with.
        directory: The cluster's directory (None: a server given by the environment).
        started: The daemons :func:`start_rgw` started (those already running when
            it was called are not, and :meth:`stop` leaves them running).
    """

    endpoint_url: str
    key: str = TEST_KEY
    secret: str = TEST_SECRET
    https_endpoint_url: str | None = None
    ca_file: Path | None = None
    directory: Path | None = None
    started: tuple[str, ...] = ()
    # The started daemons' processes, waited for by stop() (children of this process).
    _processes: tuple[subprocess.Popen[bytes], ...] = dataclasses.field(
        default=(), repr=False, compare=False
    )

    def storage_options(self, *, https: bool = False) -> dict[str, Any]:
        """s3fs options that reach this server as its user (over TLS with ``https``).

        Raises:
            ValueError: ``https`` asked of a server without a TLS endpoint.
        """
        if not https:
            return s3_test_options(self.endpoint_url, self.key, self.secret)
        if self.https_endpoint_url is None or self.ca_file is None:
            raise ValueError(f"RGW at {self.endpoint_url} has no https endpoint")
        options = s3_test_options(self.https_endpoint_url, self.key, self.secret)
        options["client_kwargs"]["verify"] = str(self.ca_file)
        return options

    def boto3_client(self, **config: Any) -> Any:
        """A boto3 S3 client for test setup and inspection (``config``: botocore
        ``Config`` arguments)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
            region_name="us-east-1",
            config=Config(**config),
        )

    def create_bucket(self, name: str) -> None:
        self.boto3_client().create_bucket(Bucket=name)

    def delete_bucket(self, name: str) -> None:
        """Abort the bucket's open uploads, delete its objects, then the bucket."""
        client = self.boto3_client()
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=name):
            for upload in page.get("Uploads", []):
                client.abort_multipart_upload(
                    Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"]
                )
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket=name, Key=obj["Key"])
        client.delete_bucket(Bucket=name)

    def stop(self) -> None:
        """Stop the daemons :func:`start_rgw` started, and only those."""
        if self.directory is not None and self.started:
            stop_rgw(self.directory, self.started)
        for proc in self._processes:
            proc.wait(timeout=60)  # ended by stop_rgw: reaps it


def missing_binaries() -> list[str]:
    """The Ceph binaries :func:`start_rgw` needs that are not on ``PATH``."""
    return [b for b in BINARIES if shutil.which(b) is None]


def install_packages(timeout: float = 900) -> None:
    """Install :data:`PACKAGES` with apt-get when a binary is missing (root only).

    ``apt-get update`` runs only when the install fails as is (a fresh container
    often has no package lists).

    Raises:
        RgwUnavailable: Binaries are missing and this is not root, or there is no
            apt-get, or the install did not provide them.
    """
    missing = missing_binaries()
    if not missing:
        logger.info("Ceph RGW binaries already installed")
        return
    if os.geteuid() != 0:
        raise RgwUnavailable(
            f"Ceph RGW binaries missing ({', '.join(missing)}); installing needs root: "
            f"apt-get install --no-install-recommends {' '.join(PACKAGES)}"
        )
    if shutil.which("apt-get") is None:
        raise RgwUnavailable(
            f"Ceph RGW binaries missing ({', '.join(missing)}) and no apt-get here: "
            f"install {', '.join(PACKAGES)} with this system's package manager"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    started = time.monotonic()
    if subprocess.run(install, env=env, timeout=timeout).returncode != 0:
        logger.info("apt-get install failed; updating the package lists and retrying")
        subprocess.run(["apt-get", "update", "-q"], env=env, timeout=timeout, check=True)
        subprocess.run(install, env=env, timeout=timeout, check=True)
    missing = missing_binaries()
    if missing:
        raise RgwUnavailable(f"installed {', '.join(PACKAGES)} but still missing {missing}")
    logger.info("installed %s in %.0f s", " ".join(PACKAGES), time.monotonic() - started)


def _conf(directory: Path, state: dict[str, Any]) -> str:
    d = directory
    frontend = f"beast endpoint=127.0.0.1:{state['rgw_port']}"
    if state["https_port"] is not None:
        frontend += f" ssl_endpoint=127.0.0.1:{state['https_port']} ssl_certificate={d}/rgw.pem"
    return f"""\
# Written by objckpt.testing.rgw: a one-node test cluster on loopback.
[global]
fsid = {state["fsid"]}
mon_host = [v2:127.0.0.1:{state["mon_port"]}]
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
ms_mon_client_mode = crc
osd_pool_default_size = 1
osd_pool_default_min_size = 1
mon_allow_pool_size_one = true
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
mon_warn_on_pool_no_redundancy = false
mon_warn_on_insecure_global_id_reclaim_allowed = false
# A nearly full test machine must not stop the monitor (its default: below 5 % free).
mon_data_avail_crit = 0
mon_data_avail_warn = 1
# Each pool RGW makes costs two osdmap epochs, proposed once a second by default.
paxos_propose_interval = 0.05
paxos_min_wait = 0.01
run_dir = {d}/run
log_file = {d}/log/$name.log
admin_socket = {d}/run/$name.asok
mon_data = {d}/mon/$id
osd_data = {d}/osd/$id
osd_objectstore = bluestore
bluestore_block_path = {d}/osd-$id.block
bluestore_block_size = {10 << 30}
bluestore_block_create = true
osd_memory_target = {1 << 30}

[client.rgw]
rgw_frontends = {frontend}
rgw_dynamic_resharding = false
# Virtual-hosted requests: Host <bucket>.localhost names the bucket.
rgw_dns_name = localhost
"""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class _Cluster:
    """The files of one cluster directory and the commands run against it."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.conf = directory / "ceph.conf"

    def run(self, *argv: str, timeout: float = 120) -> str:
        proc = subprocess.run(
            [argv[0], "--conf", str(self.conf), *argv[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}"
            )
        return proc.stdout

    def pid_file(self, daemon: str) -> Path:
        return self.dir / "run" / f"{daemon}.pid"

    def _pid(self, daemon: str) -> int | None:
        try:
            return int(self.pid_file(daemon).read_text())
        except (OSError, ValueError):
            return None

    def ours(self, pid: int) -> bool:
        """Whether ``pid`` runs with this directory's ``ceph.conf`` on its command line."""
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        return str(self.conf).encode() in cmdline.split(b"\0")

    def running(self, daemon: str) -> int | None:
        """The pid of ``daemon`` when this module started it and it still runs."""
        pid = self._pid(daemon)
        return pid if pid is not None and self.ours(pid) else None

    def start(self, daemon: str) -> subprocess.Popen[bytes] | None:
        """Start ``daemon`` in the foreground of a new session (None: it already runs)."""
        if self.running(daemon) is not None:
            return None
        kind, _, ident = daemon.partition(".")
        binary = {"mon": "ceph-mon", "osd": "ceph-osd", "client": "radosgw"}[kind]
        name = ["-n", daemon] if kind == "client" else ["-i", ident]
        with open(self.dir / "log" / f"{daemon}.out", "ab") as out:
            proc = subprocess.Popen(
                [binary, "--conf", str(self.conf), *name, "-f"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid_file(daemon).write_text(f"{proc.pid}\n")
        logger.info("started %s (pid %d) in %s", daemon, proc.pid, self.dir)
        return proc

    def stop(self, daemon: str, timeout: float = 30) -> None:
        pid = self._pid(daemon)
        if pid is not None:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                fd = None  # gone already
            if fd is not None:
                try:
                    # Checked while the pidfd holds the process, so the pid cannot
                    # have been reused between the check and the signal.
                    if self.ours(pid):
                        _terminate(fd, pid, timeout)
                        logger.info("stopped %s (pid %d) in %s", daemon, pid, self.dir)
                finally:
                    os.close(fd)
        self.pid_file(daemon).unlink(missing_ok=True)


def _terminate(fd: int, pid: int, timeout: float) -> None:
    """SIGTERM the process of pidfd ``fd``, wait for its exit (no polling), and
    SIGKILL it after ``timeout`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(fd, signal.SIGTERM)
    if not select.select([fd], [], [], timeout)[0]:
        logger.warning("pid %d did not exit %.0f s after SIGTERM; killing it", pid, timeout)
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        select.select([fd], [], [], timeout)


def _create(cluster: _Cluster) -> dict[str, Any]:
    """Write ``ceph.conf`` and make the monitor's store; the OSD is made once the
    monitor runs (``ceph osd new`` asks it for an id)."""
    for sub in ("run", "log", "mon", "osd"):
        (cluster.dir / sub).mkdir(parents=True, exist_ok=True)
    fsid = str(uuid.uuid4())
    tls = _write_certificate(cluster.dir / "rgw.pem", cluster.dir / "ca.pem")
    state = {
        "mon_port": free_port(),
        "rgw_port": free_port(),
        "https_port": free_port() if tls else None,
        "key": TEST_KEY,
        "secret": TEST_SECRET,
        "fsid": fsid,
    }
    cluster.conf.write_text(_conf(cluster.dir, state))
    monmap = cluster.dir / "monmap"
    cluster.run(
        "monmaptool", "--create", "--fsid", fsid,
        "--addv", "a", f"[v2:127.0.0.1:{state['mon_port']}]", str(monmap),
    )  # fmt: skip
    cluster.run("ceph-mon", "--mkfs", "-i", "a", "--monmap", str(monmap))
    return state


def _write_certificate(pem: Path, ca: Path) -> bool:
    """A self-signed certificate for 127.0.0.1: with its key in ``pem`` (what beast
    reads), alone in ``ca`` (what clients verify with). False: no ``cryptography``
    here (moto depends on it), so RGW serves plain HTTP only."""
    try:
        make_certificate(pem, ca, name="objckpt test RGW")
    except ImportError:
        logger.info("cryptography is not installed: RGW gets no https endpoint")
        return False
    return True


def _make_osd(cluster: _Cluster) -> None:
    osd_uuid = str(uuid.uuid4())
    osd_id = cluster.run("ceph", "--connect-timeout", "60", "osd", "new", osd_uuid).strip()
    if osd_id != "0":
        raise RuntimeError(f"expected OSD id 0 from a new cluster, got {osd_id!r}")
    (cluster.dir / "osd" / "0").mkdir(exist_ok=True)
    cluster.run("ceph-osd", "-i", "0", "--mkfs", "--osd-uuid", osd_uuid)


def _wait_s3(
    cluster: _Cluster, server: RgwServer, procs: dict[str, subprocess.Popen[bytes]], until: float
) -> None:
    """Wait until RGW answers a signed request, failing early if a daemon exits."""
    import botocore.exceptions

    client = server.boto3_client(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10)
    while True:
        for daemon, proc in procs.items():
            if proc.poll() is not None:
                log = cluster.dir / "log" / f"{daemon}.log"
                raise RuntimeError(
                    f"{daemon} exited with {proc.returncode} while starting; {log}:\n"
                    f"{_tail(log)}\n{_tail(cluster.dir / 'log' / f'{daemon}.out')}"
                )
        try:
            client.list_buckets()
            return
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
            if time.monotonic() > until:
                raise
        time.sleep(0.2)


def _warm_up(server: RgwServer) -> None:
    """Create the data pools now: the first PUT into a bucket and the first multipart
    upload each make a pool (~3 s), which a test would otherwise pay for."""
    client = server.boto3_client()
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=_WARMUP_BUCKET)
    client.put_object(Bucket=_WARMUP_BUCKET, Key="small", Body=b"x")
    upload = client.create_multipart_upload(Bucket=_WARMUP_BUCKET, Key="multi")
    part = client.upload_part(
        Bucket=_WARMUP_BUCKET, Key="multi", UploadId=upload["UploadId"], PartNumber=1, Body=b"y"
    )
    client.complete_multipart_upload(
        Bucket=_WARMUP_BUCKET,
        Key="multi",
        UploadId=upload["UploadId"],
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]},
    )
    server.delete_bucket(_WARMUP_BUCKET)


def start_rgw(directory: str | os.PathLike[str], timeout: float = 180) -> RgwServer:
    """Create a cluster in ``directory`` (or restart the one there) and wait until
    its S3 endpoint answers the user's signed requests.

    Daemons of this directory that already run are left as they are, so starting
    twice is harmless.

    Raises:
        RgwUnavailable: The Ceph binaries are not installed (:func:`install_packages`).
        RuntimeError: A daemon exited or a setup command failed (its log is quoted).
        TimeoutError: RGW did not answer within ``timeout`` seconds.
    """
    missing = missing_binaries()
    if missing:
        raise RgwUnavailable(
            f"Ceph RGW binaries not installed ({', '.join(missing)}): run "
            f"`python -m objckpt.testing.rgw install` as root, or apt-get install "
            f"--no-install-recommends {' '.join(PACKAGES)}"
        )
    cluster = _Cluster(Path(directory).resolve())
    until = time.monotonic() + timeout
    started = time.monotonic()
    state_file = cluster.dir / _STATE
    fresh = not state_file.exists()
    if fresh and cluster.conf.exists():
        raise RuntimeError(
            f"{cluster.dir} holds a cluster whose creation did not finish; remove the "
            "directory and start again"
        )
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        state = _create(cluster) if fresh else json.loads(state_file.read_text())
        if not fresh:  # what this module's version of the configuration says
            cluster.conf.write_text(_conf(cluster.dir, state))
        https = state["https_port"]
        server = RgwServer(
            endpoint_url=f"http://127.0.0.1:{state['rgw_port']}",
            key=state["key"],
            secret=state["secret"],
            https_endpoint_url=None if https is None else f"https://127.0.0.1:{https}",
            ca_file=None if https is None else cluster.dir / "ca.pem",
            directory=cluster.dir,
        )
        for daemon in DAEMONS:
            if fresh and daemon == "osd.0":
                _make_osd(cluster)
            proc = cluster.start(daemon)
            if proc is not None:
                procs[daemon] = proc
        if fresh:
            cluster.run(
                "radosgw-admin", "user", "create", "--uid", _UID, "--display-name", _UID,
                "--access-key", server.key, "--secret-key", server.secret,
            )  # fmt: skip
        _wait_s3(cluster, server, procs, until)
        _warm_up(server)
        if fresh:
            state_file.write_text(json.dumps(state, indent=1) + "\n")
        server = dataclasses.replace(server, started=tuple(procs), _processes=tuple(procs.values()))
    except BaseException:
        for daemon in reversed(list(procs)):
            cluster.stop(daemon)
            procs[daemon].wait(timeout=60)
        raise
    logger.info(
        "RGW at %s (%s in %.1f s; cluster in %s)",
        server.endpoint_url,
        "created" if fresh else "started",
        time.monotonic() - started,
        cluster.dir,
    )
    return server


def stop_rgw(directory: str | os.PathLike[str], daemons: Sequence[str] = DAEMONS) -> None:
    """Stop ``daemons`` (by default all) that :func:`start_rgw` started in
    ``directory``, found by their pid files, radosgw first; the cluster's data stays
    for a later restart."""
    cluster = _Cluster(Path(directory).resolve())
    for daemon in reversed(DAEMONS):
        if daemon in daemons:
            cluster.stop(daemon)


def server_from_env() -> RgwServer | None:
    """The RGW server named by ``OBJCKPT_RGW_ENDPOINT`` (credentials from
    ``OBJCKPT_RGW_KEY``/``OBJCKPT_RGW_SECRET``, else the test ones; a TLS endpoint
    from ``OBJCKPT_RGW_HTTPS_ENDPOINT`` and ``OBJCKPT_RGW_CA``), if any."""
    endpoint = os.environ.get("OBJCKPT_RGW_ENDPOINT")
    if not endpoint:
        return None
    https = os.environ.get("OBJCKPT_RGW_HTTPS_ENDPOINT")
    ca = os.environ.get("OBJCKPT_RGW_CA")
    return RgwServer(
        endpoint_url=endpoint.rstrip("/"),
        key=os.environ.get("OBJCKPT_RGW_KEY", TEST_KEY),
        secret=os.environ.get("OBJCKPT_RGW_SECRET", TEST_SECRET),
        https_endpoint_url=https.rstrip("/") if https else None,
        ca_file=Path(ca) if ca else None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m objckpt.testing.rgw", description="A one-node Ceph RGW on loopback."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("install", help="apt-get the Ceph packages when absent (root only)")
    for name, text in (("start", "create or restart the cluster"), ("stop", "stop it")):
        sub.add_parser(name, help=text).add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "install":
            install_packages()
        elif args.command == "start":
            server = start_rgw(args.directory)
            print(f"OBJCKPT_RGW_ENDPOINT={server.endpoint_url}")
            if server.https_endpoint_url is not None:
                print(f"OBJCKPT_RGW_HTTPS_ENDPOINT={server.https_endpoint_url}")
                print(f"OBJCKPT_RGW_CA={server.ca_file}")
        else:
            stop_rgw(args.directory)
    except RgwUnavailable as exc:
        logger.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
