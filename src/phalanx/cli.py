"""The `phalanx` command (typer + rich). Thin: parses arguments and calls the Python API."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from phalanx.control.client.cli import cluster_app, fault_app, observe
from phalanx.control.client.job_cli import job_app
from phalanx.data.cli import data_app

app = typer.Typer(help="Phalanx: self-healing foundation-model training on PyTorch.", no_args_is_help=True)
app.add_typer(data_app, name="data")
app.add_typer(cluster_app, name="cluster")
app.add_typer(fault_app, name="fault")
app.add_typer(job_app, name="job")
app.command("observe")(observe)
err_console = Console(stderr=True, highlight=False)


@app.command("agent")
def agent(
    controller: str = typer.Option(..., "--controller", help="the controller's API URL (`phalanx cluster describe`)"),
    token_file: Optional[Path] = typer.Option(None, "--token-file", exists=True, dir_okay=False,
                                              help="a copy of the cluster's token file (default: the "
                                                   "environment's PHALANX_CLUSTER_TOKEN)"),
    group: str = typer.Option(..., "--group", help="the instance group this host joins"),
    name: Optional[str] = typer.Option(None, "--name", help="a particular waiting node (default: the group's first)"),
    work_root: Path = typer.Option(Path("~/.phalanx/agents"), "--work-root", help="node work dirs go under it"),
    address: Optional[str] = typer.Option(None, "--address", help="the address peers reach this host at (default: "
                                                                 "the source address of the route to the controller)"),
    ifname: Optional[str] = typer.Option(None, "--ifname", help="the interface gloo/NCCL use (default: the one "
                                                               "holding --address)"),
) -> None:
    """Run this host as a node of a cluster whose nodes join from their hosts (`backend: hosts`): claims a
    waiting node of GROUP, then heartbeats, runs its lifecycle script, health checks and workers until the
    controller says terminate."""
    from phalanx.control.agent.node_agent import main as agent_main

    argv = ["--join", controller, "--group", group, "--work-root", str(work_root.expanduser())]
    for flag, value in (("--token-file", token_file and str(token_file)), ("--name", name), ("--address", address),
                        ("--ifname", ifname)):
        if value:
            argv += [flag, value]
    raise typer.Exit(agent_main(argv))


@app.command(context_settings={"allow_extra_args": False})
def train(
    config: Path = typer.Argument(..., help="training config YAML (see recipes/)"),
    overrides: Optional[list[str]] = typer.Argument(None, help="key.sub=value overrides, e.g. training.max_steps=30"),
    nproc: int = typer.Option(1, "--nproc", "-n", help="worker processes on this machine"),
    threads: Optional[int] = typer.Option(None, help="CPU threads per worker (default: cores ÷ nproc)"),
) -> None:
    """Train on N local worker processes (gloo on CPU, NCCL on GPU)."""
    from phalanx.data import DataError
    from phalanx.parallel import ParallelConfigError
    from phalanx.train.config import ConfigError, load_config
    from phalanx.train.launch import launch

    try:
        cfg = load_config(config, overrides or [])
        code = launch(cfg, nproc, threads_per_worker=threads)
    except (ConfigError, DataError, ParallelConfigError) as err:
        err_console.print(f"[red]error:[/] {escape(str(err))}", soft_wrap=True)
        raise typer.Exit(2) from None
    if code == 0:
        _print_summary(cfg.run_dir)
    raise typer.Exit(code)


@app.command("export-hf")
def export_hf_command(
    checkpoint: Path = typer.Argument(..., help="run dir, its checkpoints dir, or one step-NNNNNNNN dir"),
    out: Path = typer.Argument(..., help="new Hugging Face model directory"),
    config: Optional[Path] = typer.Option(None, help="the run's config.json or YAML recipe (default: the model "
                                          "config the checkpoint recorded, else config.json next to the run)"),
    bf16: bool = typer.Option(False, "--bf16", help="write bfloat16 weights"),
    overwrite: bool = typer.Option(False, help="replace an existing HF checkpoint at OUT"),
) -> None:
    """Export a committed checkpoint's model weights as a Hugging Face directory (safetensors)."""
    import torch

    from phalanx.models.hf import HFFormatError
    from phalanx.train.config import ConfigError
    from phalanx.train.export import export_hf

    def warn(message: str) -> None:
        err_console.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)

    try:
        path = export_hf(checkpoint, out, config_path=config, dtype=torch.bfloat16 if bf16 else None,
                         overwrite=overwrite, warn=warn)
    except (ConfigError, HFFormatError) as err:
        err_console.print(f"[red]error:[/] {escape(str(err))}", soft_wrap=True)
        raise typer.Exit(2) from None
    Console().print(f"wrote {path}")


@app.command()
def demo(
    recipe: Path = typer.Argument(Path("recipes/tiny-llama.yaml"), help="training recipe to run"),
    run_dir: Path = typer.Option(Path("runs/demo"), "--run-dir", help="where the run, its checkpoints and the "
                                 "demo cluster's state go"),
    nodes: int = typer.Option(4, "--nodes", min=2, help="worker nodes (one training process each), plus 1 spare"),
    recovery: str = typer.Option("checkpointless", "--recovery", help="checkpointless (survivors keep running, "
                                 "state from peers' memory) or restart (everyone restarts from the checkpoint)"),
    elastic: bool = typer.Option(False, "--elastic", help="an elastic job instead: it grows when a node is added, "
                                 "shrinks in place on a node failure and for a higher-priority job, and grows back"),
    overrides: list[str] = typer.Argument(None, help="config overrides, key=value"),
) -> None:
    """Create a local cluster, train RECIPE with auto-resume, kill a node halfway, show the recovery, delete it
    (`--elastic`: resize an elastic job through every kind of change instead)."""
    from phalanx.control.client.cluster import ClusterError
    from phalanx.control.client.jobs import JobError
    from phalanx.data import DataError
    from phalanx.demo import run_demo
    from phalanx.train.config import ConfigError

    try:
        if recovery not in ("checkpointless", "restart"):
            raise JobError(f"--recovery {recovery!r}: choose checkpointless or restart")
        if elastic:
            from phalanx.demo_elastic import run_elastic_demo

            run_elastic_demo(recipe, run_dir, nodes=nodes, overrides=list(overrides or []))
        else:
            run_demo(recipe, run_dir, nodes=nodes, overrides=list(overrides or []), recovery=recovery)
    except (ConfigError, DataError, ClusterError, JobError, RuntimeError) as err:
        err_console.print(f"[red]error:[/] {err}")
        raise typer.Exit(1) from None


@app.command()
def chaos(
    seed: int = typer.Option(0, "--seed", help="the plan's random seed (same seed, same trials)"),
    trials: int = typer.Option(18, "--trials", min=1, help="trials to run (each: one job, its faults, the checks)"),
    duration: Optional[float] = typer.Option(None, "--duration", help="stop starting trials after this many "
                                             "seconds"),
    recovery: str = typer.Option("both", "--recovery", help="checkpointless, restart or both"),
    layouts: str = typer.Option("hsdp", "--layouts", help="checkpointless layouts, comma-separated: hsdp (2 "
                                "replicas × 2 shards), fsdp (buddy snapshots)"),
    ci: bool = typer.Option(False, "--ci", help="the fixed CI list instead of a drawn plan: every fault kind "
                            "once, both modes, every phase"),
    nodes: int = typer.Option(4, "--nodes", min=4, help="worker nodes, one rank each (even: HSDP is 2 replicas × "
                              "nodes/2 shards)"),
    spares: int = typer.Option(2, "--spares", min=2, help="spare nodes (two faults at once need two)"),
    work_dir: Path = typer.Option(Path("runs/chaos"), "--work-dir", help="runs, evidence and the cluster's "
                                  "state (its PHALANX_HOME)"),
    out: Optional[Path] = typer.Option(None, "--out", help="write the JSON report here"),
    only: Optional[list[int]] = typer.Option(None, "--only", help="run only these trials of the plan (by number; "
                                             "repeatable), e.g. to reproduce a failure"),
) -> None:
    """Inject faults (kind × phase × recovery mode, seeded) into training jobs on a local cluster and check the
    invariants after each: finished, same losses as a failure-free run, steps lost within the mode's bound,
    nothing leaked, consistent events. Exit 1 if any invariant failed."""
    import json

    from rich.markup import escape

    from phalanx.chaos import JobShape, Settings, SoakError, ci_plan, make_plan, run_soak
    from phalanx.chaos.report import row, summary_line, trials_table
    from phalanx.control.client.cli import WideConsole
    from phalanx.control.client.cluster import ClusterError
    from phalanx.control.client.jobs import JobError

    console = WideConsole(highlight=False)  # a piped or logged table keeps its width
    modes = {"both": ("checkpointless", "restart"), "checkpointless": ("checkpointless",),
             "restart": ("restart",)}.get(recovery)
    chosen = tuple(x.strip() for x in layouts.split(",") if x.strip())
    if modes is None or not chosen or any(x not in ("hsdp", "fsdp") for x in chosen):
        err_console.print(f"[red]error:[/] --recovery {escape(recovery)} --layouts {escape(layouts)}: choose "
                          f"checkpointless, restart or both; hsdp and/or fsdp")
        raise typer.Exit(2)
    if nodes % 2:
        err_console.print(f"[red]error:[/] --nodes {nodes}: use an even number (HSDP is 2 replicas × nodes/2 shards)")
        raise typer.Exit(2)
    shape = JobShape(world=nodes)
    plan = ci_plan(shape) if ci else make_plan(seed, trials if duration is None else max(trials, 1000),
                                               modes=modes, layouts=chosen, shape=shape)
    if ci:
        plan = [t for t in plan if t.mode in modes]
    if only:
        plan = [t for t in plan if t.index in set(only)]

    def on_trial(result: dict) -> None:
        console.print(" | ".join(row(result)))

    try:
        report = run_soak(plan, work_dir, Settings(nodes=nodes, spares=spares, shape=shape),
                          seed=None if ci else seed, home=work_dir / "home", duration_s=duration,
                          say=lambda m: console.print(f"[dim]{escape(m)}[/]"), on_trial=on_trial)
    except (SoakError, ClusterError, JobError) as err:
        err_console.print(f"[red]error:[/] {escape(str(err))}", soft_wrap=True)
        raise typer.Exit(1) from None
    console.print(trials_table(report["trials"]))
    console.print(summary_line(report))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str) + "\n")
        console.print(f"report: {out}")
    raise typer.Exit(0 if report["summary"]["ok"] else 1)


def _print_summary(run_dir: Path) -> None:
    from rich.table import Table

    from phalanx.train.metrics import read_metrics

    steps, events = read_metrics(run_dir)
    if not steps:
        return
    table = Table(title=f"run {run_dir}", show_header=False)
    first, last = steps[0], steps[-1]
    median_tps = sorted(s["tokens_per_s"] for s in steps)[len(steps) // 2]
    table.add_row("steps", f"{last['step']}")
    table.add_row("loss", f"{first['loss']:.4f} → {last['loss']:.4f}")
    table.add_row("samples consumed", f"{last['samples_consumed']}")
    table.add_row("median tokens/s", f"{median_tps:,.0f}")
    table.add_row("checkpoints saved", str(sum(e["event"] == "checkpoint_saved" for e in events)))
    table.add_row("resumes", str(sum(e["event"] == "resumed" for e in events)))
    table.add_row("metrics", str(Path(run_dir) / "metrics.jsonl"))
    Console().print(table)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
