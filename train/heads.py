"""Recipe: train a feature-reading head (EAGLE-3, EAGLE-1, MTP, Medusa) on the frozen target's hidden states.

    python -m train drafter=eagle                        # EAGLE-3 on the toy world's company traffic
    python -m train drafter=eagle1 drafter.hidden_states=offline
    python -m train drafter=mtp | drafter=medusa

The recipe every kind shares, reused as is (train/recipe.py): Accelerate, the regenerated and
tokenized data, the seeded per-step data order, checkpoints and exact resume, W&B, the final
evaluation. What changes: the model is a head (drafters/heads.py) sharing the target's embedding and
output head; the target runs frozen to give the features (`drafter.hidden_states=online`, inside the
step) or they are precomputed once to fp16 shards (`offline`, train/hidden_states.py; computed by vLLM, `vllm`;
read from an engine's files, `files`); the target's next-token distribution, the label of every head, comes from
its last-layer feature through its own output head, so it is always captured with the head's layers. The held-out evaluation scores each
draft step against the target's own distribution, and the best checkpoint is chosen as for every kind
(train/heldout.py).

A kind's own set-up goes through the hooks `_head_settings`, `_prepare_head`, `_capture_layers` and `_features`
in a subclass of its own (EAGLE-3's draft vocabulary and output head: train/eagle3.py `Eagle3Recipe`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from drafters.layers import finish_logits
from drafters.registry import KINDS, build_head, load_head, save_head
from drafters.kinds import HeadConfig
from eval.engines import llama_cpp, vllm
from eval.engines.formats.writing import target_directory
from eval.run import TARGET_WEIGHTS, target_source
from train.config import drafter_keys
from train.hidden_states import (ShardReader, capture, default_layers, write_shards, write_shards_from_files,
                                 write_shards_from_llama_cpp, write_shards_from_vllm)
from train.heldout import HeldoutScores
from train.launch import rank0_first
from train.recipe import Recipe
from train.recipe import run as run_recipe
from train.regenerate import target_gguf
from train.shards import complete
from traffic.records import Example

log = logging.getLogger(__name__)
# The keys every head has (drafters/kinds HeadConfig): the recipe's, not the head's own settings.
HEAD_KEYS = {f.name for f in dataclasses.fields(HeadConfig)}
# EAGLE-3's maps between draft and target ids: a run's own, never another head's (HeadRecipe._start_from).
VOCABULARY_MAPS = ("d2t", "t2d")

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
        if d.hidden_states not in ("online", "offline", "vllm", "llamacpp", "files"):
            raise ValueError(f"drafter.hidden_states must be online, offline, vllm, llamacpp or files, "
                             f"got {d.hidden_states!r}")
        if d.hidden_states == "vllm" and not vllm.available():
            raise ValueError(f"drafter.hidden_states=vllm needs vLLM's environment at {vllm.ENVIRONMENT}: `make vllm`")
        if d.hidden_states == "llamacpp" and not llama_cpp.available():
            raise ValueError(f"drafter.hidden_states=llamacpp needs llama.cpp's build at {llama_cpp.home()} (with "
                             "llama-hidden-states): `make llama-cpp`")
        if (d.hidden_states == "files") != (d.hidden_states_dir is not None):
            raise ValueError("drafter.hidden_states=files reads drafter.hidden_states_dir (the folder of an engine's "
                             "hs_{i}.safetensors files), and only it does: set both or neither")
        if d.hidden_states_tensor_parallel < 1 or (d.hidden_states_tensor_parallel > 1 and d.hidden_states != "vllm"):
            raise ValueError(f"drafter.hidden_states_tensor_parallel is {d.hidden_states_tensor_parallel}: it shards "
                             "the target over that many vLLM workers, with drafter.hidden_states=vllm only (1 or more)")
        self._validate_target_weights()
        if not d.label_temperature >= 0:
            raise ValueError(f"drafter.label_temperature must be >= 0 (0 = the target's argmax), "
                             f"got {d.label_temperature}")

    def _validate_target_weights(self) -> None:
        """With `drafter.target_weights=ends` nothing may run the target itself: its features come from an engine and
        there is no final evaluation in draftsmith's loop. Its answers come from an engine (regenerate.engine,
        regenerate.endpoint), are kept, or were regenerated before into the same data cache; an answer the target
        would have to write in PyTorch is `LayerNotLoaded`'s error, at the start of the run."""
        cfg, d = self.cfg, self.cfg.drafter
        if d.target_weights not in TARGET_WEIGHTS:
            raise ValueError(f"drafter.target_weights must be one of {sorted(TARGET_WEIGHTS)}, got {d.target_weights!r}")
        if d.target_weights == "all":
            return
        why = f"drafter.target_weights=ends loads {TARGET_WEIGHTS['ends']}, so nothing runs the target itself"
        if d.hidden_states not in ("vllm", "llamacpp", "files"):
            raise ValueError(f"{why}: its features, the held-out records' too, must come from an engine "
                             f"(drafter.hidden_states=vllm, llamacpp or files), not {d.hidden_states}")
        if cfg.evaluate.enabled:
            raise ValueError(f"{why}: the final evaluation runs it in draftsmith's loop; set evaluate.enabled=false and "
                             "measure the export in the engine that serves the target (docs/training.md)")

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
        self.shards = self.heldout_shards = None
        if self.cfg.drafter.hidden_states == "online":
            return
        self.shards = self._feature_cache(self._training_examples(), "train")
        if self.cfg.drafter.target_weights == "ends":  # no layers to compute the held-out ones: the engine's too
            self.heldout_shards = self._feature_cache(self._training_examples(self.eval_set), "eval")

    def _feature_cache(self, examples: list[Example], split: str) -> ShardReader:
        """The cached features of `examples` (the `split` set's), computed once as `drafter.hidden_states` says."""
        t, d, layers = self.cfg.trainer, self.cfg.drafter, self.capture_layers
        # An engine's features get a cache of their own: its numerics are not PyTorch's.
        engine = {"vllm": "hidden-vllm", "llamacpp": "hidden-llamacpp", "files": "hidden-files"}.get(d.hidden_states,
                                                                                                     "hidden")
        files = str(Path(d.hidden_states_dir).resolve()) if d.hidden_states == "files" else None
        # llama.cpp's features are those of the target's GGUF: the target as named (its file, or its float32 conversion)
        source = files or (target_source(self.cfg.target) if d.hidden_states == "llamacpp" else None)
        directory = self._cache_dir(engine, layers, t.max_length, d.offline_dtype, *([source] if source else []),
                                    split=split)
        with rank0_first(self.acc, lambda: complete(directory), "the feature cache"):
            if not complete(directory):
                max_bytes = None if d.offline_max_gib is None else int(d.offline_max_gib * 2**30)
                options = dict(dtype=d.offline_dtype, batch_size=t.batch_size, max_bytes=max_bytes,
                               progress=self.cfg.progress and self.is_main)
                if files:
                    write_shards_from_files(examples, self.target, files, layers, directory, **options)
                elif d.hidden_states == "llamacpp":  # converted here, once, by the first process alone
                    write_shards_from_llama_cpp(examples, self.target, self._target_gguf(), layers, directory,
                                                **options)
                elif d.hidden_states == "vllm":
                    write_shards_from_vllm(examples, self.target, target_directory(target_source(self.cfg.target)),
                                           layers, directory, served_dtype=str(self.target.dtype).removeprefix("torch."),
                                           tensor_parallel_size=d.hidden_states_tensor_parallel, **options)
                else:
                    write_shards(examples, self.target, layers, directory, **options)
        return ShardReader(directory)

    def _target_gguf(self) -> Path:
        """The GGUF llama.cpp computes the features on: the target's own file where it was given as one (the quantized
        file a team serves), else the target converted by llama.cpp's converter in float32, once, beside the caches."""
        return target_gguf(target_source(self.cfg.target), Path(self.cfg.data_cache) / "llama.cpp")

    # --- data -------------------------------------------------------------------------------------

    def _collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return self._with_features(super()._collate(indices), self.shards, indices)

    def _heldout_collate(self, rows, indices: list[int]) -> dict[str, torch.Tensor]:
        return self._with_features(super()._heldout_collate(rows, indices), self.heldout_shards, indices)

    def _with_features(self, batch: dict[str, torch.Tensor], shards: ShardReader | None,
                       indices: list[int]) -> dict[str, torch.Tensor]:
        """`batch` with the cached features of its records (`indices` into `shards`; None: the target computes them
        in the step), padded as its ids are."""
        if shards is not None and indices:
            rows = [shards[i]["hidden"] for i in indices]
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
        return head_states, label_distribution(self._logits_of(states[:, :, -1]), temperature)

    @torch.no_grad()
    def _logits_of(self, last: torch.Tensor) -> torch.Tensor:
        """The target's logits (float32) from its last-layer features `last`, through its own output head."""
        return finish_logits(self.target.config, self.target.get_output_embeddings()(last).float())

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

    def _score_heldout(self, batch: dict[str, torch.Tensor]) -> HeldoutScores:
        """Per draft step, on the held-out assistant tokens, the head's expected acceptance and top-1 agreement
        against the target's own distribution (whatever the training labels), and its greedy hits."""
        features, probs = self._features(batch)
        _, stats = self.model(features, batch["input_ids"], batch["attention_mask"], batch["loss_mask"], probs)
        return HeldoutScores(accept=[float(st["accept"]) for st in stats], top1=[float(st["top1"]) for st in stats],
                             count=[float(st["count"]) for st in stats], hits=[st["hits"] for st in stats])

    def _write_best(self, directory, state) -> None:
        save_head(self.acc.unwrap_model(self.model), directory, state_dict=state)

    def _best_notes(self) -> dict:
        return {"vocabulary_coverage": self.coverage, "vocabulary_probability": self.mass}

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
