"""The evaluation report: `report.json` (schema "draftsmith.eval/1", read by other tools), written with
`report.md` (tables a person reads: eval/report_markdown.py) and its plots (eval/plots.py); W&B where asked.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from eval.plots import plot_batch_curves, plot_engine_k, plot_histograms
from eval.report_markdown import markdown

SCHEMA = "draftsmith.eval/1"


def hardware() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
    }
    return info


def build_report(rows: list[dict], *, target: str, baseline: str, settings: dict,
                 engine_rows: list[dict] | None = None) -> dict:
    """The report.json document: `results`, draftsmith's rows (with the engine's figures where measured), and
    `engine_results`, the rows of drafters only the engine runs (llama.cpp's n-gram modes)."""
    return {
        "schema": SCHEMA,
        "target": target,
        "baseline": baseline,
        "hardware": hardware(),
        "settings": settings,
        "results": rows,
        "engine_results": engine_rows or [],
    }


def next_report_dir(parent: str | Path) -> Path:
    """`<parent>/report-N`, one past the highest N there, for scripts that evaluate the same checkpoints
    again: every evaluation keeps its own report beside the earlier ones."""
    parent = Path(parent)
    taken = [int(p.name[len("report-"):]) for p in parent.glob("report-*") if p.name[len("report-"):].isdigit()]
    return parent / f"report-{max(taken, default=0) + 1}"


def write_report(report: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write report.json, report.md and the histogram PNGs into out_dir; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "report.json", "md": out_dir / "report.md"}

    def write(key: str, text: str) -> None:  # to a temporary name, then renamed: never a half-written report
        tmp = paths[key].with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(paths[key])

    # The measurement first: a failure drawing or rendering it afterwards loses nothing measured.
    write("json", json.dumps(report, indent=2) + "\n")
    for p in [*plot_batch_curves(report, out_dir), *plot_engine_k(report, out_dir)]:  # before report.md, which links them
        paths[p.stem] = p
    report = {**report, "plots": sorted(p for p in paths if p.startswith(("batch_curve_", "engine_k_")))}
    report["plots"] = [f"{name}.png" for name in report["plots"]]
    write("json", json.dumps(report, indent=2) + "\n")
    write("md", markdown(report))
    for p in plot_histograms(report, out_dir):
        paths[p.stem] = p
    return paths


def log_to_wandb(report: dict, paths: dict[str, Path], *, project: str, entity: str | None, config: dict,
                 run_dir: str | Path) -> None:
    """Log the result rows and histograms to Weights & Biases; offline when there is no API key.

    The key itself is never printed or logged: wandb reads it from the environment.
    """
    import wandb  # optional: only with tracking.wandb=true

    mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    run = wandb.init(project=project, entity=entity, config=config, dir=str(run_dir), mode=mode, job_type="eval")
    # Lists (histograms, positions, intervals) do not fit a table cell; an interval is None in some rows.
    # llama.cpp alone (engine.only) has the engine's rows only.
    rows = report["results"] or report["engine_results"]
    columns = [c for c in rows[0] if not any(isinstance(r.get(c), list) for r in rows)]
    run.log({
        "results": wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows]),
        **{f"accept_hist/{name}": wandb.Image(str(p)) for name, p in paths.items() if p.suffix == ".png"},
    })
    run.finish()
