"""Read a trained EAGLE-3 head's exports with the engines' own classes and compare their draft logits with the
head's, on the target's features of real prompts (docs/benchmarks/gemma3.md runs it on Gemma-3-270M):

    .venv/bin/python scripts/check_export.py runs/gemma/run4 --prompts runs/real_traffic2/eval.jsonl

`speculators` (what vLLM reads): speculators' own `SpeculatorModel.from_pretrained`. `sglang`: SpecForge's
`LlamaForCausalLMEagle3`, the class SGLang's format comes from, built from the export's config with the weights
loaded by name (tests/train/test_export.py says why not its from_pretrained). Both are installed beside the venv
by `make install` (.venv/speculators, .venv/specforge). Each export is `python -m train.export`'s, under
<run>/export/<format>. Prints, per format and prompt, the largest difference of the logits and whether the first
draft token agrees everywhere; exits 1 when a format differs beyond --atol.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from drafters.heads import features_of
from drafters.registry import load_head
from eval.run import load_target
from train.export import read_run

VENV = Path(__file__).resolve().parents[1] / ".venv"


def beside_the_venv(name: str):
    """A package `make install` puts in .venv/<name> without its CUDA dependencies, behind the venv's own."""
    if not (VENV / name / ".installed").exists():
        sys.exit(f"{name} is not installed in {VENV / name}: run `make install`")
    if str(VENV / name) not in sys.path:
        sys.path.append(str(VENV / name))
    return importlib.import_module(name)


def speculators_logits(directory: Path, features: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    beside_the_venv("speculators")
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(directory)
    config.transformer_layer_config._attn_implementation = "eager"  # its default, flex attention, wants a GPU
    model = SpeculatorModel.from_pretrained(directory, config=config).eval()
    out = []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: out.append(output))
    with torch.no_grad():  # hidden state t with token t+1, as draftsmith pairs them
        model(hidden_states=features[:, :-1], input_ids=ids[:, 1:], document_ids=torch.zeros_like(ids[:, 1:]),
              ttt_steps=1)
    hook.remove()
    return out[0].float()


def specforge_logits(directory: Path, features: torch.Tensor, ids: torch.Tensor, target) -> torch.Tensor:
    beside_the_venv("specforge")
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    model = LlamaForCausalLMEagle3(LlamaConfig.from_pretrained(directory), attention_backend="sdpa").eval()
    missing, unexpected = model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=False)
    if missing != ["embed_tokens.weight"] or unexpected:
        sys.exit(f"{directory}: SpecForge's class does not match the weights: missing {missing}, unexpected {unexpected}")
    embeds = torch.nn.functional.embedding(ids[:, 1:], target.get_input_embeddings().weight)
    with torch.no_grad():  # the target's embedding rows: SGLang shares the target's embedding weight with the head
        return model.lm_head(model(hidden_states=features[:, :-1], inputs_embeds=embeds)).float()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a `python -m train` run directory with <run>/export/<format>")
    parser.add_argument("--prompts", type=Path, required=True, help="a JSONL file of chat records (messages)")
    parser.add_argument("--n", type=int, default=3, help="prompts read from the file")
    parser.add_argument("--atol", type=float, default=1e-3)
    args = parser.parse_args(argv)

    run = read_run(args.run)
    target, tok = load_target(run.target, device=torch.device("cpu"),
                              chat_template=run.config["target"].get("chat_template"))
    head = load_head(run.best, target)
    formats = [f for f in ("speculators", "sglang") if (args.run / "export" / f / "config.json").exists()]
    if not formats:
        sys.exit(f"{args.run}/export has neither speculators/ nor sglang/: run `python -m train.export run={args.run}`")
    records = [json.loads(line) for line in args.prompts.read_text().splitlines()[: args.n]]
    worst = 0.0
    for i, record in enumerate(records):
        messages = [m for m in record["messages"] if m["role"] != "assistant"]
        ids = torch.tensor([tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)])
        with torch.no_grad():
            out = target(ids, output_hidden_states=True)
            features = features_of(out.hidden_states, head.config.feature_layers).flatten(2)
            ours = head.unroll(features, ids, torch.ones_like(ids))[0].float()  # step 0 over the prompt
        for fmt in formats:
            directory = args.run / "export" / fmt
            theirs = (speculators_logits(directory, features, ids) if fmt == "speculators"
                      else specforge_logits(directory, features, ids, target))
            diff = (theirs - ours).abs().max().item()
            agree = torch.equal(theirs.argmax(-1), ours.argmax(-1))
            worst = max(worst, diff)
            print(f"prompt {i} ({ids.shape[1]} tokens) {fmt}: max |logit difference| {diff:.2e}, "
                  f"first draft token agrees at every position: {agree}")
    print(f"worst difference {worst:.2e} (atol {args.atol:g})")
    sys.exit(0 if worst <= args.atol else 1)


if __name__ == "__main__":
    main()
