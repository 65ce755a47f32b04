"""Private torch names are used in ``objckpt/_torch.py`` only.

objckpt supports a range of torch releases (``pyproject.toml``'s floor to the newest,
``make test-torch``); a private name is what changes between them without notice.
Kept in one module, each with its fallback, a torch release that moves one breaks
that module alone, and it says what objckpt does without it. This test reads every
other module's source and names each private torch name it finds: an import from a
private torch module or of a private name, an attribute chain off an imported torch
module (``dist.distributed_c10d._get_default_group``), and a private attribute of
torch's tensors and process groups (``t._version``, ``pg._get_backend``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch
import torch.distributed as dist

import objckpt

PACKAGE = Path(objckpt.__file__).parent
ALLOWED = PACKAGE / "_torch.py"

#: Private attributes of the torch objects objckpt handles (tensors, process groups),
#: read from this torch.
TORCH_OBJECT_PRIVATES = {
    name
    for cls in (torch.Tensor, dist.ProcessGroup)
    for name in dir(cls)
    if name.startswith("_") and not name.startswith("__")
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _torch_module(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


def _private_path(text: str) -> bool:
    """A dotted torch module path with a private part (``torch.x._y``)."""
    parts = text.split(".")
    return (
        _torch_module(text)
        and all(p.isidentifier() for p in parts)
        and any(_private(p) for p in parts)
    )


def private_torch_strings(tree: ast.Module, torch_aliases: set[str]) -> list[str]:
    """Private torch names a module reaches by name instead of by import, as
    ``line: what``: a private module's dotted path (``importlib.import_module``), a
    ``(module, name)`` pair naming a private name of a torch module (an unpickler's
    allow-list: the pickle names it, so a torch that renames it changes what loads),
    and ``getattr(torch_module, "_name")``."""
    constants: dict[str, str] = {}  # module-level NAME = "..." (a pair's module part)
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    constants[target.id] = node.value.value

    def text(node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        return None

    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _private_path(node.value):
                found.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Tuple) and len(node.elts) == 2:
            module, name = (text(e) for e in node.elts)
            if module and name and _torch_module(module) and _private(name):
                found.append(f"{node.lineno}: ({module!r}, {name!r})")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in torch_aliases
            and (name := text(node.args[1])) is not None
            and _private(name)
        ):
            found.append(f"{node.lineno}: getattr({node.args[0].id}, {name!r})")
    return found


def private_torch_names(source: str) -> list[str]:
    """Each private torch name ``source`` uses, as ``line: what``."""
    tree = ast.parse(source)
    found: list[str] = []
    torch_aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _torch_module(alias.name):
                    continue
                if any(_private(part) for part in alias.name.split(".")):
                    found.append(f"{node.lineno}: import {alias.name}")
                torch_aliases.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and _torch_module(node.module or ""):
            module = node.module or ""
            for alias in node.names:
                if any(_private(p) for p in module.split(".")) or _private(alias.name):
                    found.append(f"{node.lineno}: from {module} import {alias.name}")
                torch_aliases.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        root: ast.expr = node
        chain = [node.attr]
        while isinstance(root, ast.Attribute):
            root = root.value
            if isinstance(root, ast.Attribute):
                chain.append(root.attr)
        if isinstance(root, ast.Name) and root.id in torch_aliases:
            found.append(f"{node.lineno}: {root.id}.{'.'.join(reversed(chain))}")
        elif node.attr in TORCH_OBJECT_PRIVATES and not (
            isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"}
        ):
            found.append(f"{node.lineno}: .{node.attr} (a torch object's)")
    found.extend(private_torch_strings(tree, torch_aliases))
    return sorted(set(found), key=lambda f: (int(f.split(":")[0]), f))


def test_the_scanner_finds_each_kind_of_private_torch_name() -> None:
    """The check below can fail: each way objckpt once used a private name is found."""
    source = "\n".join(
        [
            "import torch",
            "import torch.distributed as dist",
            "from torch.distributed.checkpoint._extension import StreamTransformExtension",
            "from torch.distributed.checkpoint.planner_helpers import _create_read_items",
            "from torch.distributed.checkpoint import _version",
            "pg = dist.distributed_c10d._get_default_group()",
            "writer = torch._C.PyTorchFileWriter",
            "pg._get_backend(torch.device('cpu'))",
            "versions = [t._version for t in tensors]",
            "from torch.distributed.checkpoint.metadata import Metadata",
            "self._version = 1",
            "dist.get_rank()",
        ]
    )
    assert [f.split(":")[0] for f in private_torch_names(source)] == [
        str(line) for line in (3, 4, 5, 6, 7, 8, 9)
    ]


def test_the_scanner_finds_private_torch_names_reached_by_name() -> None:
    """Names a module reaches without importing them are found too: the unpickler's
    allow-list of stock ``.metadata`` (which once named three private torch names in
    ``dcp/stock_metadata.py``, unseen by an import scan), a private module's path, and
    ``getattr`` of a private name off a torch module."""
    source = "\n".join(
        [
            "import torch",
            'MODULE = "torch.distributed.checkpoint.metadata"',
            "ALLOWED = {",
            '    (MODULE, "Metadata"),',
            '    (MODULE, "_MEM_FORMAT_ENCODING"),',
            '    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),',
            "}",
            'ext = importlib.import_module("torch.distributed.checkpoint._extension")',
            'writer = getattr(torch, "_C")',
            'logger = logging.getLogger("torch.distributed.checkpoint")',
            'docs = "see torch.distributed.checkpoint._extension for why"',
            'pair = ("objckpt.format", "_private")',
        ]
    )
    assert [f.split(":")[0] for f in private_torch_names(source)] == [
        str(line) for line in (5, 6, 8, 9)
    ]


def test_only_the_torch_module_uses_private_torch_names() -> None:
    """Every module but ``objckpt/_torch.py`` uses public torch names only."""
    offenders = {
        str(path.relative_to(PACKAGE.parent)): names
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != ALLOWED and (names := private_torch_names(path.read_text(encoding="utf-8")))
    }
    assert offenders == {}, f"move these behind objckpt/_torch.py: {offenders}"
