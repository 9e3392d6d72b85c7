"""``lowcomm bench``: all-reduce, step, memory and compression benchmarks beside vendor MPI,
Horovod and torch gloo, in one run."""
from __future__ import annotations

import json

import click

from .common import config_options, load_cfg as _config, pass_options, world as _world, write_json


@click.group()
def bench():
    """Benchmarks beside vendor MPI, Horovod and torch gloo, in one run."""


@bench.command("allreduce")
@click.option("--sizes", default="4K,1M,16M", show_default=True, help="Bytes per buffer (K, M, G).")
@click.option("--algorithms", default="mpi,ring,rabenseifner,tree,shm,shm-registered,auto,horovod,gloo,memcpy",
              show_default=True, help="Rows; 'memcpy' is the memory-bandwidth floor: each rank "
              "writes the result from a buffer that holds it (one copy, no communication).")
@click.option("--iters", default=20, show_default=True)
@click.option("--warmup", default=3, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write rows here.")
@click.option("--autotune", "--tune", "tune", is_flag=True,
              help="Measure every candidate of algorithm=auto at --tune-sizes and write the table "
                   "auto reads (then the sizes/algorithms run as usual). Under mpirun write "
                   "--autotune: Open MPI's mpirun takes '--tune FILE' for itself wherever it appears.")
@click.option("--tune-sizes", default="4K,16K,64K,256K,1M,4M,16M,64M", show_default=True,
              help="The sizes --tune measures.")
@click.option("--table", "table", type=click.Path(dir_okay=False), default=None,
              help="The auto table to write (--tune) and read [default: $LOWCOMM_ALLREDUCE_TABLE, "
                   "else ~/.cache/lowcomm/allreduce-<host>-<ranks>.json].")
@pass_options()
def bench_allreduce(opts):
    """All-reduce time, algbw and busbw per size and algorithm (nccl-tests style); the auto row
    says which algorithm it ran and its time against the fastest other row's."""
    import os

    from ..tools.bench import bench_allreduce as run, format_allreduce, parse_size, tune_allreduce
    from ..comm.tuning import TABLE_ENV
    try:
        size_list = [parse_size(s) for s in opts.sizes.split(",")]
        tune_list = [parse_size(s) for s in opts.tune_sizes.split(",")]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--sizes/--tune-sizes") from None
    if opts.table:
        os.environ[TABLE_ENV] = opts.table       # every rank parses the same command line
    comm = _world()
    if opts.tune:
        tuned, where = tune_allreduce(comm, tune_list, max(3, opts.iters // 2), opts.warmup)
        if comm.rank == 0:
            click.echo(f"tuned on {comm.size} ranks, median of {max(3, opts.iters // 2)}; wrote {where}")
            click.echo(format_allreduce(tuned))
    rows = run(comm, size_list, opts.algorithms.split(","), opts.iters, opts.warmup)
    if comm.rank == 0:
        click.echo(f"all-reduce, float32, {comm.size} ranks, median of {opts.iters} iterations")
        click.echo(format_allreduce(rows))
        write_json(opts.json_path, rows)


@bench.command("step")
@config_options
@click.option("--strategies", default="syncdp,ddp-gloo,syncdp-fp16,ddp-gloo-fp16,syncdp-int8,"
              "syncdp-powersgd,ddp-gloo-powersgd,horovod,local", show_default=True,
              help="Rows, in order; 'local' sends nothing: the compute floor under all of them.")
@click.option("--steps", default=20, show_default=True)
@click.option("--warmup", default=5, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write rows here.")
def bench_step(config, overrides, strategies, steps, warmup, json_path):
    """Median training-step time under lowcomm SyncDP, Horovod and torch DDP (gloo), beside
    a step with no communication at all (``local``, the floor)."""
    cfg = _config(config, overrides)
    from ..tools.bench import bench_step as run, format_step
    comm = _world()
    rows = run(comm, cfg, strategies.split(","), steps, warmup)
    if comm.rank == 0:
        click.echo(f"training step of {cfg.model.name} (batch {cfg.batch_size}x{cfg.data.seq_len} "
                   f"per rank), {comm.size} ranks, median of {steps} steps")
        click.echo(format_step(rows))
        write_json(json_path, rows)


@bench.command("memory")
@config_options
@click.option("--method", "methods", multiple=True, show_default=True,
              default=("syncdp", "zero1", "zero2", "fsdp", "dc=diloco:period=50;rank=zero2@dc:2,rank:K/2"),
              help="A row (repeat the option): a spec, or LEVEL=SPEC;...@TOPOLOGY for an outer "
              "loop over a sharded level (K/2 in a topology: half the rank count).")
@click.option("--ranks", default="1,2,4,8", show_default=True, help="Rank counts K, each its own mpirun.")
@click.option("--max-memory-gib", type=float, default=0.0, help="With --shapes: the per-rank cap.")
@click.option("--shapes", default="", help="D_MODEL:N_LAYERS,... smallest first: find the largest "
              "that trains one step under --max-memory-gib, per method, at the largest K.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the model and batches live (cuda: a GPU per rank, rank modulo the "
              "node's GPUs; the peak is then torch.cuda.max_memory_allocated).")
@click.option("--timeout", "timeout_s", type=float, default=600, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write rows here.")
@click.option("--one", hidden=True, default="", help="(a worker: this method in this mpirun)")
@pass_options()
def bench_memory(opts):
    """Parameter, gradient and optimizer-state bytes per rank and the peak memory of each method
    at K ranks, beside the ideal 1/K; with --shapes, the largest GPT each trains under a cap."""
    from ..tools import memory_bench as mb
    if opts.one:
        comm = _world()
        row = mb.measure_one(comm, _config(opts.config, opts.overrides), opts.one, opts.device)
        if comm.rank == 0:
            click.echo("ROW " + json.dumps(row))
        return
    _config(opts.config, opts.overrides)                     # bad keys fail here, before any launch
    Ks = [int(k) for k in opts.ranks.split(",")]
    rows_of = lambda K: [m.replace("K/2", str(max(1, K // 2))) for m in opts.methods  # noqa: E731
                         if "@" not in m or K >= 2 and K % 2 == 0]
    launch = mb.Rows(opts.config, tuple(opts.overrides), opts.timeout_s, opts.device)
    rows = mb.table(launch, rows_of, Ks)
    click.echo("memory per rank (the largest rank's) after one step; ideal: the first row's total / K")
    click.echo(mb.format_table(rows))
    out = {"table": rows}
    if opts.shapes:
        big = mb.largest(launch, rows_of(max(Ks)), max(Ks), opts.shapes.split(","),
                         opts.max_memory_gib)
        click.echo(mb.format_largest(big))
        out["largest"] = big
    write_json(opts.json_path, out)


@bench.command("compress")
@config_options
@click.option("--size", default="16M", show_default=True, help="Gradient bytes (float32; K, M, G).")
@click.option("--methods", default="pack,fp16,bf16,int8,qsgd,topk,randomk,sign,sign-mv,ef-sign,powersgd",
              show_default=True, help="Compressor names; 'pack' times the bit packing alone.")
@click.option("--iters", default=10, show_default=True)
@click.option("--warmup", default=2, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="torch threads (one: a rank's share of a node).")
@click.option("--link-gbit", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, help="Link of the break-even column (Gbit/s).")
@click.option("--clock", type=click.Choice(["wall", "cpu"]), default="wall", show_default=True,
              help="wall: perf_counter; cpu: the thread's CPU time (steadier on a busy machine).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write rows here.")
@pass_options()
def bench_compress(opts):
    """Compress / decompress GB/s of each compressor beside a memcpy of the same bytes (one
    process; the [compressor] keys of --config/--set give ratio, levels, approx_rank, ...), and
    its break-even: compress + decompress time against the time the bytes it saves take on a
    --link-gbit link."""
    import torch

    from ..tools.bench import parse_size
    from ..tools.compress_bench import bench_compress as run, format_compress
    cfg = _config(opts.config, opts.overrides)
    try:
        numel = parse_size(opts.size) // 4
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--size") from None
    if numel < 1:
        raise click.BadParameter(f"{opts.size!r} holds no float32 element", param_hint="--size")
    torch.set_num_threads(opts.threads)
    try:
        rows = run(opts.methods.split(","), numel, opts.iters, opts.warmup, cfg.compressor, opts.link_gbit, opts.clock)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--methods") from None
    click.echo(f"compress/decompress of a {numel * 4 / 2**20:.1f} MiB float32 gradient, "
               f"{torch.get_num_threads()} thread(s), median of {opts.iters} ({opts.clock} clock, a memcpy timed "
               f"before each call); GB/s of gradient bytes")
    click.echo(format_compress(rows))
    write_json(opts.json_path, rows)
