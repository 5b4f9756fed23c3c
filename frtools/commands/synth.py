"""``frtools synth``: simulate a large job's flight records with one known fault."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from frtools.model.ranks import RankTextError, parse_ranks
from frtools.synth import FAULTS, FaultError, LayoutError, ModelShape, synthesize


def _fault_ranks(value: str | None) -> list[int] | None:
    if not value:
        return None
    try:
        return list(parse_ranks(value))
    except RankTextError:
        click.echo(f"error: --fault-ranks: expected comma-separated ranks, got {value!r}", err=True)
        sys.exit(2)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"


@click.command(name="synth")
@click.option(
    "-o",
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Directory to write the dumps and truth.json into.",
)
@click.option(
    "-n",
    "--world-size",
    default=64,
    show_default=True,
    type=click.IntRange(2, 1 << 20),
    help="Number of ranks.",
)
@click.option(
    "--tp", default=1, show_default=True, type=click.IntRange(1), help="Tensor-parallel size."
)
@click.option(
    "--pp", default=1, show_default=True, type=click.IntRange(1), help="Pipeline-parallel size."
)
@click.option(
    "--dp", default=None, type=click.IntRange(1), help="Data-parallel size [default: what is left]."
)
@click.option(
    "--ep", default=1, show_default=True, type=click.IntRange(1), help="Expert-parallel size."
)
@click.option(
    "--cp", default=1, show_default=True, type=click.IntRange(1), help="Context-parallel size."
)
@click.option(
    "--fault",
    type=click.Choice(FAULTS),
    default="healthy",
    show_default=True,
    help="The fault to inject.",
)
@click.option("--fault-ranks", default=None, help="Comma-separated faulty ranks [default: random].")
@click.option(
    "--faulty",
    default=1,
    show_default=True,
    type=click.IntRange(1, 2),
    help="How many random ranks are faulty (without --fault-ranks).",
)
@click.option(
    "--seed", default=0, show_default=True, type=int, help="Random seed: same seed, same dumps."
)
@click.option(
    "--buffer-size",
    default=2000,
    show_default=True,
    type=click.IntRange(1),
    help="Ring-buffer entries per rank (TORCH_FR_BUFFER_SIZE).",
)
@click.option(
    "--steps",
    default=0,
    type=click.IntRange(0),
    help="Training steps before the last one [default: enough to wrap the buffer].",
)
@click.option(
    "--layers",
    default=2,
    show_default=True,
    type=click.IntRange(1),
    help="Transformer layers per pipeline stage.",
)
@click.option(
    "--microbatches",
    default=4,
    show_default=True,
    type=click.IntRange(1),
    help="Microbatches per step.",
)
@click.option(
    "--dp-coalesced/--dp-buckets",
    default=False,
    show_default=True,
    help="Reduce gradients with one allreduce_coalesced instead of one all_reduce per bucket.",
)
@click.option(
    "--straggler-ms",
    default=30.0,
    show_default=True,
    type=click.FloatRange(0),
    help="How late a straggler calls each collective.",
)
@click.option(
    "--clock-skew-ms",
    default=0.2,
    show_default=True,
    type=click.FloatRange(0),
    help="Largest clock offset between hosts.",
)
@click.option(
    "--timing/--no-timing",
    default=True,
    show_default=True,
    help="Completed calls carry duration_ms (TORCH_NCCL_ENABLE_TIMING).",
)
@click.option(
    "--workers", default=None, type=click.IntRange(1), help="Writer processes [default: CPU count]."
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["torch", "frtools", "summary"]),
    default="torch",
    show_default=True,
    help="torch: PyTorch NCCL Flight Recorder pickles; frtools: frtools snapshots (.frt); "
    "summary: the host summaries `frtools summarize` makes of those snapshots "
    "(node<H>.summary, 8 ranks a host), without writing the snapshots.",
)
@click.option(
    "--window",
    default=64,
    show_default=True,
    type=click.IntRange(1, 3840),
    help="With --format summary: the last ops kept per rank.",
)
@click.option("--force", is_flag=True, help="Write into a directory that already holds files.")
def synth(
    out_dir: str,
    world_size: int,
    tp: int,
    pp: int,
    dp: int | None,
    ep: int,
    cp: int,
    fault: str,
    fault_ranks: str | None,
    faulty: int,
    seed: int,
    buffer_size: int,
    steps: int,
    layers: int,
    microbatches: int,
    dp_coalesced: bool,
    straggler_ms: float,
    clock_skew_ms: float,
    timing: bool,
    workers: int | None,
    fmt: str,
    window: int,
    force: bool,
) -> None:
    """Simulate a Megatron-style job's PyTorch Flight Recorder dumps with one injected
    fault, and write truth.json: the verdict a correct diagnosis must reach."""
    from rich.console import Console

    console = Console(stderr=False, highlight=False)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not force:
        click.echo(f"error: {out}: directory is not empty (use --force to write into it)", err=True)
        sys.exit(2)
    shape = ModelShape(layers=layers, microbatches=microbatches, dp_coalesced=dp_coalesced)
    try:
        result = synthesize(
            out,
            world_size,
            tp=tp,
            pp=pp,
            dp=dp,
            ep=ep,
            cp=cp,
            fault=fault,
            fault_ranks=_fault_ranks(fault_ranks),
            n_faulty=faulty,
            seed=seed,
            buffer_size=buffer_size,
            steps=steps,
            shape=shape,
            timing=timing,
            straggler_ms=straggler_ms,
            clock_skew_ms=clock_skew_ms,
            workers=workers,
            format=fmt,
            window=window,
        )
    except (LayoutError, FaultError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except OSError as e:
        click.echo(f"error: {e.filename or out}: {e.strerror or e}", err=True)
        sys.exit(2)
    t = result.truth
    lay = t["layout"]
    console.print(
        f"Wrote {result.files} {'host summaries' if fmt == 'summary' else 'rank dumps'} ({_human_bytes(result.bytes)}) and truth.json to "
        f"{out} in {result.seconds:.1f} s"
    )
    console.print(
        f"  layout: {lay['world_size']} ranks = tp {lay['tp']} x cp {lay['cp']} x ep {lay['ep']}"
        f" x dp {lay['dp']} x pp {lay['pp']}; {t['steps']} steps, "
        f"{t['max_entries_per_rank']} entries per rank (buffer {t['buffer_size']})"
    )
    if t["kind"] == "healthy":
        console.print("  fault: none (healthy)")
    else:
        where = ""
        if t["process_group"]:
            pg = t["process_group"]
            seq = t["collective_seq_id"] if t["collective_seq_id"] is not None else t["p2p_seq_id"]
            where = f" at {t['op']} on group {pg['name']} ({pg['desc']}), seq {seq}"
        console.print(f"  fault: {t['fault']} on rank(s) {', '.join(map(str, t['guilty']))}{where}")
    console.print(f"  expected verdict: {t['kind']}, guilty {t['guilty']}")
