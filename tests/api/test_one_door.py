"""One door to the object store (#45): outside ``objckpt/writers/`` no module
imports fsspec or touches a filesystem object; everything reaches bytes through an
:class:`~objckpt.writers.base.ObjectStore`, and behaviour that differs by store is
told by the store's capability flags, never by its protocol's name."""

from __future__ import annotations

import ast
from pathlib import Path

import objckpt

PACKAGE = Path(objckpt.__file__).parent
#: Attribute names that hand out a filesystem object (``store.fs`` is private to
#: the store layer, as ``_fs``; ``Location.open_fs`` builds one).
FS_ATTRIBUTES = frozenset({"fs", "_fs", "open_fs", "local_fs"})
#: Protocol names a caller might branch on instead of asking the store's flags.
PROTOCOL_NAMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory", "file"})


def _outside_writers() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if (PACKAGE / "writers") not in p.parents)


def _doors(path: Path) -> list[str]:
    """Each way ``path`` reaches past the store layer, as ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {a.name}"
                for a in node.names
                if a.name.split(".")[0] == "fsspec"
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fsspec":
            found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and node.attr in FS_ATTRIBUTES:
            if isinstance(node.ctx, ast.Load):
                found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id == "AbstractFileSystem":
            found.append(f"{node.lineno}: AbstractFileSystem")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            asks = any(isinstance(s, ast.Attribute) and s.attr == "protocol" for s in sides)
            names = {
                v.value
                for s in sides
                for v in ([s] if not isinstance(s, (ast.Tuple, ast.Set, ast.List)) else s.elts)
                if isinstance(v, ast.Constant) and isinstance(v.value, str)
            }
            if asks and names & PROTOCOL_NAMES:
                found.append(f"{node.lineno}: protocol compared with {sorted(names)}")
    return found


def test_nothing_outside_the_store_layer_reaches_a_filesystem_or_branches_on_a_protocol() -> None:
    offenders = {
        str(p.relative_to(PACKAGE.parent)): doors
        for p in _outside_writers()
        if (doors := _doors(p))
    }
    assert not offenders, offenders


def test_the_check_sees_each_kind_of_door(tmp_path: Path) -> None:
    """The check is not blind: each kind of door it names is found in a sample."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import fsspec\n"
        "from fsspec.spec import AbstractFileSystem\n"
        "def f(store, loc):\n"
        "    store.fs.ls('x')\n"
        "    loc.open_fs()\n"
        "    x: AbstractFileSystem = loc\n"
        "    return loc.protocol in ('s3', 'gs')\n"
    )
    kinds = sorted(d.split(": ", 1)[1] for d in _doors(sample))
    assert kinds == sorted(
        [
            "import fsspec",
            "from fsspec.spec import ...",
            "AbstractFileSystem",
            ".fs",
            ".open_fs",
            "protocol compared with ['gs', 's3']",
        ]
    ), kinds
