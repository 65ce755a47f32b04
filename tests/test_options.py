import pytest

from objckpt import ReadOptions, UploadOptions
from objckpt.errors import ConfigurationError
from objckpt.options import MAX_PARTS, MiB


def test_part_size_grows_under_the_part_limit() -> None:
    opts = UploadOptions()
    assert opts.part_size_for(10 * MiB) == opts.part_size
    huge = 400 * 1024 * MiB  # 400 GiB
    part = opts.part_size_for(huge)
    assert part > opts.part_size and -(-huge // part) <= MAX_PARTS and part % MiB == 0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"part_size": 1024}, "part_size"),
        ({"object_size": 0}, "object_size"),
        ({"max_inflight": 0}, "max_inflight"),
    ],
)
def test_bad_upload_options_name_the_option(kwargs: dict, name: str) -> None:
    with pytest.raises(ConfigurationError, match=f"option {name}="):
        UploadOptions(**kwargs)


def test_bad_read_options() -> None:
    with pytest.raises(ConfigurationError, match="option range_size="):
        ReadOptions(range_size=10)
    with pytest.raises(ConfigurationError, match="option verify="):
        ReadOptions(verify="yes")  # type: ignore[arg-type]
