"""Our EAGLE-3 trainer against SpecForge's and speculators' on the same records, features and held-out set.

    python scripts/bench_peers.py --data runs/peers/smollm2.jsonl --steps 100 --seeds 3 --out runs/peers/smollm2 \
        --overrides experiment=smollm2_eagle regenerate.enabled=false
    python scripts/bench_peers.py --data tiny.jsonl --steps 4 --heldout 6 --out /tmp/peers --overrides experiment=smoke

Every trainer learns from draftsmith's own offline feature cache: the records tokenized once, the target's features
computed once (`drafter.hidden_states=offline`), the loss masks realigned so that all three learn the same
predictions (each peer's convention in scripts/peers/). Each peer runs as its own command (`specforge train`,
`speculators train`) in a subprocess, on the same threads and dataloader workers as draftsmith's; the shims a CPU
needs apply only where no accelerator is present, and no installed file of a peer is changed.

One referee measures every head, draftsmith's included: held-out greedy τ replayed on the same held-out records
(`train/heads.py` `evaluate_heldout`, the number `bench_data_scaling.py` fits) at the recipe's k, and at the depth the
head was trained for where that differs, at each head's final step. Each trainer and setting runs `--seeds` seeds;
τ is pooled over them, with a 95 % interval that resamples each trainer's seeds and the held-out records within each
category (`bootstrap`), and each peer's τ is set against draftsmith's the same way, the records paired: a ratio whose
interval holds 1 is a tie. `--summarize runs/.../peers.json` summarizes a finished run's rows again.

The peers' settings: `defaults` (their own; only the steps, the records per step and the draft vocabulary's size set),
the rungs towards `matched` one group at a time (`+lr`, `+schedule`, `+ttt`; scripts/peers/__init__.py LADDER),
`matched` (draftsmith's learning rate, warm-up, cosine schedule, TTT depth and decay, clipping, precision, draft
vocabulary, labels, records per step and sequence length; what cannot be matched is each peer's GAPS), and
`target-head` (SpecForge matched, its output head started from the target's rows as draftsmith's is). Throughput is
the real tokens of the steps' records over the seconds of the training steps, start-up and evaluation left out.
Time to τ: every trainer saves its head at `--curve` evenly spaced steps, the referee measures each, and the time to
τ is the training seconds (the steps alone, as throughput counts them) until the held-out τ first reaches 95 % of the
final step's.

Outputs: `<out>/peers.json` (every run, and the summary) and `<out>/peers.md` (the tables); each run in
`<out>/<trainer>-<settings>-s<seed>/`. A finished run is not trained again.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from hydra import compose, initialize_config_dir

from eval.engines.engine import stop_on_sigterm

sys.path.insert(1, str(Path(__file__).resolve().parent))  # scripts/peers, after the project's own packages
from peers import INSTALLED, LADDER, ROOT, curve_steps, elapsed_at, rung_settings  # noqa: E402
from peers import specforge, speculators  # noqa: E402

CONF = str(ROOT / "conf")
TRAINERS = ("draftsmith", "specforge", "speculators")
PEERS = {"specforge": specforge, "speculators": speculators}
CONTROLS = {"target-head": ("specforge",)}  # settings beyond the ladder, and the peers they apply to


@dataclass
class Row:
    trainer: str             # draftsmith | specforge | speculators
    settings: str            # a LADDER rung or a control (draftsmith: recipe)
    seed: int
    steps: int
    depth: int               # the TTT depth the head was trained for
    tokens: int              # real tokens of the records trained on, over all steps
    train_s: float           # seconds of the training steps alone
    wall_s: float            # the whole run: start-up, features read, steps, checkpoints
    tokens_per_s: float      # tokens / train_s
    heldout_tau: float       # the referee's held-out greedy τ at the recipe's k, at the final step
    heldout_tau_by_category: dict
    heldout_top1: float      # top-1 agreement of the first draft step on the held-out assistant tokens
    tau_at_depth: float | None  # the same replay at `depth`, where it differs from the recipe's k
    rounds: list             # [category, tokens, rounds] of each held-out record at the recipe's k
    curve: list              # [step, train seconds up to it, held-out τ] at each of the curve's steps
    time_to_tau_s: float | None  # train seconds until the held-out τ first reaches 95 % of its final value (None:
    #                              a curve of the final step alone, --curve 1)
    head: str                # the head measured: the trainer's export (a draftsmith head for draftsmith)
    notes: dict = field(default_factory=dict)


# --- draftsmith: its recipe, in this process ------------------------------------------------------------------


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def recipe_overrides(args, out: Path) -> list[str]:
    """The recipe every trainer's records and features come from: the caller's overrides, EAGLE-3 on offline
    features, the same held-out records, and the steps; no final evaluation (the referee measures)."""
    return [*args.overrides, "drafter=eagle", "drafter.hidden_states=offline", f"data.path={args.data}",
            "data.max_records=null", "trainer.heldout=per_category", f"trainer.eval_examples={args.heldout}",
            f"data_cache={args.data_cache or out / 'data'}", "evaluate.enabled=false", "progress=false"]


def train_draftsmith(args, out: Path, seed: int) -> dict:
    from train.__main__ import train

    run = out / f"draftsmith-recipe-s{seed}"
    steps, saves = args.steps, curve_steps(args.steps, args.curve)
    if not (run / "train_summary.json").exists():
        started = time.perf_counter()
        train(compose_cfg([*recipe_overrides(args, out), f"trainer.max_steps={steps}", f"trainer.eval_every={steps}",
                           f"trainer.checkpoint_every={saves[0]}", f"trainer.keep_checkpoints={len(saves)}",
                           f"trainer.seed={seed}", f"out_dir={run}"]))
        (run / "wall_s").write_text(f"{time.perf_counter() - started:.1f}\n")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    stepped = [r for r in rows if "step_s" in r]
    # each saved step's head, as best/ holds the last: its config beside the checkpoint's weights
    curve = []
    for step, seconds in zip(saves, elapsed_at([r["step_s"] for r in stepped], saves)):
        head = run / "curve" / f"step-{step:06d}"
        if not (head / "model.safetensors").exists():
            head.mkdir(parents=True, exist_ok=True)
            shutil.copy(run / "best" / "config.json", head / "config.json")
            (head / "model.safetensors").symlink_to(run / "checkpoints" / f"step-{step:06d}" / "model.safetensors")
        curve.append([step, seconds, str(head)])
    return {"tokens": sum(r["tokens"] for r in stepped), "train_s": sum(r["step_s"] for r in stepped),
            "wall_s": float((run / "wall_s").read_text()), "head": str(run / "best"), "curve": curve}


class Referee:
    """draftsmith's held-out measurement of any EAGLE-3 head on the run's records: the recipe set up without a
    step (its data, features, held-out set and target), its head swapped for the one measured."""

    def __init__(self, args, out: Path) -> None:
        from train.eagle3 import Eagle3Recipe

        self.recipe = Eagle3Recipe(compose_cfg([*recipe_overrides(args, out), "trainer.max_steps=0",
                                                f"out_dir={out / 'referee'}"]))
        self.recipe.setup()
        self.k = self.recipe.cfg.drafter.ttt_steps

    @property
    def layers(self) -> list[int]:
        return list(self.recipe.layers)

    @property
    def target_dir(self) -> Path:
        from eval.engines.formats.writing import target_directory
        from eval.run import target_source

        return Path(target_directory(target_source(self.recipe.cfg.target)))

    @property
    def rope_parameters(self) -> dict:
        """The target's RoPE (its full-attention one where it has one per attention type, as Gemma-3)."""
        rope = self.recipe.target.config.rope_parameters
        return rope.get("full_attention", rope)

    def feature_dirs(self) -> tuple[Path, Path]:
        """The tokenized training records and their offline features, as draftsmith's recipe trains on them."""
        return self.recipe.data_dirs["train"] / "tokenized", self.recipe.shards.dir

    def draft_vocabulary(self) -> tuple[torch.Tensor, torch.Tensor]:
        head = self.recipe.acc.unwrap_model(self.recipe.model)
        return head.d2t.detach().cpu(), head.t2d.detach().cpu()

    def record(self, rows, reader, i: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """Record i's features, and its tokens and loss mask as far as they reach: draftsmith's recipe computes
        features for the first `trainer.max_length` tokens of a record, the window it trains on."""
        item = reader[i]
        n = item["input_ids"].numel()
        ids, mask = torch.tensor(rows[i]["input_ids"][:n]), torch.tensor(rows[i]["loss_mask"][:n])
        if not torch.equal(item["input_ids"].long(), ids):
            raise ValueError(f"{reader.dir}: example {i}'s features are not tokenized record {i}'s")
        return item, ids, mask

    def measure(self, head_dir: Path, k: int | None = None) -> tuple[dict, list]:
        """The held-out replay of the head at k (the recipe's by default), and each record's (category, tokens,
        rounds)."""
        from drafters.registry import load_head

        recipe = self.recipe
        head = load_head(head_dir, recipe.target)
        head.config.ttt_steps = k or self.k
        recipe.model, recipe.best = head, None
        return recipe.evaluate_heldout(), [list(r) for r in recipe.heldout_rounds]

    def row(self, trainer: str, settings: str, seed: int, steps: int, depth: int, run: dict, notes: dict) -> Row:
        measured, rounds = self.measure(Path(run["head"]))
        at_depth = self.measure(Path(run["head"]), depth)[0]["heldout_tau_greedy"] if depth != self.k else None
        tau = round(measured["heldout_tau_greedy"], 4)
        curve = [[step, seconds, tau if step == steps else round(self.measure(Path(head))[0]["heldout_tau_greedy"], 4)]
                 for step, seconds, head in run["curve"]]
        return Row(trainer, settings, seed, steps, depth, run["tokens"], round(run["train_s"], 2), run["wall_s"],
                   round(run["tokens"] / run["train_s"], 1), tau, measured["heldout_tau_greedy_by_category"],
                   round(measured["heldout_top1"], 4), None if at_depth is None else round(at_depth, 4), rounds,
                   curve, time_to_tau(curve), run["head"], notes)


def time_to_tau(curve: list, share: float = 0.95) -> float | None:
    """The training seconds at the first saved step whose held-out τ reaches `share` of the final step's (None where
    only the final step was saved)."""
    if len(curve) < 2:
        return None
    final = curve[-1][2]
    return next(seconds for _, seconds, tau in curve if tau >= share * final)


# --- the peers -----------------------------------------------------------------------------------------------------


def peer_settings(name: str, settings: str, cfg, dtype: str) -> dict:
    module = PEERS[name]
    matched = module.matched(cfg, dtype)
    if settings == "target-head":
        return {**matched, "target_head": True}
    return {} if settings == "defaults" else rung_settings(settings, matched, module.RUNGS)


def train_peer(name: str, settings: str, seed: int, args, referee: Referee, out: Path) -> Row:
    """Convert (once per peer and dtype), train and export one peer run, and have the referee measure its export."""
    module = PEERS[name]
    run = out / f"{name}-{settings}-s{seed}"
    result_path = run / "result.json"
    cfg = referee.recipe.cfg
    dtype = "bfloat16" if referee.recipe.acc.mixed_precision == "bf16" else "float32"
    chosen = peer_settings(name, settings, cfg, dtype)
    if not result_path.exists():
        shutil.rmtree(run, ignore_errors=True)  # an unfinished run: a peer would resume its epochs from it
        tokenized, shards = referee.feature_dirs()
        if name == "specforge":
            feature_dtype = chosen.get("torch_dtype", specforge.DEFAULTS["torch_dtype"])
            data = specforge.convert(tokenized, shards, out / f"features-specforge-{feature_dtype}", feature_dtype,
                                     referee.record)
        else:
            data = speculators.convert(tokenized, shards, referee, out / "features-speculators", referee.record)
        saves = curve_steps(args.steps, args.curve)
        result = module.train(data, referee, run, args.steps, chosen, cfg.trainer.batch_size, seed, args.threads,
                              saves)
        head = module.export(Path(result["checkpoint"]), referee, run / "export")
        # the heads of the curve's earlier steps, each through the peer's own exporter; the last is `head`
        curve = [[step, seconds, str(head if step == args.steps else
                                     module.export(Path(checkpoint), referee, run / f"export-step{step}"))]
                 for step, seconds, checkpoint in result["curve"]]
        result_path.write_text(json.dumps({**result, "checkpoint": str(result["checkpoint"]), "head": str(head),
                                           "curve": curve}, indent=1) + "\n")
    result = json.loads(result_path.read_text())
    notes = {"settings": chosen, "final_loss": result.get("final_loss"),
             **({"not_matched": module.GAPS} if settings != "defaults" else {})}
    return referee.row(name, settings, seed, args.steps, module.depth(chosen), result, notes)


# --- seeds, intervals, verdicts ------------------------------------------------------------------------------------


RESAMPLES = 4000  # bootstrap draws of the intervals


def _replays(rows: list[Row], category: str | None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """A trainer and setting's held-out replay: tokens and rounds of each seed (rows) and held-out record (columns),
    the records of `category` (None: all), and each record's category."""
    keep = [i for i, (c, _, _) in enumerate(rows[0].rounds) if category in (None, c)]
    tokens = np.array([[r.rounds[i][1] for i in keep] for r in rows], dtype=float)
    rounds = np.array([[r.rounds[i][2] for i in keep] for r in rows], dtype=float)
    return tokens, rounds, [rows[0].rounds[i][0] for i in keep]


def bootstrap(mine: tuple, strata: list[str], base: tuple | None = None, *, resamples: int = RESAMPLES,
              level: float = 0.95, seed: int = 0) -> tuple[float, list[float]]:
    """τ pooled over seeds and records (tokens over rounds), or with `base` base's τ over mine, and its `level`
    interval. Each draw resamples the seeds of each trainer apart (with replacement: a seed that did well or badly
    counts as the chance it is) and the held-out records within each category, the same records for both (paired)."""
    rng = np.random.default_rng(seed)
    groups = [np.flatnonzero(np.asarray(strata) == s) for s in dict.fromkeys(strata)]
    records = np.concatenate([rng.choice(g, size=(resamples, len(g))) for g in groups], axis=1)

    def tau(tokens: np.ndarray, rounds: np.ndarray) -> tuple[float, np.ndarray]:
        picks = rng.integers(0, len(tokens), size=(resamples, len(tokens)))
        weight = np.stack([np.bincount(p, minlength=len(tokens)) for p in picks])  # (R, seeds): times each is drawn
        drawn = [(weight * x[:, records].sum(-1).T).sum(1) for x in (tokens, rounds)]  # (R,) each
        return float(tokens.sum() / rounds.sum()), drawn[0] / drawn[1]

    point, draws = tau(*mine)
    if base is not None:
        theirs, theirs_draws = tau(*base)
        point, draws = theirs / point, theirs_draws / draws
    low, high = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return point, [float(low), float(high)]


def summarize(rows: list[Row]) -> list[dict]:
    """Per trainer and setting: τ pooled over its seeds with its interval, over all traffic and per category, and
    against draftsmith's recipe (the τ ratio, its interval and win / tie / loss for draftsmith); the intervals hold
    the seeds' spread and the held-out records' (`bootstrap`)."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.trainer, r.settings), []).append(r)
    base = groups.get(("draftsmith", "recipe"))
    categories = sorted({c for c, _, _ in rows[0].rounds})
    out = []
    for (trainer, settings), runs in groups.items():
        entry = {"trainer": trainer, "settings": settings, "seeds": [r.seed for r in runs],
                 "tau_by_seed": [r.heldout_tau for r in runs],
                 "tokens_per_s_median": float(np.median([r.tokens_per_s for r in runs])),
                 "time_to_tau_s_median": None if None in (times := [r.time_to_tau_s for r in runs])
                 else float(np.median(times)), "by_category": {}}
        for category in [None, *categories]:
            tokens, rounds, strata = _replays(runs, category)
            if not rounds.sum():  # no held-out record of the category has a round within the window
                entry["by_category"][category] = {"tau": None, "interval": []}
                continue
            tau, interval = bootstrap((tokens, rounds), strata)
            figures = {"tau": round(tau, 4), "interval": [round(x, 4) for x in interval]}
            if base is not None and trainer != "draftsmith":
                ratio, (low, high) = bootstrap((tokens, rounds), strata, _replays(base, category)[:2])
                figures.update({"draftsmith_over_this": round(ratio, 4),
                                "draftsmith_over_this_interval": [round(low, 4), round(high, 4)],
                                "draftsmith": "win" if low > 1 else "loss" if high < 1 else "tie"})
            if category is None:
                entry.update(figures)
            else:
                entry["by_category"][category] = figures
        out.append(entry)
    return out


# --- the tables ----------------------------------------------------------------------------------------------------


def runs_table(rows: list[Row]) -> str:
    categories = sorted({c for r in rows for c in r.heldout_tau_by_category})
    head = ["trainer", "settings", "seed", "depth", "tokens/s", "train s", "time to τ, s", "held-out τ",
            "τ at its depth", "top-1", *categories]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r.trainer, r.settings, str(r.seed), str(r.depth), f"{r.tokens_per_s:,.0f}", f"{r.train_s:,.1f}",
            "–" if r.time_to_tau_s is None else f"{r.time_to_tau_s:,.1f}", f"{r.heldout_tau:.3f}", "–" if r.tau_at_depth is None else f"{r.tau_at_depth:.3f}", f"{r.heldout_top1:.3f}",
            *(f"{r.heldout_tau_by_category.get(c, float('nan')):.2f}" for c in categories)]) + " |")
    return "\n".join(lines) + "\n"


def summary_table(summary: list[dict]) -> str:
    def cell(f: dict) -> str:
        if f["tau"] is None:
            return "–"
        tau = f"{f['tau']:.3f}" + (f" ({f['interval'][0]:.3f}–{f['interval'][1]:.3f})" if f["interval"] else "")
        if "draftsmith" in f:
            low, high = (f["draftsmith_over_this_interval"] or [float("nan")] * 2)
            tau += f"; draftsmith {f['draftsmith_over_this']:.3f}× ({low:.3f}–{high:.3f}), {f['draftsmith']}"
        return tau

    categories = sorted({c for s in summary for c in s["by_category"]})
    head = ["trainer", "settings", "seeds", "tokens/s (median)", "time to τ, s (median)", "held-out τ (95 %)",
            *categories]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summary:
        lines.append("| " + " | ".join([s["trainer"], s["settings"], str(len(s["seeds"])),
                                        f"{s['tokens_per_s_median']:,.0f}",
                                        "–" if s["time_to_tau_s_median"] is None else f"{s['time_to_tau_s_median']:,.1f}",
                                        cell(s),
                                        *(cell(s["by_category"][c]) for c in categories)]) + " |")
    return "\n".join(lines) + "\n"


def write_tables(out: Path, rows: list[Row], summary: list[dict]) -> str:
    text = summary_table(summary) + "\n" + runs_table(rows)
    (out / "peers.md").write_text(text)
    return text


def resummarize(path: Path) -> int:
    report = json.loads(path.read_text())
    rows = [Row(**r) for r in report["rows"]]
    report["summary"] = summarize(rows)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(write_tables(path.parent, rows, report["summary"]) + f"written: {path}, {path.parent / 'peers.md'}")
    return 0


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "_peer":  # the training subprocess of one peer
        raise SystemExit(PEERS[sys.argv[2]].main(sys.argv[3:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", help="JSONL records with answers (a prepared regenerated.jsonl); required to train")
    ap.add_argument("--steps", type=int, default=1000, help="training steps, every trainer")
    ap.add_argument("--heldout", type=int, default=100, help="records held out (trainer.heldout=per_category)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 of every trainer and setting")
    ap.add_argument("--curve", type=int, default=5,
                    help="heads saved and measured per run, evenly spaced, for the time to τ (the last: the final step)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads, every trainer")
    ap.add_argument("--trainers", default=",".join(TRAINERS))
    ap.add_argument("--settings", default="matched,defaults",
                    help=f"the peers' runs: any of {', '.join(LADDER)} and the controls {', '.join(CONTROLS)}")
    ap.add_argument("--out", default="runs/peers")
    ap.add_argument("--data-cache", default=None, help="the records' and features' cache (default: <out>/data); "
                                                       "another run's, to train on exactly its records")
    ap.add_argument("--overrides", nargs="*", default=[], help="Hydra overrides of draftsmith's recipe")
    ap.add_argument("--summarize", metavar="PEERS_JSON", default=None,
                    help="summarize the rows of a peers.json again (its tables rewritten beside it); nothing trained "
                         "or measured")
    args = ap.parse_args()
    if args.summarize:
        raise SystemExit(resummarize(Path(args.summarize)))
    if not args.data:
        ap.error("--data is required (or --summarize a finished run's peers.json)")
    out = Path(args.out).resolve()
    trainers = [t for t in args.trainers.split(",") if t]
    settings = [s for s in args.settings.split(",") if s]
    unknown = sorted(set(trainers) - set(TRAINERS)) + sorted(set(settings) - set(LADDER) - set(CONTROLS))
    if unknown:
        raise SystemExit(f"unknown trainers or settings {unknown}: trainers are {TRAINERS}, settings "
                         f"{LADDER + tuple(CONTROLS)}")
    for name in trainers:
        if name != "draftsmith" and not INSTALLED[name].is_dir():
            raise SystemExit(f"{name} is not installed at {INSTALLED[name]}: `make install` installs it")
    torch.set_num_threads(args.threads)
    out.mkdir(parents=True, exist_ok=True)
    seeds = range(args.seeds)
    trained = {seed: train_draftsmith(args, out, seed) for seed in seeds} if "draftsmith" in trainers else {}
    referee = Referee(args, out)
    rows = [referee.row("draftsmith", "recipe", seed, args.steps, referee.k, run, {}) for seed, run in trained.items()]
    rows += [train_peer(name, s, seed, args, referee, out) for name in trainers if name != "draftsmith"
             for s in settings if s not in CONTROLS or name in CONTROLS[s] for seed in seeds]
    summary = summarize(rows)
    (out / "peers.json").write_text(json.dumps({"data": args.data, "steps": args.steps, "heldout": args.heldout,
                                                "seeds": args.seeds, "curve": curve_steps(args.steps, args.curve),
                                                "threads": args.threads,
                                                "overrides": args.overrides, "summary": summary,
                                                "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    text = write_tables(out, rows, summary)
    print(text + f"written: {out / 'peers.json'}, {out / 'peers.md'}")


if __name__ == "__main__":
    stop_on_sigterm()
    main()
