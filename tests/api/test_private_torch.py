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


def test_only_the_torch_module_uses_private_torch_names() -> None:
    """Every module but ``objckpt/_torch.py`` uses public torch names only."""
    offenders = {
        str(path.relative_to(PACKAGE.parent)): names
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != ALLOWED and (names := private_torch_names(path.read_text(encoding="utf-8")))
    }
    assert offenders == {}, f"move these behind objckpt/_torch.py: {offenders}"
