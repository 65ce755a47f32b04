"""Export of a committed checkpoint to Hugging Face safetensors, store to store."""

from __future__ import annotations

import json
import re
import threading

import dist_helpers
import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from helpers import quiet
from ranks import run_ranks
from safetensors.torch import load as load_safetensors

from objckpt import Location, ObjectStoreWriter
from objckpt.cli import main
from objckpt.errors import CheckpointExistsError, ConfigurationError, ObjckptError
from objckpt.ops.convert.export import INDEX_NAME, export_safetensors, parse_size
from objckpt.testing import FaultProxy, Rule
from objckpt.testing.plugin import StoreTarget


def gpt2_state(layers: int = 2, width: int = 64, vocab: int = 500) -> dict[str, torch.Tensor]:
    """A tiny GPT-2-shaped state dict (transformers' key names), no hub download."""
    g = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    state = {"transformer.wte.weight": t(vocab, width), "transformer.wpe.weight": t(128, width)}
    for i in range(layers):
        p = f"transformer.h.{i}."
        state |= {
            p + "ln_1.weight": t(width),
            p + "ln_1.bias": t(width),
            p + "attn.c_attn.weight": t(width, 3 * width),
            p + "attn.c_attn.bias": t(3 * width),
            p + "attn.c_proj.weight": t(width, width),
            p + "attn.c_proj.bias": t(width),
            p + "ln_2.weight": t(width),
            p + "ln_2.bias": t(width),
            p + "mlp.c_fc.weight": t(width, 4 * width),
            p + "mlp.c_fc.bias": t(4 * width),
            p + "mlp.c_proj.weight": t(4 * width, width),
            p + "mlp.c_proj.bias": t(width),
        }
    state |= {"transformer.ln_f.weight": t(width), "transformer.ln_f.bias": t(width)}
    return state


def _save(state: dict, url: str, target: StoreTarget) -> None:
    with quiet():
        dcp.save(
            {**state, "step": 7},
            storage_writer=ObjectStoreWriter(url, storage_options=target.storage_options),
        )


def _read_export(target: StoreTarget, url: str) -> tuple[dict, dict[str, torch.Tensor]]:
    fs = Location.parse(url, target.storage_options).open_fs(fresh=True)
    base = Location.parse(url).path
    index = json.loads(fs.cat_file(f"{base}/{INDEX_NAME}"))
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors |= load_safetensors(fs.cat_file(f"{base}/{name}"))
    return index, tensors


def test_export_loads_with_safetensors_bit_exact(s3_bucket: StoreTarget) -> None:
    state = gpt2_state()
    _save(state, s3_bucket.url("ckpt"), s3_bucket)
    report = export_safetensors(
        s3_bucket.url("ckpt"),
        s3_bucket.url("hf"),
        storage_options=s3_bucket.storage_options,
        shard_size="100KB",  # several shards
    )
    index, got = _read_export(s3_bucket, s3_bucket.url("hf"))
    assert set(got) == set(state)  # the non-tensor "step" has no safetensors form
    for k, v in state.items():
        assert torch.equal(got[k], v), k
    assert len(report.files) > 2 and len(set(index["weight_map"].values())) == len(report.files)
    names = [f for f, _, _ in report.files]
    attempt = index["metadata"]["objckpt"]["attempt"]
    assert names == [
        f"model-{n:05d}-of-{len(names):05d}.{attempt}.safetensors" for n in range(1, len(names) + 1)
    ]
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in state.values())
    sizes = {f: s for f, s, _ in report.files}
    fs = Location.parse(s3_bucket.url("hf"), s3_bucket.storage_options).open_fs(fresh=True)
    for name, size in sizes.items():  # header + data, as the report says
        assert fs.size(f"{Location.parse(s3_bucket.url('hf')).path}/{name}") == size


def test_export_consolidates_shards_saved_by_four_ranks(s3_bucket: StoreTarget, tmp_path) -> None:
    url = s3_bucket.url("ws4")
    args = ("save_sharded", 4, str(tmp_path / "init"), url, s3_bucket.storage_options)
    run_ranks(dist_helpers, *args)
    export_safetensors(url, s3_bucket.url("ws4-hf"), storage_options=s3_bucket.storage_options)
    _, got = _read_export(s3_bucket, s3_bucket.url("ws4-hf"))
    full = dist_helpers.full_state()
    assert set(got) == {f"model.{k}" for k in full}
    for k, v in full.items():
        assert torch.equal(got[f"model.{k}"], v), k  # rows from 4 ranks' objects, whole again


def test_keys_and_dtype_select_and_convert(s3_bucket: StoreTarget) -> None:
    state = gpt2_state()
    state["transformer.h.0.attn.bias_mask"] = torch.ones(4, 4, dtype=torch.bool)
    _save(state, s3_bucket.url("ckpt"), s3_bucket)
    export_safetensors(
        s3_bucket.url("ckpt"),
        s3_bucket.url("h0"),
        storage_options=s3_bucket.storage_options,
        keys=["transformer.h.0.*"],
        dtype="bf16",
    )
    _, got = _read_export(s3_bucket, s3_bucket.url("h0"))
    assert set(got) == {k for k in state if k.startswith("transformer.h.0.")}
    for k, v in got.items():
        if state[k].is_floating_point():
            assert v.dtype == torch.bfloat16 and torch.equal(v, state[k].to(torch.bfloat16)), k
        else:
            assert v.dtype == torch.bool and torch.equal(v, state[k]), k  # kept as is


def test_a_second_export_to_the_same_place_is_refused(s3_bucket: StoreTarget) -> None:
    _save(gpt2_state(layers=1), s3_bucket.url("ckpt"), s3_bucket)
    kw = {"storage_options": s3_bucket.storage_options}
    export_safetensors(s3_bucket.url("ckpt"), s3_bucket.url("hf"), **kw)
    with pytest.raises(CheckpointExistsError, match=INDEX_NAME):
        export_safetensors(s3_bucket.url("ckpt"), s3_bucket.url("hf"), **kw)


def _listing(target: StoreTarget, url: str) -> set[str]:
    fs = Location.parse(url, target.storage_options).open_fs(fresh=True)
    return {p.rsplit("/", 1)[-1] for p in fs.ls(Location.parse(url).path, detail=False)}


def test_two_exports_racing_to_one_destination_commit_one_whole_export(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """Export A passes the "no index yet" check, writes its first shard, then the proxy
    holds its second shard; export B runs to its commit meanwhile, then A goes on (a
    zombie export). Before attempt-named shards, A's later shards overwrote B's under
    B's committed index (a mixed export). Now exactly one export is committed, whole:
    its index names only its own shards, each present and bit-exact; the loser raises
    naming the index URL and leaves none of its shards behind."""
    state_a = gpt2_state()
    state_b = {k: v + 1 for k, v in state_a.items()}
    _save(state_a, s3_bucket.url("src-a"), s3_bucket)
    _save(state_b, s3_bucket.url("src-b"), s3_bucket)
    dest = s3_bucket.url("raced")
    s3_proxy.add(Rule(key_contains="model-00002-of", action="hold", stall=300))
    lost: list[BaseException] = []

    def export_a() -> None:
        try:
            export_safetensors(
                s3_bucket.url("src-a"),
                dest,
                storage_options=s3_bucket.storage_options,
                dest_storage_options=s3_proxy.storage_options(),
                shard_size="100KB",
            )
        except BaseException as exc:
            lost.append(exc)

    a = threading.Thread(target=export_a)
    a.start()
    try:
        s3_proxy.wait_for(None, faulted=True, timeout=120)  # A is past its check, held
        report = export_safetensors(
            s3_bucket.url("src-b"),
            dest,
            storage_options=s3_bucket.storage_options,
            shard_size="100KB",
        )
    finally:
        s3_proxy.release()
        a.join(timeout=300)
    assert not a.is_alive()
    index, got = _read_export(s3_bucket, dest)
    winners = {f for f, _, _ in report.files}
    assert set(index["weight_map"].values()) == winners
    assert set(got) == set(state_b)
    for k, v in state_b.items():
        assert torch.equal(got[k], v), k  # B's bytes, never A's
    assert len(lost) == 1 and isinstance(lost[0], CheckpointExistsError), lost
    assert isinstance(lost[0], ObjckptError) and f"{dest}/{INDEX_NAME}" in str(lost[0])
    assert _listing(s3_bucket, dest) == winners | {INDEX_NAME}  # the loser's shards gone


def test_an_index_put_whose_answer_is_lost_is_settled_as_committed(
    s3_bucket: StoreTarget, s3_proxy: FaultProxy
) -> None:
    """The index PUT reaches the store and its answer is lost: the retry meets the
    index (412), reads it back, finds this export's attempt and reports success, with
    every shard kept (deleting them as a loser's would break the committed export)."""
    state = gpt2_state(layers=1)
    _save(state, s3_bucket.url("ckpt"), s3_bucket)
    s3_proxy.add(
        Rule("PutObject", key_contains=INDEX_NAME, action="reset", before_upstream=False, nth=1)
    )
    dest = s3_bucket.url("settled")
    report = export_safetensors(
        s3_bucket.url("ckpt"),
        dest,
        storage_options=s3_bucket.storage_options,
        dest_storage_options=s3_proxy.storage_options(),
        shard_size="50KB",
    )
    assert s3_proxy.count("PutObject", faulted=True) == 1
    index, got = _read_export(s3_bucket, dest)
    assert set(index["weight_map"].values()) == {f for f, _, _ in report.files}
    for k, v in state.items():
        assert torch.equal(got[k], v), k


def test_a_failed_export_leaves_no_index(s3_bucket: StoreTarget, s3_proxy: FaultProxy) -> None:
    """The second shard's upload fails: no index is written, so nothing mistakes the
    half-written export for a complete one, and the first shard, written before the
    failure, is deleted by the export that wrote it."""
    from objckpt import RetryPolicy

    _save(gpt2_state(), s3_bucket.url("ckpt"), s3_bucket)
    s3_proxy.add(Rule("PutObject", key_contains="model-00002-of", action="status", status=403))
    opts = s3_proxy.storage_options()
    with pytest.raises(Exception, match="model-00002-of"):
        export_safetensors(
            s3_bucket.url("ckpt"),
            s3_bucket.url("broken"),
            storage_options=opts,
            shard_size="100KB",
            retry=RetryPolicy(attempts=1),
        )
    fs = Location.parse(s3_bucket.url("broken"), opts).open_fs(fresh=True)
    written = [p for p in s3_proxy.paths("PutObject") if "model-00001-of" in p]
    assert written, "the first shard was written before the second failed"
    for path in written:
        assert not fs.exists(path.lstrip("/")), path  # deleted by the failed export
    assert not fs.exists(f"{Location.parse(s3_bucket.url('broken')).path}/{INDEX_NAME}")


def test_bad_options_name_themselves(s3_bucket: StoreTarget) -> None:
    _save(gpt2_state(layers=1), s3_bucket.url("ckpt"), s3_bucket)
    kw = {"storage_options": s3_bucket.storage_options}
    with pytest.raises(ConfigurationError, match="dtype='int3'"):
        export_safetensors(s3_bucket.url("ckpt"), s3_bucket.url("x"), dtype="int3", **kw)
    with pytest.raises(ConfigurationError, match="no tensors matching"):
        export_safetensors(s3_bucket.url("ckpt"), s3_bucket.url("x"), keys=["nope.*"], **kw)
    with pytest.raises(ConfigurationError, match="shard_size='lots'"):
        export_safetensors(s3_bucket.url("ckpt"), s3_bucket.url("x"), shard_size="lots", **kw)
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20


def test_cli_export(s3_bucket: StoreTarget) -> None:
    _save(gpt2_state(layers=1), s3_bucket.url("ckpt"), s3_bucket)
    flags = [f"--storage-option={k}={v}" for k, v in s3_bucket.storage_options.items()]
    flags = [f for f in flags if not f.startswith("--storage-option=client_kwargs")]
    flags.append('--storage-option=client_kwargs={"region_name": "us-east-1"}')
    args = ["export", s3_bucket.url("ckpt"), s3_bucket.url("cli"), "--keys", "*.wte.*"]
    result = CliRunner().invoke(main, [*args, "--json", *flags])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["tensors"] == 1 and len(doc["files"]) == 1
    assert re.fullmatch(r"model-00001-of-00001\.[0-9a-f]{16}\.safetensors", doc["files"][0]["name"])
    _, got = _read_export(s3_bucket, s3_bucket.url("cli"))
    assert torch.equal(
        got["transformer.wte.weight"], gpt2_state(layers=1)["transformer.wte.weight"]
    )


def test_import_of_a_safetensors_checkpoint_loads_sharded_on_two_ranks(
    s3_bucket: StoreTarget, tmp_path
) -> None:
    """Fine-tuning's way in: safetensors written by the safetensors library itself,
    imported, then loaded by a 2-rank job into DTensor shards, bit-exact."""
    from safetensors.torch import save as save_safetensors

    from objckpt.ops.convert.export import import_safetensors

    full = {f"model.{k}": v for k, v in dist_helpers.full_state().items()}
    base = Location.parse(s3_bucket.url("st"), s3_bucket.storage_options)
    fs = base.open_fs(fresh=True)
    fs.pipe_file(f"{base.path}/model.safetensors", save_safetensors(full))
    assert import_safetensors(
        s3_bucket.url("st"), s3_bucket.url("imported"), storage_options=s3_bucket.storage_options
    ) == len(full)
    args = (
        "load_model_sharded",
        2,
        str(tmp_path / "init"),
        s3_bucket.url("imported"),
        s3_bucket.storage_options,
    )
    run_ranks(dist_helpers, *args)


def test_export_then_import_round_trips(s3_bucket: StoreTarget) -> None:
    from objckpt import ObjectStoreReader
    from objckpt.ops.convert.export import import_safetensors

    state = gpt2_state(layers=1)
    state["mask"] = torch.tensor(True)  # 0-d, bool
    _save(state, s3_bucket.url("a"), s3_bucket)
    kw = {"storage_options": s3_bucket.storage_options}
    export_safetensors(s3_bucket.url("a"), s3_bucket.url("a-hf"), shard_size="50KB", **kw)
    import_safetensors(s3_bucket.url("a-hf"), s3_bucket.url("b"), **kw)
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    with quiet():
        dcp.load(got, storage_reader=ObjectStoreReader(s3_bucket.url("b"), **kw))
    for k, v in state.items():
        assert torch.equal(got[k], v), k


def test_import_reads_an_export_made_before_attempt_ids(s3_bucket: StoreTarget) -> None:
    """Exports written before shard names carried an attempt id (an index naming
    ``model-0000i-of-0000N.safetensors``) import as before."""
    from safetensors.torch import save as save_safetensors

    from objckpt import ObjectStoreReader
    from objckpt.ops.convert.export import import_safetensors

    state = gpt2_state(layers=1)
    keys = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    base = Location.parse(s3_bucket.url("old-hf"), s3_bucket.storage_options)
    fs = base.open_fs(fresh=True)
    for name, names in halves.items():
        fs.pipe_file(f"{base.path}/{name}", save_safetensors({k: state[k] for k in names}))
    index = {
        "metadata": {"total_size": 0},
        "weight_map": {k: n for n, ks in halves.items() for k in ks},
    }
    fs.pipe_file(f"{base.path}/{INDEX_NAME}", json.dumps(index).encode())
    kw = {"storage_options": s3_bucket.storage_options}
    assert import_safetensors(s3_bucket.url("old-hf"), s3_bucket.url("old-imported"), **kw) == len(
        state
    )
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    with quiet():
        dcp.load(got, storage_reader=ObjectStoreReader(s3_bucket.url("old-imported"), **kw))
    for k, v in state.items():
        assert torch.equal(got[k], v), k
