"""What a chaos soak reports: the summary (faults injected and survived, per kind, mode and phase; which
invariants broke) and its rich rendering — one row per trial, then the summary line. Knows nothing about how
trials run.
"""

from __future__ import annotations

from collections import Counter

from rich.markup import escape
from rich.table import Table

COLUMNS = ("#", "fault", "phase", "mode", "target", "hit", "outcome", "generations", "downtime", "steps lost",
           "invariant failures")


def summarize(results: list[dict], *, seed: int | None, wall_s: float) -> dict:
    def group(key) -> dict:
        out: dict[str, dict] = {}
        for r in results:
            g = out.setdefault(key(r), {"trials": 0, "survived": 0, "faults": 0, "faults_survived": 0})
            n = len(r["delivered"])
            g["trials"] += 1
            g["faults"] += n
            if r["outcome"] == "survived":
                g["survived"] += 1
                g["faults_survived"] += n
        return dict(sorted(out.items()))

    injected = sum(len(r["delivered"]) for r in results)
    survived = sum(len(r["delivered"]) for r in results if r["outcome"] == "survived")
    broken = Counter(k for r in results for k in r["failures"])
    return {"summary": {
        "seed": seed, "trials": len(results), "trials_failed": sum(r["outcome"] != "survived" for r in results),
        "faults_injected": injected, "faults_survived": survived, "wall_s": round(wall_s, 1),
        "per_kind": group(lambda r: r["trial"]["kind"]), "per_mode": group(lambda r: r["trial"]["mode"]),
        "per_phase": group(lambda r: r["trial"]["phase"]), "invariants_broken": dict(broken)}}


def target(trial: dict) -> str:
    ranks = [f"rank {trial['rank']}"]
    if trial.get("other") is not None:
        ranks.append(f"rank {trial['other']}" + (f" +{trial['delay_s']:g}s" if trial.get("delay_s") else ""))
    if trial.get("first") is not None:
        ranks.insert(0, f"(first: rank {trial['first']})")
    return ", ".join(ranks)


def row(r: dict) -> list[str]:
    t = r["trial"]
    failures = "; ".join(f"{k}: {escape(m[:160])}" for k, v in r["failures"].items() for m in v[:2])
    outcome = "[green]survived[/]" if r["outcome"] == "survived" else "[red]FAILED[/]"
    gens = f"{r.get('generations', '-')}" + (f" {','.join(o or '-' for o in r.get('outcomes', []))}"
                                           if r.get("outcomes") else "")
    lost = "-" if r.get("steps_lost") is None else f"{r['steps_lost']} (≤{r.get('steps_allowed')})"
    downtime = "-" if r.get("downtime_s") is None else f"{r['downtime_s']:.1f} s"
    return [str(t["index"]), t["kind"], t["phase"], f"{t['mode']}/{t['layout']}", target(t),
            str(r.get("hit") or "-"), outcome, gens, downtime, lost, failures or "-"]


def trials_table(results: list[dict], title: str = "chaos soak") -> Table:
    table = Table(title=title)
    for name in COLUMNS:
        table.add_column(name, overflow="fold")
    for r in results:
        table.add_row(*row(r))
    return table


def summary_line(report: dict) -> str:
    s = report["summary"]
    line = (f"{s['faults_injected']} faults injected, {s['faults_survived']} survived "
            f"({s['trials'] - s['trials_failed']}/{s['trials']} trials, seed {s['seed']}, {s['wall_s']:.0f} s)")
    if s["invariants_broken"]:
        line += "; invariants broken: " + ", ".join(f"{k} ×{n}" for k, n in s["invariants_broken"].items())
    if report.get("left_running"):
        line += f"; LEFT RUNNING after delete: {report['left_running']}"
    if report.get("error"):
        line += f"; soak stopped: {report['error']}"
    return line
