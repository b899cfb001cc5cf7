"""Recipe: train a feature-reading head (EAGLE-3, EAGLE-1, MTP, Medusa) on the frozen target's hidden states.

    python -m train drafter=eagle                        # EAGLE-3 on the toy world's company traffic
    python -m train drafter=eagle1 drafter.hidden_states=offline
    python -m train drafter=mtp | drafter=medusa

The recipe every kind shares, reused as is (train/recipe.py): Accelerate, the regenerated and
tokenized data, the seeded per-step data order, checkpoints and exact resume, W&B, the final
evaluation. What changes: the model is a head (drafters/heads.py) sharing the target's embedding and
output head; the target runs frozen to give the features (`drafter.hidden_states=online`, inside the
step) or they are precomputed once to fp16 shards (`offline`, train/hidden_states.py); the target's
next-token distribution, the label of every head, comes from its last-layer feature through its own
output head, so it is always captured with the head's layers. The best checkpoint is chosen by the
held-out estimate of tokens accepted per round, 1 + sum_s prod_{r<=s} alpha_r, where alpha_r is the
expected acceptance sum_x min(p, q) of draft step r; with `trainer.select_by=top1`, by the τ of greedy
chain drafting replayed on the held-out answers (`greedy_rounds`), which the loop measures exactly where
those answers are the target's greedy output.

A kind's own set-up goes through the hooks `_head_settings`, `_prepare_head`, `_capture_layers` and `_features`
in a subclass of its own (EAGLE-3's draft vocabulary and output head: train/eagle3.py `Eagle3Recipe`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import torch
from omegaconf import DictConfig

from drafters.layers import finish_logits
from drafters.registry import KINDS, build_head, load_head, save_head
from traffic.checkpoint import full_model_state
from drafters.kinds import HeadConfig
from train.config import drafter_keys
from train.hidden_states import ShardReader, capture, default_layers, write_shards
from train.launch import rank0_first
from train.recipe import Recipe, _records_batch
from train.recipe import run as run_recipe
from train.shards import complete

log = logging.getLogger(__name__)
# The keys every head has (drafters/kinds HeadConfig): the recipe's, not the head's own settings.
HEAD_KEYS = {f.name for f in dataclasses.fields(HeadConfig)}
# EAGLE-3's maps between draft and target ids: a run's own, never another head's (HeadRecipe._start_from).
VOCABULARY_MAPS = ("d2t", "t2d")

def tokens_per_round_estimate(alphas: list[float]) -> float:
    """1 + sum_s prod_{r<=s} alpha_r: expected tokens per round if step s is accepted with alpha_s."""
    total, prod = 1.0, 1.0
    for a in alphas:
        prod *= a
        total += prod
    return total


def greedy_rounds(hits: list[torch.Tensor], answer: torch.Tensor) -> list[tuple[int, int]]:
    """Greedy chain drafting at k = len(hits), replayed on teacher-forced answers: (tokens, rounds) per row.

    hits[s][b, e]: the head's guess of step s from entry e (the target's features through position e,
    tokens through e+1) is the target's greedy token e+s+2; answer (B, T): the assistant tokens. A round
    starts at an entry whose next two tokens are answer tokens (the first comes from the target), keeps
    the leading run of hits, and yields it plus the target's own token, so the next round starts that
    many entries on. Where the answers are the target's greedy output, this is the τ greedy serving
    measures on them: unlike 1 + a1 + a1·a2 + ..., it keeps how misses cluster (a round starts right
    after one)."""
    steps = [h.cpu() for h in hits]
    answer = answer.bool().cpu()
    out = []
    for b in range(answer.shape[0]):
        row, e, T = answer[b].tolist(), 0, answer.shape[1]
        tokens = rounds = 0
        while e + 2 < T:
            if not (row[e + 1] and row[e + 2]):
                e += 1
                continue
            kept = 0
            while kept < len(steps) and e + kept + 2 < T and row[e + kept + 2] and bool(steps[kept][b, e]):
                kept += 1
            tokens, rounds = tokens + kept + 1, rounds + 1
            e += kept + 1
        out.append((tokens, rounds))
    return out


def label_distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature), and for temperature 0 the one-hot of the argmax: the label a
    head is trained towards (1 = the target's distribution, as EAGLE trains; 0 = its greedy choice,
    which is all greedy verification accepts)."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return torch.softmax(logits / temperature, dim=-1)






class HeadRecipe(Recipe):
    """One training run of a head (see the module docstring)."""

    def _validate(self) -> None:
        d = self.cfg.drafter
        if d.kind not in KINDS:
            raise ValueError(f"this recipe trains drafter.kind in {sorted(KINDS)}, got {d.kind!r}")
        if d.hidden_states not in ("online", "offline"):
            raise ValueError(f"drafter.hidden_states must be online or offline, got {d.hidden_states!r}")
        if not d.label_temperature >= 0:
            raise ValueError(f"drafter.label_temperature must be >= 0 (0 = the target's argmax), "
                             f"got {d.label_temperature}")

    # --- setup ------------------------------------------------------------------------------------

    def _resolve_layers(self) -> None:
        """The head's feature layers (`drafter.layers`, else its kind's default) and the layers captured for it."""
        d, n = self.cfg.drafter, self.target.config.num_hidden_layers
        self.layers = list(d.layers) if d.layers else default_layers(d.kind, n)
        self.capture_layers = self._capture_layers()

    def _capture_layers(self) -> list[int]:
        """The head's layers plus the last one, whose feature gives the target's next-token distribution (every
        head's label), unless it is the head's own."""
        n = self.target.config.num_hidden_layers
        return self.layers + ([] if self.layers[-1] == n else [n])

    def _setup_models(self) -> None:
        d, target = self.cfg.drafter, self.target
        settings = self._head_settings()
        torch.manual_seed(self.cfg.trainer.seed)
        head = build_head(d.kind, target, self.layers, **settings)
        self.coverage = self.mass = None  # a draft vocabulary's coverage of the held-out traffic, where it has one
        self._prepare_head(head)
        if d.init_from:
            self._start_from(head, d.init_from)
        self.model = head.to(self.device)
        if self.is_main:
            own = sum(p.numel() for p in head.parameters())
            log.info("%s head: %.2fM parameters of its own, layers %s", d.kind, own / 1e6, self.layers)

    def _head_settings(self) -> dict:
        """The settings the head is built with: its kind's own keys (train/config.py), those every head has aside."""
        d = self.cfg.drafter
        return {name: d[name] for name in drafter_keys(d.kind) if name not in HEAD_KEYS}

    def _prepare_head(self, head) -> None:
        """What a kind does to its new head before training or `drafter.init_from` (nothing, here)."""

    def _start_from(self, head, path: str) -> None:
        """Start from a saved head of the same kind, layers and shape (`drafter.init_from`: a run's `best` or a
        checkpoint, e.g. last month's head trained further on this month's traffic). EAGLE-3's draft vocabulary
        is this run's: it picks rows of the target's output head, or, where the head owns one
        (`drafter.own_lm_head`), of its own, carried over token by token (`Eagle3.init_lm_head`)."""
        saved = load_head(path, self.target)
        kind = getattr(saved.config, "draftsmith_kind", None)
        if kind != self.cfg.drafter.kind or list(saved.config.feature_layers) != list(head.config.feature_layers):
            raise ValueError(f"drafter.init_from={path}: a {kind} head on layers {list(saved.config.feature_layers)}, "
                             f"not the {self.cfg.drafter.kind} head on layers {list(head.config.feature_layers)} this "
                             "run trains (set drafter.layers to match, or start afresh)")
        # An own output head is over the saved run's vocabulary: its rows are carried over token by token below.
        state = {k: v for k, v in saved.state_dict().items() if k not in VOCABULARY_MAPS + ("lm_head.weight",)}
        own = {k: v for k, v in head.state_dict().items() if k not in VOCABULARY_MAPS + ("lm_head.weight",)}
        wrong = sorted(set(state) ^ set(own)) or sorted(k for k in own if own[k].shape != state[k].shape)
        if wrong:
            raise ValueError(f"drafter.init_from={path}: its weights do not fit this run's head ({', '.join(wrong[:4])}"
                             f"{' ...' if len(wrong) > 4 else ''}); its config.json and the drafter settings differ")
        if getattr(saved, "lm_head", None) is not None and getattr(head, "lm_head", None) is None:
            raise ValueError(f"drafter.init_from={path}: the saved head trained an output head of its own; set "
                             "drafter.own_lm_head=true to keep it (false would draft through the target's instead)")
        head.load_state_dict(state, strict=False)
        if getattr(head, "lm_head", None) is not None:
            head.init_lm_head(saved)
        log.info("head weights from %s", path)

    def _setup_data(self) -> None:
        super()._setup_data()
        self._resolve_layers()
        self.shards = None
        if self.cfg.drafter.hidden_states != "offline":
            return
        t, d, layers = self.cfg.trainer, self.cfg.drafter, self.capture_layers
        directory = self._cache_dir("hidden", layers, t.max_length, d.offline_dtype)
        with rank0_first(self.acc, lambda: complete(directory), "the feature cache"):
            if not complete(directory):
                max_bytes = None if d.offline_max_gib is None else int(d.offline_max_gib * 2**30)
                write_shards(self._training_examples(), self.target, layers, directory, dtype=d.offline_dtype,
                             batch_size=t.batch_size, max_bytes=max_bytes, progress=self.cfg.progress and self.is_main)
        self.shards = ShardReader(directory)

    # --- data -------------------------------------------------------------------------------------

    def _collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        batch = super()._collate(indices)
        if self.shards is not None:
            rows = [self.shards[i]["hidden"] for i in indices]
            width = batch["input_ids"].shape[1]
            feats = torch.zeros(len(rows), width, *rows[0].shape[1:], dtype=rows[0].dtype)
            for j, h in enumerate(rows):
                feats[j, : h.shape[0]] = h
            batch["features"] = feats.to(self.device)
        return batch

    def _features(self, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's input features (B, T, L*d) and the target's next-token distribution (B, T, V) at
        `temperature` (0: one-hot on its argmax)."""
        states = self._states(batch)
        head_states = states[:, :, : len(self.layers)].flatten(2).float()
        with torch.no_grad():
            logits = finish_logits(self.target.config, self.target.get_output_embeddings()(states[:, :, -1]).float())
            probs = label_distribution(logits, temperature)
        return head_states, probs

    def _states(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, T, len(capture_layers), d): the captured layers' states, from the shards or the target."""
        if "features" in batch:
            return batch["features"].to(self.target.dtype)
        return capture(self.target, batch["input_ids"], batch["attention_mask"], self.capture_layers)

    # --- training ---------------------------------------------------------------------------------

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # The token loss's label; held-out statistics always read the target's own distribution.
        features, probs = self._features(batch, self.cfg.drafter.label_temperature)
        loss, _ = self.model(features, batch["input_ids"], batch["attention_mask"], batch["loss_mask"], probs)
        return loss

    @torch.no_grad()
    def evaluate_heldout(self) -> dict:
        """Per-step expected acceptance and top-1 agreement on held-out assistant tokens, the
        tokens-per-round estimate from them, and greedy serving's τ replayed on the held-out answers (over all
        and per category, `greedy_rounds`): the best checkpoint is chosen by the estimate when sampling
        (`trainer.select_by=acceptance`), by the replayed τ when greedy (`top1`)."""
        self.model.eval()
        totals: dict[str, list[torch.Tensor]] = {}
        replayed: dict[str, list[int]] = {}  # category: [tokens, rounds] of greedy_rounds
        per_record: list[tuple[str, int, int]] = []  # (category, tokens, rounds) of each held-out record, in order
        bs, limit = self.cfg.trainer.batch_size, self.cfg.trainer.max_length
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for start in range(0, len(self.eval_set), bs):
            rows = self.eval_set.select(range(start, min(start + bs, len(self.eval_set))))
            batch = _records_batch(rows, pad, limit, self.device)
            features, probs = self._features(batch)
            _, stats = self.model(features, batch["input_ids"], batch["attention_mask"], batch["loss_mask"], probs)
            hits = [st.pop("hits") for st in stats]
            answer = batch["loss_mask"].bool() & batch["attention_mask"].bool()
            for row, (tokens, rounds) in zip(rows, greedy_rounds(hits, answer)):
                total = replayed.setdefault(row["category"], [0, 0])
                total[0], total[1] = total[0] + tokens, total[1] + rounds
                per_record.append((row["category"], tokens, rounds))
            for s, st in enumerate(stats):
                for key, value in st.items():
                    totals.setdefault(f"{key}_{s}", []).append(value)
        self.model.train()
        self.heldout_rounds = per_record  # for intervals over records (scripts/bench_peers.py); not logged
        sums = {key: float(self.acc.reduce(torch.stack(v).sum(), "sum")) for key, v in totals.items()}
        # Every process replays the whole held-out set: nothing to gather.
        tokens, rounds = (sum(t[i] for t in replayed.values()) for i in (0, 1))
        steps = len([k for k in sums if k.startswith("count_")])
        alphas = [sums[f"accept_{s}"] / max(sums[f"count_{s}"], 1.0) for s in range(steps)]
        top1 = [sums[f"top1_{s}"] / max(sums[f"count_{s}"], 1.0) for s in range(steps)]
        result = {"heldout_acceptance": alphas[0], "heldout_top1": top1[0],
                  "heldout_step_acceptance": [round(a, 4) for a in alphas],
                  "heldout_tokens_per_round": tokens_per_round_estimate(alphas),
                  "heldout_tokens_per_round_greedy": tokens_per_round_estimate(top1),
                  "heldout_tau_greedy": tokens / max(rounds, 1),
                  "heldout_tau_greedy_by_category": {c: round(t / max(r, 1), 4) for c, (t, r) in sorted(replayed.items())}}
        # select_by=acceptance: tokens per round when sampling (alpha = sum min(p, q)); top1: greedy serving's
        # τ, replayed on the held-out answers.
        key = "tokens_per_round" if self.cfg.trainer.select_by == "acceptance" else "tau_greedy"
        if self.best is None or result[f"heldout_{key}"] > self.best.get(key, float("-inf")):
            self.best = {"acceptance": alphas[0], "top1": top1[0], "step": self.step,
                         "tokens_per_round": result["heldout_tokens_per_round"],
                         "tokens_per_round_greedy": result["heldout_tokens_per_round_greedy"],
                         "tau_greedy": result["heldout_tau_greedy"]}
            self._save_best()
        return result

    def _save_best(self) -> None:
        self.acc.wait_for_everyone()
        state = full_model_state(self.model)  # collective: whole even when sharded
        if not self.is_main:
            return
        tmp = self.out / "best.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_head(self.acc.unwrap_model(self.model), tmp, state_dict=state)
        (tmp / "best.json").write_text(json.dumps({**self.best, "vocabulary_coverage": self.coverage,
                                                    "vocabulary_probability": self.mass}) + "\n")
        final = self.out / "best"
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)

    # --- the end ----------------------------------------------------------------------------------

    def _final_specs(self) -> list[dict]:
        cfg = self.cfg
        specs = []
        if cfg.target.off_the_shelf_draft:
            specs.append({"name": "off_the_shelf", "kind": "draft_lm", "path": cfg.target.off_the_shelf_draft})
        specs += self._extra_specs()
        specs.append({"name": f"trained_{cfg.drafter.kind}", "kind": "head", "path": str(self.out / "best")})
        return specs




def run(cfg: DictConfig) -> dict:
    """setup, train, finish, cleanup: what `python -m train drafter=eagle` does."""
    return run_recipe(cfg, HeadRecipe)
