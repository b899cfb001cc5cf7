"""Publish an export to the Hugging Face Hub with a model card of what was measured.

    python -m train.export run=<run> hub.repo_id=my-org/my-eagle3 hub.license=apache-2.0
    python -m train.export run=<run> hub.repo_id=my-org/my-eagle3 hub.dry_run=true     (list what would go up)

The repository's root holds the format the engines' Hub loaders read directly (EAGLE-3: SGLang's
`LlamaForCausalLMEagle3`, which vLLM's native EAGLE-3 path reads too; a draft LM: Hugging Face weights),
the other formats in subfolders (`speculators/`, `gguf/`), and `README.md`: the model card, with Hub
metadata and the run's measured results. Upload goes through `huggingface_hub` (`create_repo`,
`upload_folder`); the token comes from `HF_TOKEN` or the user's `huggingface_hub` login and is never
printed or logged.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from drafters import kinds
from drafters.tree import TreeShape
from eval.engines.costs import sglang_settings

@dataclass
class HubSettings:
    """Where and how an export goes up; no repo_id = no upload."""

    repo_id: str | None = None  # org/name
    private: bool = True
    revision: str | None = None  # a branch; None = main
    commit_message: str | None = None
    license: str | None = None  # the model card's licence, e.g. apache-2.0 (the target's terms bind the head too)
    dry_run: bool = False  # list the files that would go up, upload nothing


def stage(written: dict[str, Path], kind: str, out: Path, card: str) -> Path:
    """The repository as it will be on the Hub, under `out` (hard links where possible, not copies)."""
    root = kinds.kind(kind).hub_root
    if root not in written:
        raise ValueError(f"uploading a {kind} drafter needs its {root!r} export (the repository's root); "
                         f"add it to formats")
    shutil.rmtree(out, ignore_errors=True)
    for name, path in written.items():
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        base = path.parent if path.is_file() else path
        for f in files:
            dest = out / ("" if name == root else name) / f.relative_to(base)
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, dest)
            except OSError:  # another file system
                shutil.copy2(f, dest)
    (out / "README.md").write_text(card)
    return out


def upload(folder: Path, settings: HubSettings, endpoint: str | None = None) -> str:
    """Create the repository (if needed) and commit `folder` to it; returns the commit's URL. `endpoint`:
    another Hub than huggingface_hub's (which follows HF_ENDPOINT)."""
    from huggingface_hub import HfApi  # only where an export is uploaded
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import get_token

    if get_token() is None:  # HF_TOKEN, or the token `hf auth login` stored
        raise ValueError("no Hugging Face token: set HF_TOKEN or run `hf auth login` before uploading "
                         f"to {settings.repo_id}")
    api = HfApi(endpoint=endpoint)
    try:
        api.create_repo(settings.repo_id, private=settings.private, exist_ok=True, repo_type="model")
        if settings.revision:
            api.create_branch(settings.repo_id, branch=settings.revision, exist_ok=True)
        commit = api.upload_folder(folder_path=str(folder), repo_id=settings.repo_id, revision=settings.revision,
                                   commit_message=settings.commit_message or "Upload drafter exported by draftsmith")
    except HfHubHTTPError as e:  # the server's own words; the token is not in them
        status = e.response.status_code if e.response is not None else "?"
        raise ValueError(f"the Hub refused the upload to {settings.repo_id} (HTTP {status}): {e}") from None
    return commit.commit_url


def listing(folder: Path) -> list[str]:
    """`path  size` per file, what a dry run prints."""
    return [f"{p.relative_to(folder)}  {p.stat().st_size:,} bytes" for p in sorted(folder.rglob("*")) if p.is_file()]


# --- the model card ----------------------------------------------------------------------------------------


def _table(rows: list[list], head: list[str]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def model_card(run, written: dict[str, Path], *, repo_id: str, license: str | None, k: int) -> str:
    """README.md for the Hub: metadata, what the drafter is, its traffic, recipe, measured results and the
    serving commands (drafting k tokens), from the run's own files (train_config.yaml, best/best.json,
    report.json)."""
    cfg, kind = run.config, run.kind
    target = run.target
    best = json.loads((run.best / "best.json").read_text()) if (run.best / "best.json").exists() else {}
    report_file = run.path / "report.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else None
    d, t, r = cfg["drafter"], cfg["trainer"], cfg["regenerate"]
    described = kinds.kind(kind)  # its descriptor: the card's tag, library, first paragraph and recipe rows
    tags = ["speculative-decoding", "draftsmith", described.tag]
    library = described.library
    meta = ["---", f"base_model: {target}", f"library_name: {library}", "tags:", *(f"- {tag}" for tag in tags)]
    if license:
        meta.append(f"license: {license}")
    meta.append("---")
    layers = json.loads((run.best / "config.json").read_text()).get("feature_layers")
    what = described.describe(target, d, layers)
    out = [*meta, "", f"# {repo_id}", "", what, "", "Trained and measured with draftsmith on the team's own traffic.", ""]

    trained = (report or {}).get("settings", {}).get("trained_on")
    out += ["## Traffic", ""]
    if trained:
        cats = ", ".join(f"{c} {n}" for c, n in sorted(trained.get("categories", {}).items()))
        out.append(f"{trained['records']} conversations ({cats}); {trained['checkpoint_chosen_on']} more held out "
                   "to choose the checkpoint. Responses regenerated by the target: "
                   f"{'yes' if r['enabled'] else 'no'} (temperature {r['temperature']}, up to "
                   f"{r['max_new_tokens']} tokens).")
    else:
        out.append("(the run has no final evaluation report: record counts unknown)")
    out += ["", "## Recipe", ""]
    recipe = [["steps", t["max_steps"]], ["batch size", t["batch_size"]], ["learning rate", t["lr"]],
              ["checkpoint chosen by", t["select_by"]]]
    if described.head is not None and d.get("init_from"):
        recipe.append(["started from the head", d["init_from"]])
    recipe += described.card_rows(d, cfg, best)
    out += _table(recipe, ["setting", "value"])

    out += ["", "## Measured", ""]
    if report:
        hw = report["hardware"]
        rows = [[x["category"], x["drafter"], x["k"], f"{x['acceptance_length']:.2f}", f"{x['speedup']:.2f}×",
                 f"{x['speedup_vs_baseline']:.2f}×", x["verdict"]]
                for x in report["results"] if x["temperature"] == 0.0]
        data = report["settings"]["data"]
        out += [f"Greedy decoding on {data['records']} held-out records (`python -m eval`'s loop, k as listed), on "
                f"{hw['gpu'] or hw['cpu']} with torch {hw['torch']}. τ = new tokens per target forward; speed-up "
                "against plain decoding in the same run; the baseline is the off-the-shelf draft.", "",
                *_table(rows, ["category", "drafter", "k", "τ", "speed-up", "vs baseline", "verdict"]),
                "", "Acceptance carries over between engines; speed-up does not: measure it in yours."]
    else:
        out.append("No evaluation report in the run (`evaluate.enabled=false`).")

    # The engines that serve the kind from this export; only the names of the method and the GGUF file differ.
    engines = described.engines
    sglang, gguf, spec_type = engines.sglang, engines.gguf, engines.llama_cpp
    out += ["", "## Serving", "", "```bash",
            f"vllm serve {target} --speculative-config '{json.dumps(engines.vllm_config(repo_id, k))}'"]
    if sglang:
        out.append(f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {sglang} "
                   f"--speculative-draft-model-path {repo_id} --speculative-num-steps {k} --speculative-eagle-topk 1 "
                   f"--speculative-num-draft-tokens {k + 1}")
    tree = _favoured_tree(report)
    if tree:
        shape, why = tree
        if sglang and sglang_settings(shape):
            out += [f"# {why}: a dynamic tree",
                    f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {sglang} "
                    f"--speculative-draft-model-path {repo_id} {sglang_settings(shape)}"]
    if "gguf" in written:
        out += [f"hf download {repo_id} gguf/{gguf} --local-dir .",
                f"llama-server -m target.gguf -md gguf/{gguf} --spec-type {spec_type} --spec-draft-n-max {k}"]
    out.append("```")
    if "speculators" in written:
        out += ["", "`speculators/` holds the same head in the speculators format (`vllm serve` detects it)."]
    if "gguf" in written:
        out += ["", "The target's GGUF for llama.cpp: its own `convert_hf_to_gguf.py` on the target's directory."]
    return "\n".join(out) + "\n"


def _favoured_tree(report: dict | None):
    """The tree shape (drafters/tree.py) the final evaluation favours over all traffic, greedy, with why: the
    prediction for the team's engine (engine_costs) where there is one, else the speed measured in the run; None
    when a chain was faster or no tree was measured."""
    for key, why in (("engine_best_shape", "favoured by the engine costs entered (engine_costs)"),
                     ("best_shape", "fastest in draftsmith's measurement")):
        for r in (report or {}).get("results", []):
            if r["category"] == "all" and r["temperature"] == 0 and str(r.get(key) or "").startswith("tree "):
                return TreeShape.parse(r[key].removeprefix("tree ")), why
    return None
