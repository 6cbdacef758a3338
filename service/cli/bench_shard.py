"""``shoal bench shard``: sharded replicas (ZeRO-1, 2 and 3) against whole ones, and a block
split over two devices against whole (tensor parallelism)."""

from __future__ import annotations

from typing import Any

import click
from rich.console import Console
from rich.table import Table

from shoal.service.cli.bench_output import JSON_OPTION, bench_settings, caption, fmt, run_bench


@click.command()
@click.option("--hidden", default=1024, show_default=True, type=click.IntRange(1, 16384))
@click.option("--layers", default=4, show_default=True, type=click.IntRange(1, 256))
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(1, 65536))
@click.option("--micro-batches", default=8, show_default=True, type=click.IntRange(2, 1024))
@click.option(
    "--replicas",
    "replicas",
    multiple=True,
    type=click.IntRange(2, 64),
    help="Replica counts to measure, one virtual CPU device each [default: 2 and 4].",
)
@click.option(
    "--steps",
    default=12,
    show_default=True,
    type=click.IntRange(3, 1000),
    help="Steps of each run, the first two untimed.",
)
@JSON_OPTION
def shard(
    hidden: int,
    layers: int,
    batch_size: int,
    micro_batches: int,
    replicas: tuple[int, ...],
    steps: int,
    as_json: bool,
) -> None:
    """Replicas of one stage under parallelism.shard none, optimizer (ZeRO-1), gradients
    (ZeRO-2) and full (ZeRO-3), and one block split 2 ways against whole (parallelism.tensor):
    samples/s, and the state a device keeps, measured and predicted."""
    from shoal.service.bench.shard import ShardSettings, run_shard
    from shoal.service.bench.shard import phases as shard_phases

    settings = bench_settings(
        ShardSettings,
        hidden=hidden,
        layers=layers,
        batch_size=batch_size,
        micro_batches=micro_batches,
        replicas=tuple(sorted(set(replicas))) or (2, 4),
        steps=steps,
    )
    count = len(shard_phases(settings))
    run_bench(count, as_json, lambda progress: run_shard(settings, progress), shard_table)


def shard_table(console: Console, result: dict[str, Any]) -> None:
    table = Table(title="Sharded replicas", caption=caption(result))
    for name in ("replicas", "shard", "samples/s", "vs none", "state/device MiB"):
        table.add_column(name, justify="right")
    table.add_column("predicted", justify="right")
    table.add_column("state share", justify="right")
    table.add_column("optimizer state share", justify="right")
    table.add_column("copy MiB", justify="right")
    for run in result["runs"]:
        table.add_row(
            str(run["replicas"]),
            run["shard"],
            fmt(run["samples_per_s"]),
            fmt(run["vs_none"], 2),
            fmt(run["state_bytes_per_device"] / 2**20),
            fmt(run["predicted_state_bytes_per_device"] / 2**20),
            fmt(run["state_share"], 3),
            "-" if run["optimizer_state_share"] is None else fmt(run["optimizer_state_share"], 3),
            fmt(run["copy_bytes_per_device"] / 2**20),
        )
    console.print(table)
    split = result["tensor"]
    console.print(
        f"One block ({split['parameters']:,} parameters), split over {split['ways']} devices"
        f" ({split['devices']}): {fmt(split['tp2_samples_per_s'])} samples/s against"
        f" {fmt(split['tp1_samples_per_s'])} whole ({fmt(split['tp2_vs_tp1'], 2)}x); a device"
        f" keeps {fmt(split['tp2_state_bytes_per_device'] / 2**20)} MiB of its"
        f" {fmt(split['whole_state_bytes'] / 2**20)} MiB (predicted"
        f" {fmt(split['predicted_tp2_state_bytes_per_device'] / 2**20)})"
    )
