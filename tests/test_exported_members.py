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
