"""How ``shoal bench`` shows a result when ``--json`` is not given: a table or two each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from shoal.service.cli.bench_output import caption, fmt


def pipeline_table(console: Console, result: dict[str, Any]) -> None:
    table = Table(title=f"shoal bench pipeline: {result['model']}", caption=caption(result))
    table.add_column("what")
    table.add_column("samples/s", justify="right")
    table.add_column("vs ideal", justify="right")
    ideal = result["ideal_samples_per_s"]
    rows = [
        (
            f"PyTorch, 1 process, {result['single_process_threads']} threads",
            result["single_process_samples_per_s"],
        ),
        ("PyTorch, 1 process, 1 thread (one device)", result["single_thread_samples_per_s"]),
        (
            f"PyTorch, 1 thread each, {result['devices']} side by side",
            result["side_by_side_thread_samples_per_s"],
        ),
        (f"ideal: 1 device x {result['devices']} x m/(m+p-1)", ideal),
        ("ideal from the side-by-side thread", result["side_by_side_ideal_samples_per_s"]),
        ("Shoal, 2 stages on 2 devices", result["shoal_samples_per_s"]),
        ("torch.distributed.pipelining (gloo)", result["torch_pipelining_samples_per_s"]),
    ]
    for name, value in rows:
        table.add_row(name, fmt(value), fmt(value / ideal, 2) if ideal else "-")
    console.print(table)
    console.print(
        f"medians of {len(result['rounds'])} rounds' ratios: efficiency"
        f" {result['efficiency']:.2f} of ideal"
        f" ({result['side_by_side_efficiency']:.2f} of the side-by-side ideal); framework"
        f" overhead {result['overhead_ms_per_microbatch']:.2f} ms per micro-batch"
    )


def transport_table(
    console: Console, result: dict[str, Any], sizes: Sequence[int], inflight: int
) -> None:
    table = Table(
        title="shoal bench transport: 2-actor chain, ms per value", caption=caption(result)
    )
    table.add_column("floats", justify="right")
    for name in (
        "object refs",
        "compiled graph",
        f"refs, {inflight} in flight",
        f"graph, {inflight} in flight",
        "graph speedup",
    ):
        table.add_column(name, justify="right")
    for size in sizes:
        table.add_row(
            f"{size:,}",
            fmt(result["object_ref_chain_ms"][size], 3),
            fmt(result["compiled_graph_chain_ms"][size], 3),
            fmt(result["object_ref_chain_inflight_ms"][size], 3),
            fmt(result["compiled_graph_chain_inflight_ms"][size], 3),
            f"{result['compiled_graph_speedup'][size]:.2f}x",
        )
    console.print(table)
    big = max(sizes)
    console.print(
        f"one actor call with {big:,} floats: torch tensor"
        f" {result['torch_tensor_call_ms']:.2f} ms, numpy array"
        f" {result['numpy_array_call_ms']:.2f} ms ({result['numpy_speedup']:.2f}x);"
        f" faster chain: {result['faster_chain']}"
    )
    links = result["link_round_trip_ms"]
    for size in sizes:
        console.print(
            f"pipeline link round trip, {size:,} floats: socket {links['socket'][size]:.3f} ms,"
            f" gloo {links['gloo'][size]:.3f} ms"
            f" ({result['socket_link_speedup'][size]:.2f}x)"
        )


def elastic_table(console: Console, result: dict[str, Any]) -> None:
    table = Table(title="shoal bench elastic", caption=caption(result))
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("static even cut, samples/s", fmt(result["static_samples_per_s"])),
        ("Shoal with rebalancing, samples/s", fmt(result["shoal_samples_per_s"])),
        ("best cut for the measured speeds, samples/s", fmt(result["best_samples_per_s"])),
        ("Shoal / best", fmt(result["shoal_over_best"], 2)),
        ("steps until the first re-cut", str(result["steps_to_rebalance"])),
        ("node killed: seconds to the next step", fmt(result["recovery_seconds"], 2)),
        ("steps replayed", str(result["steps_replayed"])),
        ("node added: seconds until used", fmt(result["growth_seconds"], 2)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


def sharp_tables(console: Console, result: dict[str, Any]) -> None:
    total, train = result["sequential_seconds"], result["sequential_train_seconds"]
    real = Table(title=f"shoal bench sharp: {result['model']}", caption=caption(result))
    real.add_column(f"on 2 devices ({result['device']})")
    real.add_column("seconds", justify="right")
    real.add_column("speedup", justify="right")
    real.add_column("training only", justify="right")
    real.add_column("speedup", justify="right")
    for name, key in (
        ("one after another, plain model parallelism", "sequential"),
        ("SHARP, Sharded-LRTF", "sharp"),
        ("SHARP, prefetch off", "no_prefetch"),
    ):
        seconds, training = result[f"{key}_seconds"], result[f"{key}_train_seconds"]
        real.add_row(
            name,
            fmt(seconds, 2),
            f"{total / seconds:.2f}x" if seconds > 0 else "-",
            fmt(training, 2),
            f"{train / training:.2f}x" if training > 0 else "-",
        )
    console.print(real)
    local, busy = result["sim_two_devices"], result["sharp_device_busy"]
    working = result["sharp_worker_busy"]
    console.print(
        f"SHARP's devices computing {' and '.join(f'{b:.2f}' for b in busy)} of the time,"
        f" their workers in tasks {' and '.join(f'{w:.2f}' for w in working)};"
        f" the simulator, same shards at their measured task times and the executor's"
        f" measured latency ({local['latency_s'] * 1e3:.1f} ms), free copies:"
        f" {local['lrtf_mean_utilization']:.2f} busy,"
        f" {local['speedup_vs_model_parallel']:.2f}x over model parallelism"
    )
    rows = result["sim_settings"]
    strategies = list(rows[0]["results"])
    sim = Table(title="simulated: makespan / lower bound")
    sim.add_column("setting")
    for strategy in strategies:
        sim.add_column(strategy, justify="right")
    for row in rows:
        name = f"{row['name']} ({row['devices']} devices, {row['models']} models)"
        sim.add_row(name, *(fmt(row["results"][s]["ratio"], 3) for s in strategies))
    console.print(sim)
    scale = result["sim_scale"]
    console.print(
        f"{scale['devices']:,} devices x {scale['models']:,} models simulated with"
        f" Sharded-LRTF in {result['sim_1024_devices_seconds']:.2f} s"
        f" ({scale['lrtf_ratio']:.3f}x the lower bound)"
    )


def dashboard_table(console: Console, result: dict[str, Any], jobs: int, repeats: int) -> None:
    m = result["machine"]
    table = Table(
        title=f"shoal bench dashboard: the jobs page with {jobs} jobs",
        caption=f"{m['date']}, {m['cpus']} cpus, load {m['load_average_1m']}, medians of"
        f" {repeats} runs",
    )
    table.add_column("measured")
    table.add_column("median ms", justify="right")
    table.add_column("runs (ms)")
    for name, key in (
        ("navigation to every row shown", "page_ready_ms"),
        ("the list request alone (peer)", "list_request_ms"),
    ):
        runs = ", ".join(fmt(v) for v in result[f"{key}_runs"])
        table.add_row(name, fmt(result[key]), runs)
    console.print(table)


def api_table(console: Console, result: dict[str, Any]) -> None:
    s, m = result["settings"], result["machine"]
    backend = "PostgreSQL" if s["database_url"] else "SQLite"
    table = Table(
        title=f"shoal bench api: {s['clients']} clients for {s['duration_s']:g} s, {backend},"
        f" {s['workers']} worker(s)",
        caption=f"{m['date']}, {m['cpus']} cpus, load {m['load_average_1m']}, {result['wall_s']} s",
    )
    table.add_column("what")
    table.add_column("requests", justify="right")
    table.add_column("per s", justify="right")
    table.add_column("p50 ms", justify="right")
    table.add_column("p99 ms", justify="right")
    seconds = result["load_seconds"] or 1.0
    table.add_row(
        "status + listing",
        f"{result['requests']:,}",
        fmt(result["status_requests_per_s"]),
        fmt(result["p50_ms"], 2),
        fmt(result["p99_ms"], 2),
    )
    for name, key in (("GET /jobs/{id}", "status"), ("GET /jobs?limit=50", "list")):
        count = result[f"{key}_requests"]
        table.add_row(
            f"  {name}",
            f"{count:,}",
            fmt(count / seconds),
            fmt(result[f"{key}_p50_ms"], 2),
            fmt(result[f"{key}_p99_ms"], 2),
        )
    table.add_row(
        "POST /jobs, each key twice",
        f"{result['submit_requests']:,}",
        fmt(result["submit_requests"] / (result["submit_seconds"] or 1.0)),
        fmt(result["submit_p50_ms"], 2),
        fmt(result["submit_p99_ms"], 2),
    )
    console.print(table)
    during = result["during_load"]
    console.print(
        f"{result['jobs_created']} jobs created for {result['submissions']} keys;"
        f" {result['errors']} errors. CPU seconds during the status load: server"
        f" {during['server_cpu_s']}, load generator {during['load_generator_cpu_s']}"
        f" (load {during['load_average_1m']})"
    )
