"""torchtitan for real: its debug model saves to objckpt on s3:// (moto), then resumes.

Runs ``torchtitan.train`` (torchtitan 0.3.0, its llama3 debug model, its own
CheckpointManager subclassed in ``bench/titan_objckpt.py``) twice under torchrun,
gloo on CPU, against a moto S3 server this script starts:

1. ``--training.steps STEPS1``: a checkpoint every step, each committed by objckpt
   at ``s3://titan/run/checkpoint/step-N``;
2. ``--training.steps STEPS2`` with the same arguments: torchtitan finds the newest
   committed step, loads it through ``ObjectStoreReader``, trains on and saves again.

It checks the logs (every step committed, run 2 loaded step STEPS1 and started at
STEPS1 + 1) and prints the lines that show it. Offline: the dataset (torchtitan's
``c4_test`` format) and a word-level tokenizer are written to the work folder.

torchtitan 0.3.0 does not run on a CPU as shipped; in each torchrun child this
script first patches three things (``_cpu_shims``), none of them checkpointing:
its device module (it falls back to ``torch.cuda`` when there is no accelerator),
FlexAttention (no backward on CPU; SDPA with the same mask instead) and FSDP2's
reduce-scatter op (gloo has no ``PREMUL_SUM``). On a GPU machine run it with
``--gpu`` (nccl, no patches).

Usage (a venv with torchtitan 0.3.0, torch >= 2.15 and objckpt[s3,test]; see
docs/guides/torchtitan.md)::

    python bench/titan_run.py [--nproc 2] [--steps1 2] [--steps2 4] [--async-mode async]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import smoke

HERE = Path(__file__).resolve().parent
BUCKET = "titan"
TEXT = (
    "the quick brown fox jumps over a lazy dog while checkpoints stream shards of tensors "
    "into buckets and readers load them back after a restart of the job"
)
WORDS = TEXT.split()
BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"


def write_assets(root: Path) -> tuple[Path, Path]:
    """A c4_test-style dataset (JSON lines with "text") and a word-level tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    data, tok = root / "c4_test", root / "tokenizer"
    data.mkdir(parents=True, exist_ok=True)
    tok.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(0)
    with open(data / "data.json", "w") as f:
        for _ in range(64):
            f.write(json.dumps({"text": " ".join(rnd.choice(WORDS) for _ in range(200))}) + "\n")
    vocab = {w: i for i, w in enumerate([UNK, BOS, EOS, *sorted(set(WORDS))])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(tok / "tokenizer.json"))
    (tok / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return data, tok


def _cpu_shims() -> None:
    """Let torchtitan 0.3.0 train on CPU with gloo (before torchtitan.train is imported)."""
    import torch.nn.functional as F
    import torchtitan.tools.utils as tt_utils
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.attention.flex_attention import create_mask

    # 1. torchtitan takes torch.cuda as the device module when no accelerator is found.
    tt_utils.device_type = "cpu"
    tt_utils.device_module = types.SimpleNamespace(
        set_device=lambda device: None,
        device_count=lambda: 1,
        current_device=lambda: 0,
        synchronize=lambda *a: None,
        empty_cache=lambda: None,
        reset_peak_memory_stats=lambda *a: None,
        memory_stats=lambda *a: {},
        get_device_name=lambda *a: "cpu",
        get_device_properties=lambda *a: types.SimpleNamespace(total_memory=1 << 34, name="cpu"),
    )

    # 2. FlexAttention has no backward on CPU (and "sdpa" is refused for llama3):
    #    SDPA under the same document-causal mask.
    from torchtitan.models.common.attention import FlexAttention

    def eager_attention(
        q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options
    ):
        assert score_mod is None and not return_aux.lse
        mask = create_mask(
            block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device
        )
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        return out, None

    FlexAttention.compiled_flex_attn = staticmethod(eager_attention)

    # 3. torchtitan sets FSDP's gradient divide factor to 1, which FSDP2 reduce-scatters
    #    with PREMUL_SUM(1.0); gloo has no PREMUL_SUM. SUM is the same for a factor of 1.
    set_factor = FSDPModule.set_gradient_divide_factor

    def set_factor_sum(self, factor):
        set_factor(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_factor_sum


def child() -> None:
    """A torchrun worker: torchtitan's own entry point, after the CPU shims."""
    if os.environ.get("TITAN_CPU") == "1":
        _cpu_shims()
    from torchtitan.train import main

    main()


def run_titan(
    args: argparse.Namespace,
    steps: int,
    env: dict[str, str],
    log: Path,
    assets: tuple[Path, Path],
    folder: str,
) -> str:
    """One ``torchtitan.train`` job under torchrun; returns rank 0's log."""
    data, tok = assets
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={args.nproc}",
        "--standalone",
        "--local-ranks-filter=0",
        str(Path(__file__).resolve()),
        "--module",
        "titan_objckpt",
        "--config",
        "llama3_debugmodel_objckpt",
        "--training.steps",
        str(steps),
        "--training.seq_len",
        str(args.seq_len),
        "--training.local_batch_size",
        "2",
        "--hf_assets_path",
        str(tok),
        "--dataloader.dataset_path",
        str(data),
        "--checkpoint.enable",
        "--checkpoint.folder",
        folder,
        "--checkpoint.interval",
        "1",
        "--checkpoint.async_mode",
        args.async_mode,
        "--dump_folder",
        str(log.parent / "dump"),
        "--debug.seed",
        "0",
        "--debug.deterministic",
    ]
    print("$", " ".join(cmd), flush=True)
    with open(log, "w") as out:
        rc = subprocess.run(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout
        ).returncode
    text = log.read_text()
    if rc != 0:
        sys.stderr.write(text[-6000:])
        raise SystemExit(f"torchtitan exited with {rc} (log: {log})")
    return text


def losses(text: str) -> dict[int, str]:
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text)
    return {int(m[1]): m[2] for m in re.finditer(r"step:\s+(\d+)\s+loss:\s+(\S+)", plain)}


def excerpt(text: str) -> list[str]:
    keep = re.compile(
        r"torchtitan version|Checkpointing active|Loading the checkpoint|"
        r"Finished loading|Training starts|step: |committed s3://|"
        r"checkpoint completed|Training completed"
    )
    return [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in text.splitlines() if keep.search(ln)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps1", type=int, default=2)
    p.add_argument("--steps2", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--async-mode", default="disabled", choices=["disabled", "async"])
    p.add_argument("--gpu", action="store_true", help="train on CUDA/nccl, no CPU shims")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the uninterrupted run whose losses the resumed run must match",
    )
    smoke.add_argument(p)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.smoke:
        if not smoke.installed("torchtitan", "the torchtitan run", "make test-titan's venv"):
            return
        smoke.apply(args, steps1=1, steps2=2, no_reference=True)
        args.workdir = Path(args.out)

    from objckpt.testing.servers import offline_env, start_moto_server

    work = args.workdir or Path(tempfile.mkdtemp(prefix="titan-"))
    work.mkdir(parents=True, exist_ok=True)
    assets = write_assets(work / "assets")
    server = start_moto_server()
    try:
        server.boto3_client().create_bucket(Bucket=BUCKET)
        env = {
            **os.environ,
            **offline_env(),
            "AWS_ENDPOINT_URL": server.endpoint_url,  # s3fs (objckpt's and torchtitan's)
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
            "TITAN_CPU": "0" if args.gpu else "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_OFFLINE": "1",
        }
        folder = f"s3://{BUCKET}/run/checkpoint"
        first = run_titan(args, args.steps1, env, work / "run1.log", assets, folder)
        second = run_titan(args, args.steps2, env, work / "run2.log", assets, folder)
        reference = (
            None
            if args.no_reference
            else run_titan(
                args, args.steps2, env, work / "reference.log", assets, f"s3://{BUCKET}/reference"
            )
        )
    finally:
        server.stop()

    for n in range(1, args.steps1 + 1):
        assert f"committed {folder}/step-{n} " in first, f"run 1 did not commit step {n}"
    assert "No checkpoint was provided, this is a fresh start." in first
    assert f"Loading the checkpoint from {folder}/step-{args.steps1}." in second
    assert f"Training starts at step {args.steps1 + 1}" in second
    for n in range(args.steps1 + 1, args.steps2 + 1):
        assert f"committed {folder}/step-{n} " in second, f"run 2 did not commit step {n}"
    for name, text in (("run 1", first), ("run 2", second)):
        print(f"--- {name} (rank 0)")
        print("\n".join(excerpt(text)))
    if reference is not None:
        resumed, straight = {**losses(first), **losses(second)}, losses(reference)
        print(f"--- losses, saved + resumed: {resumed}; uninterrupted: {straight}")
        assert resumed == straight, "the resumed run's losses differ from the uninterrupted run's"
    print(
        f"OK: saved steps 1..{args.steps1} to {folder} through objckpt, resumed from "
        f"step {args.steps1}, saved {args.steps1 + 1}..{args.steps2} (logs: {work})"
    )


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        child()
    else:
        main()
