"""Reuse of unchanged bytes (#28): bytes uploaded, save time and storage per step.

Two cases, each saved by a ``CheckpointManager`` against one moto server, through
a recording proxy that counts the payload bytes of every PutObject/UploadPart:

* **LoRA**: a frozen fp32 base (``--base-mib``, 32 by default) in 8 layers, low-rank
  adapters (``--rank``, 2 by default: 0.375 MiB of adapters and Adam moments change per
  step, the issue's "36 MiB state whose training changes 0.4 MiB") that train, and
  Adam's two moments and step for the adapters.
  ``--steps`` saves with reuse (the default) and with ``reuse_unchanged=False``:
  bytes uploaded per step, save time per step (``save()`` to commit), and the
  bytes the root holds after the last step (keep everything), against one full
  checkpoint and against the run without reuse; and the same run with
  ``keep_last=1`` (storage after the last step, retention deleting as it goes).
* **Full training**: every byte changes every step (a transformer-shaped state of
  ``--full-mib``; each step adds noise to every tensor), saved with reuse on and off
  in alternating rounds (``--repeats``), in the same process and server: the median
  save time of the steps after the first (which have a base to compare with) tells
  what hashing and the base lookup cost when nothing is reused. On a shared machine
  these wall times are noisy, so the hash's own cost is measured too: CPU seconds of
  xxh3-128 per GiB (what each upload worker spends per byte it hashes).

Usage: ``python bench/bench_reuse.py [--base-mib 32] [--steps 10] [--full-mib 128]``
Results go to ``bench/results/reuse-<date>-<base>mib.json`` and a table to stdout.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import warnings
from typing import Any

import smoke
import torch
from bench_sync import transformer_state
from record import write_record

import objckpt
from objckpt.format.reused import item_digest
from objckpt.testing import FaultProxy
from objckpt.testing import lora as testing_lora
from objckpt.testing.servers import offline_env, start_moto_server
from objckpt.writers import open_store

log = logging.getLogger("bench")
MiB = 1024 * 1024
BUCKET = "objckpt-bench"
_UPLOADS = ("PutObject", "UploadPart")


def lora_state(base_mib: int, layers: int = 8, rank: int = 8) -> dict[str, Any]:
    """A frozen base of ``base_mib`` MiB fp32 in ``layers`` square layers, adapters
    of ``rank`` on each, and Adam's moments for the adapters."""
    width = int((base_mib * MiB // 4 // layers) ** 0.5)
    return testing_lora.lora_state(layers, width, rank)


lora_step = testing_lora.lora_step


def full_step(state: dict[str, torch.Tensor], step: int) -> None:
    for value in state.values():
        value.add_(1e-3 * step)


def hash_seconds_per_gib(mib: int = 256, repeats: int = 5) -> float:
    """Median seconds :func:`objckpt.format.reused.item_digest` takes per GiB."""
    data = torch.randn(mib * MiB // 4).numpy().tobytes()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        item_digest((data,))
        times.append(time.process_time() - t0)
    return statistics.median(times) * 1024 / mib


def _stored_bytes(root: str, options: dict[str, Any]) -> int:
    loc = objckpt.Location.parse(root, options)
    return sum(o.size for o in open_store(loc).inventory())


def run(
    proxy: FaultProxy,
    root: str,
    state: Any,
    step_fn: Any,
    steps: int,
    *,
    reuse: bool,
    keep_last: int | None = None,
) -> dict[str, Any]:
    """Save ``steps`` steps; bytes uploaded and save seconds per step."""
    options = proxy.storage_options()
    sent, seconds = [], []
    with objckpt.CheckpointManager(
        root,
        storage_options=options,
        retention=objckpt.RetentionPolicy(keep_last=keep_last),
        async_options=objckpt.AsyncOptions(workers=1),
        reuse_unchanged=reuse,
    ) as mgr:
        for step in range(1, steps + 1):
            if step > 1:
                step_fn(state, step)
            mgr.wait_until_finished()
            proxy.clear()
            t0 = time.perf_counter()
            mgr.save(step, state).result(timeout=600)
            seconds.append(time.perf_counter() - t0)
            sent.append(proxy.sent_bytes(*_UPLOADS))
        mgr.wait_until_finished()
    return {"sent": sent, "seconds": seconds, "stored": _stored_bytes(root, options)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-mib", type=int, default=32)
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--full-mib", type=int, default=128)
    parser.add_argument("--full-steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results")
    smoke.add_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    smoke.apply(args, base_mib=1, steps=2, full_mib=2, full_steps=2, repeats=1)
    logging.getLogger("objckpt").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(offline_env())
    server = start_moto_server()
    try:
        server.boto3_client().create_bucket(Bucket=BUCKET)
        with FaultProxy(server.endpoint_url) as proxy:
            fields = _measure(proxy, args)
    finally:
        server.stop()
    name = "reuse" if args.rank == 2 else f"reuse-rank{args.rank}"
    print(write_record(args.out, name, args.base_mib, fields))


def _measure(proxy: FaultProxy, args: argparse.Namespace) -> dict[str, Any]:
    root = f"s3://{BUCKET}"

    def lora() -> dict[str, Any]:
        return lora_state(args.base_mib, rank=args.rank)

    lora_on = run(proxy, f"{root}/lora-on", lora(), lora_step, args.steps, reuse=True)
    lora_off = run(proxy, f"{root}/lora-off", lora(), lora_step, args.steps, reuse=False)
    lora_k1 = run(
        proxy,
        f"{root}/lora-k1",
        lora(),
        lora_step,
        args.steps,
        reuse=True,
        keep_last=1,
    )
    full_first = lora_on["sent"][0]
    later = lora_on["sent"][1:]
    log.info("LoRA (%d MiB frozen base, rank %d), %d steps:", args.base_mib, args.rank, args.steps)
    log.info("  step  uploaded on   uploaded off   save s on   save s off")
    for n in range(args.steps):
        log.info(
            "  %4d  %11d  %13d  %10.2f  %11.2f",
            n + 1,
            lora_on["sent"][n],
            lora_off["sent"][n],
            lora_on["seconds"][n],
            lora_off["seconds"][n],
        )
    ratio = full_first / statistics.median(later)
    log.info("  bytes per later step: %.1fx fewer than the first (median)", ratio)
    log.info(
        "  stored after %d steps: %d (reuse) = %.2fx one full checkpoint; %d without reuse "
        "= %.2fx; keep_last=1: %d = %.2fx",
        args.steps,
        lora_on["stored"],
        lora_on["stored"] / lora_off["stored"] * args.steps,
        lora_off["stored"],
        args.steps,
        lora_k1["stored"],
        lora_k1["stored"] / lora_off["stored"] * args.steps,
    )
    full: dict[str, list[float]] = {"on": [], "off": []}
    full_sent: dict[str, list[int]] = {"on": [], "off": []}
    for r in range(args.repeats):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            result = run(
                proxy,
                f"{root}/full-{mode}-{r}",
                transformer_state(args.full_mib),
                full_step,
                args.full_steps,
                reuse=mode == "on",
            )
            full[mode].extend(result["seconds"][1:])
            full_sent[mode].extend(result["sent"][1:])
    on, off = statistics.median(full["on"]), statistics.median(full["off"])
    hashing = hash_seconds_per_gib()
    log.info("xxh3-128: %.3f CPU s per GiB", hashing)
    log.info(
        "full training (%d MiB, every byte changes): save %.2f s with reuse, %.2f s without "
        "(median of %d saves each): %.3fx",
        args.full_mib,
        on,
        off,
        len(full["on"]),
        on / off,
    )
    return {
        "lora": {
            "base_mib": args.base_mib,
            "rank": args.rank,
            "steps": args.steps,
            "reuse_on": lora_on,
            "reuse_off": lora_off,
            "reuse_on_keep_last_1": lora_k1,
            "later_step_ratio_median": ratio,
            "stored_vs_one_full": lora_on["stored"] / (lora_off["stored"] / args.steps),
            "stored_keep_last_1_vs_one_full": lora_k1["stored"] / (lora_off["stored"] / args.steps),
        },
        "full_training": {
            "size_mib": args.full_mib,
            "steps_per_run": args.full_steps,
            "repeats": args.repeats,
            "seconds_on": full["on"],
            "seconds_off": full["off"],
            "sent_on": full_sent["on"],
            "sent_off": full_sent["off"],
            "median_on": on,
            "median_off": off,
            "ratio": on / off,
            "hash_cpu_seconds_per_gib": hashing,
        },
    }


if __name__ == "__main__":
    main()
