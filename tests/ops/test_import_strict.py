"""``objckpt import`` reads safetensors as untrusted input, as strictly as a load.

A safetensors source (an index and its shards, or one file) is whatever its writer
made it: each case below writes what a crafted or broken source holds (a shard
name that leaves the source, byte ranges that overlap or claim far more than the
file holds, negative offsets and shapes, a header that is not JSON or nests too
deep, a tensor in two shards) and imports it. Every case must end in an objckpt
error naming the file (and the tensor, where one is at fault) before anything is
written at the destination; through the CLI, one line and exit code 4. The case
whose header claims 3 GB of 1 MiB of data runs in a child process under
``RLIMIT_AS`` = 4 GiB, and a well-formed import's memory is measured against its
largest tensor, not the model.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import quiet
from safetensors.torch import save as save_safetensors
from safetensors.torch import save_file

from objckpt import Location, ObjectStoreReader
from objckpt.errors import ManifestError, ObjckptError
from objckpt.ops.convert.export import INDEX_NAME, import_safetensors
from objckpt.testing import FaultProxy
from objckpt.testing.plugin import BUCKET, StoreTarget
from objckpt.testing.servers import offline_env

MIB = 1 << 20
SECRET = 7.0  # the value of the tensor outside the source

# A craft writes a source under the directory it is given and returns what the
# error must name: the file at fault and, where one is, the tensor or shard name.
Craft = Callable[[Path], tuple[Path, str | None]]


def _raw(path: Path, header: dict[str, Any] | bytes, data: bytes = b"") -> Path:
    """A safetensors file as a crafter writes it: length, header (padded), data."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def _f32(key: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {key: {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}}


def _index(src: Path, weight_map: dict[str, str] | bytes) -> Path:
    doc = (
        weight_map
        if isinstance(weight_map, bytes)
        else json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}).encode()
    )
    path = src / INDEX_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(doc)
    return path


def _sharded(src: Path, shards: dict[str, dict[str, torch.Tensor]]) -> None:
    """Shards written by the safetensors library, and an index naming each tensor's."""
    src.mkdir(parents=True, exist_ok=True)
    for name, tensors in shards.items():
        (src / name).write_bytes(save_safetensors(tensors))
    _index(src, {k: name for name, tensors in shards.items() for k in tensors})


def _ones(n: int = 4) -> torch.Tensor:
    return torch.ones(n)


# -- the crafted sources -------------------------------------------------------------------
def _dotdot_shard(src: Path) -> tuple[Path, str | None]:
    # Before: the outside file's tensor was imported.
    save_file(
        {"w": torch.full((4,), SECRET)}, str(_mkdir(src.parent / "outside") / "secret.safetensors")
    )
    return _index(src, {"w": "../outside/secret.safetensors"}), "../outside/secret.safetensors"


def _absolute_shard(src: Path) -> tuple[Path, str | None]:
    outside = _mkdir(src.parent / "outside") / "secret.safetensors"
    save_file({"w": torch.full((4,), SECRET)}, str(outside))
    return _index(src, {"w": str(outside)}), str(outside)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _duplicate_ranges(count: int) -> Craft:
    """``count`` tensors of 1 MiB each, every one claiming the same 1 MiB of data."""

    def craft(src: Path) -> tuple[Path, str | None]:
        header: dict[str, Any] = {}
        for n in range(count):
            header.update(_f32(f"t{n:05d}", [MIB // 4], 0, MIB))
        return _raw(src / "model.safetensors", header, bytes(MIB)), "t00001"

    craft.__name__ = f"_duplicate_ranges_{count}"
    return craft


def _overlapping_ranges(src: Path) -> tuple[Path, str | None]:
    header = {**_f32("a", [4], 0, 16), **_f32("b", [4], 8, 24)}
    return _raw(src / "model.safetensors", header, bytes(24)), "'b'"


def _negative_offset(src: Path) -> tuple[Path, str | None]:
    # Before: read the header's own last bytes as the tensor.
    header = {**_f32("neg", [1], -4, 0), **_f32("a", [1], 0, 4)}
    return _raw(src / "model.safetensors", header, bytes(4)), "'neg'"


def _negative_shape(src: Path) -> tuple[Path, str | None]:
    # Before: reshape([-1, 4]) inferred the dimension and the tensor imported.
    return _raw(src / "model.safetensors", _f32("neg", [-1, 4], 0, 16), bytes(16)), "'neg'"


def _offsets_beyond_file(src: Path) -> tuple[Path, str | None]:
    return _raw(src / "model.safetensors", _f32("far", [1024], 0, 4096), bytes(16)), "'far'"


def _length_not_dtype_times_shape(src: Path) -> tuple[Path, str | None]:
    return _raw(src / "model.safetensors", _f32("odd", [3], 0, 16), bytes(16)), "'odd'"


def _unknown_dtype(src: Path) -> tuple[Path, str | None]:
    _sharded(src, {"model-1.safetensors": {"a": _ones()}})
    header = {"q": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 2]}}
    shard = _raw(src / "model-2.safetensors", header, bytes(2))
    _index(src, {"a": "model-1.safetensors", "q": "model-2.safetensors"})
    return shard, "'q'"


def _header_length_beyond_file(src: Path) -> tuple[Path, str | None]:
    path = src / "model.safetensors"
    _mkdir(src)
    path.write_bytes(struct.pack("<Q", 10_000) + b'{"a": {}}')
    return path, "10000"


def _header_length_over_the_cap(src: Path) -> tuple[Path, str | None]:
    path = src / "model.safetensors"
    _mkdir(src)
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}      ")
    return path, str(1 << 40)


def _file_shorter_than_its_length(src: Path) -> tuple[Path, str | None]:
    path = src / "model.safetensors"
    _mkdir(src)
    path.write_bytes(b"\x01\x02\x03")
    return path, None


def _deeply_nested_header(src: Path) -> tuple[Path, str | None]:
    deep = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return _raw(src / "model.safetensors", deep), None


def _non_json_header(src: Path) -> tuple[Path, str | None]:
    return _raw(src / "model.safetensors", b"{not json at all}"), None


def _gap_between_tensors(src: Path) -> tuple[Path, str | None]:
    # Before: imported; bytes 4-8 belonged to no tensor (a polyglot's hiding place).
    header = {**_f32("a", [1], 0, 4), **_f32("b", [1], 8, 12)}
    return _raw(src / "model.safetensors", header, bytes(12)), "'b'"


def _bytes_after_the_last_tensor(src: Path) -> tuple[Path, str | None]:
    return _raw(src / "model.safetensors", _f32("a", [1], 0, 4), bytes(8)), "4"


def _metadata_not_a_string_map(src: Path) -> tuple[Path, str | None]:
    header = {"__metadata__": {"format": 1}, **_f32("a", [1], 0, 4)}
    return _raw(src / "model.safetensors", header, bytes(4)), "__metadata__"


def _tensor_in_two_shards(src: Path) -> tuple[Path, str | None]:
    # Before: the second shard's "x" silently replaced the first's.
    _sharded(
        src,
        {
            "model-1.safetensors": {"w": _ones(), "x": _ones()},
            "model-2.safetensors": {"y": _ones()},
        },
    )
    (src / "model-2.safetensors").write_bytes(
        save_safetensors({"x": torch.full((4,), SECRET), "y": _ones()})
    )
    return src / "model-2.safetensors", "'x'"


def _weight_map_naming_a_missing_shard(src: Path) -> tuple[Path, str | None]:
    _sharded(src, {"model-1.safetensors": {"w": _ones()}})
    index = _index(src, {"w": "model-1.safetensors", "v": "model-2.safetensors"})
    return index, "model-2.safetensors"


def _weight_map_naming_a_tensor_its_shard_lacks(src: Path) -> tuple[Path, str | None]:
    _sharded(src, {"model-1.safetensors": {"w": _ones()}})
    _index(src, {"w": "model-1.safetensors", "ghost": "model-1.safetensors"})
    return src / INDEX_NAME, "'ghost'"


def _index_not_json(src: Path) -> tuple[Path, str | None]:
    _sharded(src, {"model-1.safetensors": {"w": _ones()}})
    return _index(src, b"{weight_map: nope"), None


def _index_weight_map_not_a_map(src: Path) -> tuple[Path, str | None]:
    _sharded(src, {"model-1.safetensors": {"w": _ones()}})
    return _index(src, json.dumps({"weight_map": ["model-1.safetensors"]}).encode()), "weight_map"


CRAFTED: list[Craft] = [
    _dotdot_shard,
    _absolute_shard,
    _duplicate_ranges(30),
    _overlapping_ranges,
    _negative_offset,
    _negative_shape,
    _offsets_beyond_file,
    _length_not_dtype_times_shape,
    _unknown_dtype,
    _header_length_beyond_file,
    _header_length_over_the_cap,
    _file_shorter_than_its_length,
    _deeply_nested_header,
    _non_json_header,
    _gap_between_tensors,
    _bytes_after_the_last_tensor,
    _metadata_not_a_string_map,
    _tensor_in_two_shards,
    _weight_map_naming_a_missing_shard,
    _weight_map_naming_a_tensor_its_shard_lacks,
    _index_not_json,
    _index_weight_map_not_a_map,
]


def _name(craft: Craft) -> str:
    return craft.__name__.strip("_")


def _nothing_at(dest: Path) -> None:
    written = sorted(str(p.relative_to(dest)) for p in dest.rglob("*")) if dest.exists() else []
    assert written == [], f"the failed import wrote {written}"


@pytest.mark.parametrize("craft", CRAFTED, ids=_name)
def test_a_crafted_source_is_refused_naming_the_file(tmp_path: Path, craft: Craft) -> None:
    src, dest = tmp_path / "src", tmp_path / "dest"
    culprit, detail = craft(src)
    with pytest.raises(ObjckptError) as info, quiet():
        import_safetensors(f"file://{src}", f"file://{dest}")
    err = info.value
    # Malformed stored metadata, the same family a crafted manifest gets.
    assert isinstance(err, ManifestError), repr(err)
    assert str(culprit) in str(err), str(err)
    if detail is not None:
        assert detail in str(err), str(err)
    _nothing_at(dest)


CLI_CASES: list[Craft] = [
    _dotdot_shard,
    _negative_shape,
    _deeply_nested_header,
    _gap_between_tensors,
    _weight_map_naming_a_missing_shard,
    _index_not_json,
]


@pytest.mark.parametrize("craft", CLI_CASES, ids=_name)
def test_cli_import_of_a_crafted_source_is_one_line_and_exit_code_4(
    tmp_path: Path, craft: Craft
) -> None:
    src, dest = tmp_path / "src", tmp_path / "dest"
    culprit, _ = craft(src)
    out = subprocess.run(
        [sys.executable, "-m", "objckpt.cli", "import", f"file://{src}", f"file://{dest}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 4, (out.returncode, out.stderr[-3000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
    assert str(culprit) in lines[0], lines[0]
    assert out.stdout == ""
    _nothing_at(dest)


# -- bounded memory ------------------------------------------------------------------------
# The import, in a process of its own: 4 GiB of address space (torch alone maps
# ~0.7), one JSON line out: the error, and the peak RSS growth the import caused.
_CHILD = textwrap.dedent(
    """
    import json, resource, sys, warnings
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    import torch
    from objckpt.errors import ManifestError
    from objckpt.ops.convert.export import import_safetensors
    warnings.filterwarnings("ignore")
    spec = json.loads(sys.argv[1])
    import_safetensors(spec["warm_src"], spec["warm_dest"])  # code paths paged in
    def peak():  # this process's own high-water mark (ru_maxrss survives exec)
        status = open("/proc/self/status").read()
        return int(status.split("VmHWM:")[1].split()[0]) * 1024
    before = peak()
    try:
        count = import_safetensors(spec["src"], spec["dest"])
    except BaseException as exc:
        kind = type(exc)
        refused = isinstance(exc, ManifestError)
        name = kind.__module__ + "." + kind.__name__
        print(json.dumps({"error": name, "message": str(exc), "manifest_error": refused}))
        sys.exit(0)
    print(json.dumps({"tensors": count, "growth": peak() - before}))
    """
)


def _import_in_child(tmp_path: Path, src: Path, dest: Path) -> dict[str, Any]:
    warm = tmp_path / "warm"
    _sharded(warm, {"model-1.safetensors": {"w": _ones()}})
    spec = {
        "warm_src": f"file://{warm}",
        "warm_dest": f"file://{tmp_path}/warm-dest",
        "src": f"file://{src}",
        "dest": f"file://{dest}",
    }
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **offline_env()},
        check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_a_header_claiming_3_gb_of_1_mib_fails_cleanly_under_a_4_gib_limit(
    tmp_path: Path,
) -> None:
    """3,000 tensors of 1 MiB over the same 1 MiB of data: before, 3.3 GB of RSS and
    a 3.0 GB checkpoint (here: a MemoryError); now refused before any tensor is read."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    culprit, detail = _duplicate_ranges(3000)(src)
    got = _import_in_child(tmp_path, src, dest)
    assert got.get("manifest_error") is True, got
    assert str(culprit) in got["message"] and detail in got["message"], got
    _nothing_at(dest)


def test_import_memory_is_bounded_by_the_largest_tensor_not_the_model(tmp_path: Path) -> None:
    """Twelve 32 MiB tensors (384 MiB): the import's peak RSS grows by far less than
    the model (before: every tensor was held at once for one ``dcp.save``)."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    tensors = {f"layer.{n:02d}": torch.full((8 * MIB,), float(n)) for n in range(12)}
    _mkdir(src)
    save_file(tensors, str(src / "model.safetensors"))
    del tensors
    got = _import_in_child(tmp_path, src, dest)
    assert got.get("tensors") == 12, got
    model = 12 * 32 * MIB
    assert got["growth"] < model // 2, f"peak RSS grew {got['growth']} for a {model}-byte model"
    state = {f"layer.{n:02d}": torch.zeros(8 * MIB) for n in range(12)}
    with quiet():
        dcp.load(state, storage_reader=ObjectStoreReader(f"file://{dest}"))
    for n in range(12):
        assert bool((state[f"layer.{n:02d}"] == n).all()), n


# -- what real writers produce imports ---------------------------------------------------
def test_files_the_safetensors_library_writes_import_bit_exact(tmp_path: Path) -> None:
    """``save_file`` pads its header with spaces to 8 bytes, orders data by dtype
    alignment (not by name) and writes empty tensors as zero-length ranges: all
    valid, all imported."""
    g = torch.Generator().manual_seed(3)
    first = {
        "emb": torch.randn(7, 5, generator=g),
        "half": torch.randn(3, generator=g).to(torch.float16),
        "bf": torch.randn(9, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 100, (6,), generator=g),
        "mask": torch.rand(5, generator=g) > 0.5,
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    second = {
        "bytes": torch.arange(11, dtype=torch.uint8),
        "i8": torch.arange(-3, 3).to(torch.int8),
    }
    src = _mkdir(tmp_path / "src")
    save_file(first, str(src / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(second, str(src / "model-00002-of-00002.safetensors"))
    _index(
        src,
        {
            **dict.fromkeys(first, "model-00001-of-00002.safetensors"),
            **dict.fromkeys(second, "model-00002-of-00002.safetensors"),
        },
    )
    header = (src / "model-00001-of-00002.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", header[:8])
    assert length % 8 == 0 and header[8 + length - 1 : 8 + length] == b" "  # padded
    everything = {**first, **second}
    assert import_safetensors(f"file://{src}", f"file://{tmp_path}/dest") == len(everything)
    got = {k: torch.zeros_like(v) for k, v in everything.items()}
    with quiet():
        dcp.load(got, storage_reader=ObjectStoreReader(f"file://{tmp_path}/dest"))
    for k, v in everything.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_shards_linked_from_a_hub_cache_import(tmp_path: Path) -> None:
    """The Hugging Face hub cache keeps ``snapshots/<rev>/<file>`` as links into
    ``blobs/``: a shard name is checked as a name in the source directory, and a
    link the user's own disk holds there is followed."""
    blobs, snap = _mkdir(tmp_path / "blobs"), _mkdir(tmp_path / "snapshots" / "abc")
    save_file({"w": torch.arange(4.0)}, str(blobs / "0123abcd"))
    (snap / "model.safetensors").symlink_to(blobs / "0123abcd")
    assert import_safetensors(f"file://{snap}", f"file://{tmp_path}/dest") == 1
    got = {"w": torch.zeros(4)}
    with quiet():
        dcp.load(got, storage_reader=ObjectStoreReader(f"file://{tmp_path}/dest"))
    assert torch.equal(got["w"], torch.arange(4.0))


def test_a_dotdot_shard_on_s3_sends_no_request_outside_the_source(
    s3_proxy: FaultProxy, s3_bucket: StoreTarget
) -> None:
    """On a bucket, before: ``GET .../src/../outside/secret.safetensors`` (a key any
    store that resolves ``..`` reads outside the source; moto answers NoSuchKey, a
    ``FileNotFoundError`` naming no index). Now refused before any shard request,
    and nothing is requested at the destination."""
    loc = Location.parse(s3_bucket.url("src"), s3_bucket.storage_options)
    fs = loc.open_fs(fresh=True)
    fs.pipe_file(f"{BUCKET}/t/outside/secret.safetensors", save_safetensors({"w": _ones()}))
    index = {"weight_map": {"w": "../outside/secret.safetensors"}}
    fs.pipe_file(f"{loc.path}/{INDEX_NAME}", json.dumps(index).encode())
    s3_proxy.clear()
    with pytest.raises(ObjckptError) as info, quiet():
        import_safetensors(
            s3_bucket.url("src"),
            s3_bucket.url("dest"),
            storage_options=s3_proxy.storage_options(),
        )
    assert isinstance(info.value, ManifestError), repr(info.value)
    assert f"{s3_bucket.url('src')}/{INDEX_NAME}" in str(info.value), str(info.value)
    seen = [(s.operation, s.path) for s in s3_proxy.seen]
    assert not [p for op, p in seen if "outside" in p], seen
    assert not [p for _, p in seen if "/dest" in p], seen
