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
        "CheckpointManager",
        "Config",
        "RetentionPolicy",
        "RetryPolicy",
        "load_config",
        "SaveHandle",
        "async_save",
        "Location",
        "LocalTier",
        "TierStatus",
        "Manifest",
        "ObjectStoreReader",
        "ObjectStoreWriter",
        "ReadOptions",
        "UploadOptions",
        "__version__",
        "errors",
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
    """Store < format < dcp < pipeline < ops: no layer imports one above it."""
    import ast
    import pathlib

    order = ["writers", "format", "dcp", "pipeline", "ops"]
    root = pathlib.Path(objckpt.__file__).parent
    bad = []
    for level, layer in enumerate(order):
        for path in (root / layer).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("objckpt."):
                    parts = node.module.split(".")
                    if parts[1] in order and order.index(parts[1]) > level:
                        bad.append(f"{layer}/{path.name} imports {node.module}")
    assert bad == []
