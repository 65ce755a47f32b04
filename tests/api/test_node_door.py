"""One door to a node's disk (#45): under ``objckpt/ops/`` and ``objckpt/dcp/`` no
module opens, lists, stats, renames or deletes a file itself; every node-local file
is reached through :class:`~objckpt.writers.node_store.NodeStore`, which checks
every component under the tier's root without following a link. A guarantee
proven there (no link followed, temp + fsync + rename, nothing half-written left)
then holds for every caller.

What is not a node-tier file is allowed by name below, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import objckpt

PACKAGE = Path(objckpt.__file__).parent
#: The layers whose modules reach a node's disk only through the door.
GUARDED = ("ops", "dcp")
#: Functions of ``os`` that open, list, stat, rename or delete a path.
OS_CALLS = frozenset(
    {
        "open",
        "fdopen",
        "listdir",
        "scandir",
        "walk",
        "fwalk",
        "remove",
        "unlink",
        "rename",
        "renames",
        "replace",
        "rmdir",
        "removedirs",
        "mkdir",
        "makedirs",
        "link",
        "symlink",
        "readlink",
        "stat",
        "lstat",
        "statvfs",
        "truncate",
        "chmod",
        "utime",
    }
)
#: Functions of ``os.path`` that look at the disk (not mere string work).
OS_PATH_CALLS = frozenset(
    {"exists", "lexists", "isfile", "isdir", "islink", "getsize", "getmtime", "realpath"}
    | {"samefile"}
)
#: Modules whose every call touches the disk.
DISK_MODULES = frozenset({"shutil", "glob", "tempfile", "pathlib"})
#: Other calls that open a file.
OPENERS = frozenset({"open", "io.open", "io.FileIO", "builtins.open"})
#: (module, what) -> why it is not a node-tier file.
ALLOWED = {
    # The user's configuration file: a path the user names, not a file of the tier.
    ("objckpt/ops/run/config.py", "open"): "reads the user's config file (load_config)",
}


def _guarded() -> list[Path]:
    return sorted(p for layer in GUARDED for p in (PACKAGE / layer).rglob("*.py"))


def _dotted(node: ast.expr) -> str:
    """``os.path.islink`` for that expression, else ''."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def _doors(path: Path) -> list[tuple[int, str]]:
    """Each disk access in ``path`` outside the door, as (line, what)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, f"import {a.name}")
                for a in node.names
                if a.name.split(".")[0] in DISK_MODULES
            ]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] in DISK_MODULES or (
                module in ("os", "os.path")
                and any(a.name in OS_CALLS | OS_PATH_CALLS for a in node.names)
            ):
                found.append((node.lineno, f"from {module} import ..."))
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            head, _, last = name.rpartition(".")
            calls = {"os": OS_CALLS, "os.path": OS_PATH_CALLS}.get(head, frozenset())
            if name in OPENERS or last in calls:
                found.append((node.lineno, name))
    return found


def test_nothing_under_ops_or_dcp_reaches_a_nodes_disk_but_through_the_node_store() -> None:
    offenders: dict[str, list[str]] = {}
    for p in _guarded():
        rel = str(p.relative_to(PACKAGE.parent))
        for line, what in _doors(p):
            if (rel, what) not in ALLOWED:
                offenders.setdefault(rel, []).append(f"{line}: {what}")
    assert not offenders, offenders


def test_every_allowance_is_still_needed() -> None:
    """An allowance whose call went away is removed, so the list stays the truth."""
    used = {(str(p.relative_to(PACKAGE.parent)), what) for p in _guarded() for _, what in _doors(p)}
    assert set(ALLOWED) <= used, set(ALLOWED) - used


def test_the_check_sees_each_kind_of_door(tmp_path: Path) -> None:
    """The check is not blind: each kind of access it names is found in a sample."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os, shutil\n"
        "from pathlib import Path\n"
        "from os import scandir\n"
        "def f(p):\n"
        "    with open(p, 'rb') as f:\n"
        "        f.read()\n"
        "    os.unlink(p)\n"
        "    os.path.islink(p)\n"
        "    os.path.join(p, 'x')\n"
        "    shutil.rmtree(p)\n"
    )
    kinds = sorted(what for _, what in _doors(sample))
    assert kinds == sorted(
        [
            "import shutil",
            "from pathlib import ...",
            "from os import ...",
            "open",
            "os.unlink",
            "os.path.islink",
        ]
    ), kinds
