"""No hidden module state: no module of the library keeps a mutable container at
module level that it changes later (a cache, a registry, a map of groups).

State belongs to an object its caller builds and closes (a checkpointer its caches,
a collectives object its side groups). The exceptions are the process's client
cache, :data:`objckpt.writers.clients.PROCESS_CLIENTS`, documented in its module,
and the state of the pipeline's worker processes: a process pool calls module
functions, so a worker's stores, segment mappings and prepared ``.metadata`` live in
its modules, only ever filled inside that process (each module says so).
"""

from __future__ import annotations

import ast
import pathlib

import objckpt

PACKAGE = pathlib.Path(objckpt.__file__).parent
#: The documented process client cache, and the state of worker processes (upload
#: workers; rank 0's commit helper), each documented in its module docstring.
ALLOWED = {"writers/clients.py", "pipeline/upload_task.py", "pipeline/stock_task.py"}

_EMPTY_CALLS = {
    "dict",
    "list",
    "set",
    "defaultdict",
    "OrderedDict",
    "deque",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
}
_MUTATORS = {
    "add",
    "append",
    "appendleft",
    "clear",
    "discard",
    "extend",
    "insert",
    "pop",
    "popitem",
    "remove",
    "setdefault",
    "update",
}


def _is_empty_container(value: ast.expr | None) -> bool:
    if isinstance(value, ast.Dict | ast.List | ast.Set):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        return name in _EMPTY_CALLS
    return False


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """The statements run at import: the module's own, and those inside its top-level
    ``if``/``try``/``with`` blocks."""
    out: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        stmt = todo.pop()
        out.append(stmt)
        if isinstance(stmt, ast.If | ast.With):
            todo.extend(stmt.body)
            todo.extend(getattr(stmt, "orelse", []))
        elif isinstance(stmt, ast.Try):
            todo.extend(stmt.body + stmt.orelse + stmt.finalbody)
            for handler in stmt.handlers:
                todo.extend(handler.body)
    return out


def _containers(tree: ast.Module) -> set[str]:
    """Names bound at module level to an empty mutable container."""
    names: set[str] = set()
    for stmt in _module_level(tree):
        if isinstance(stmt, ast.Assign) and _is_empty_container(stmt.value):
            names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
        elif (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and _is_empty_container(stmt.value)
        ):
            names.add(stmt.target.id)
    return names


def _mutated(tree: ast.Module, names: set[str]) -> set[str]:
    """Which of ``names`` the module changes anywhere (item assignment or deletion, or a
    mutating method)."""
    found: set[str] = set()

    def base(node: ast.expr) -> str | None:
        return node.id if isinstance(node, ast.Name) and node.id in names else None

    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Subscript) and (name := base(t.value)):
                found.add(name)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _MUTATORS
            and (name := base(node.func.value))
        ):
            found.add(name)
    return found


def module_state(source: str) -> set[str]:
    """The module-level containers ``source`` mutates."""
    tree = ast.parse(source)
    return _mutated(tree, _containers(tree))


def test_the_check_finds_a_module_cache() -> None:
    cache = "import threading\n_GROUPS: dict[str, int] = {}\ndef get(k):\n    _GROUPS[k] = 1\n"
    assert module_state(cache) == {"_GROUPS"}
    seen = "SEEN = set()\ndef note(x):\n    SEEN.add(x)\n"
    assert module_state(seen) == {"SEEN"}
    table = "NAMES = {}\nNAMES_LIST = []\ndef read(k):\n    return NAMES.get(k), len(NAMES_LIST)\n"
    assert module_state(table) == set()  # read only: a constant table
    local = "def f():\n    d = {}\n    d['a'] = 1\n"
    assert module_state(local) == set()


def test_no_module_keeps_mutable_state() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ALLOWED:
            continue
        for name in sorted(module_state(path.read_text(encoding="utf-8"))):
            offenders.append(f"objckpt/{rel}: {name}")
    assert not offenders, (
        "module-level state changed at run time (give it an owner: an object its caller "
        "builds and closes):\n" + "\n".join(offenders)
    )
