from typing import Any

import objckpt


def test_public_names_are_exactly_the_contract() -> None:
    assert objckpt.__all__ == sorted(objckpt.__all__, key=str.lower) or objckpt.__all__ == sorted(
        objckpt.__all__
    )
    assert set(objckpt.__all__) == {
        "AsyncCallsQueue",
        "AsyncCheckpointer",
        "AsyncOptions",
        "AsyncRequest",
        "BackupStatus",
        "BackupTarget",
        "ByteGrouping",
        "CheckpointManager",
        "Config",
        "RetentionPolicy",
        "RetryPolicy",
        "load_config",
        "SaveHandle",
        "async_save",
        "Location",
        "LocalTier",
        "LoadPlanner",
        "TierStatus",
        "Manifest",
        "ObjectStoreReader",
        "ObjectStoreWriter",
        "ReadOptions",
        "UploadOptions",
        "__version__",
        "errors",
        "write_stock_metadata",
    }
    for name in objckpt.__all__:
        assert hasattr(objckpt, name)


def test_errors_follow_the_standard_meanings() -> None:
    e = objckpt.errors
    assert issubclass(e.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(e.CheckpointNotCommittedError, e.CheckpointNotFoundError)
    assert issubclass(e.BucketNotFoundError, FileNotFoundError)
    assert issubclass(e.CheckpointExistsError, FileExistsError)
    assert issubclass(e.ConfigurationError, ValueError)
    for name in e.__all__:
        assert issubclass(getattr(e, name), e.ObjckptError)


def test_async_save_is_a_function_not_a_shadowed_module() -> None:
    import importlib.util

    assert callable(objckpt.async_save)
    assert importlib.util.find_spec("objckpt.async_save") is None


def test_layers_import_only_downwards() -> None:
    """Store < format < dcp < pipeline < ops: no layer imports one above it; inside
    ops, its rooms likewise: maintain, convert < tier < run."""
    import ast
    import pathlib

    order = ["writers", "format", "dcp", "pipeline", "ops"]
    rooms = ["maintain", "convert", "tier", "run"]
    root = pathlib.Path(objckpt.__file__).parent
    bad = []
    for level, layer in enumerate(order):
        for path in (root / layer).rglob("*.py"):
            room = path.parent.name if layer == "ops" else None
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("objckpt."):
                    parts = node.module.split(".")
                    where = f"{path.relative_to(root)} imports {node.module}"
                    if (parts[1] in order and order.index(parts[1]) > level) or (
                        room in rooms
                        and parts[1:2] == ["ops"]
                        and len(parts) > 2
                        and parts[2] in rooms
                        and rooms.index(parts[2]) > rooms.index(room)
                    ):
                        bad.append(where)
    assert bad == []
    assert sorted(p.name for p in (root / "ops").iterdir() if p.suffix == ".py") == ["__init__.py"]
    assert sorted(
        p.name for p in (root / "ops").iterdir() if p.is_dir() and p.name != "__pycache__"
    ) == sorted(rooms)


def _imported_modules(path: Any, name: str, known: set[str]) -> set[str]:
    """Modules of objckpt that ``path`` (module ``name``) imports, lazy imports included
    and ``if TYPE_CHECKING:`` blocks excepted. ``from pkg import mod`` counts as an edge
    to ``pkg.mod`` alone when ``mod`` is a module, else to ``pkg``."""
    import ast

    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            targets = subs or [base]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def test_no_import_cycles() -> None:
    """No module of objckpt imports itself back through others, lazy imports included
    (a cycle hidden in a function body is still a cycle; only typing imports are exempt)."""
    import pathlib

    root = pathlib.Path(objckpt.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = ("objckpt", *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    known = set(modules)
    graph = {name: _imported_modules(path, name, known) for name, path in modules.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: finished

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*trail[trail.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []
