"""The toy world's off-the-shelf draft, trained by its own recipe at another size (docs/benchmark-log.md,
"Can the head win on `toy`? Three checks").

    python scripts/toy_draft_variant.py --layers 3 --out runs/draft-3-layers
    python -m train drafter=draft_lm drafter.loss=sft drafter.init_from=runs/draft-3-layers   # then distil it

Same text, seed, steps and tokenizer as `toyworld://<preset>/draft`; only the shape changes. The world
is not modified: the variant is a directory any `drafter.init_from`, `target.off_the_shelf_draft` or
evaluation drafter `path` can name.
"""

from __future__ import annotations

import argparse

from traffic import toyworld


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="toy", choices=sorted(toyworld.PRESETS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden-size", type=int, default=None)
    ap.add_argument("--intermediate-size", type=int, default=None)
    args = ap.parse_args()
    changes = {name: value for name, value in (("layers", args.layers), ("hidden_size", args.hidden_size),
                                               ("intermediate_size", args.intermediate_size)) if value is not None}
    if not changes:
        raise SystemExit("nothing to change: give --layers, --hidden-size or --intermediate-size")
    loss = toyworld.build_draft_variant(args.preset, args.out, **changes)
    print(f"{args.preset} draft with {changes}: final loss {loss:.3f}, saved to {args.out}")


if __name__ == "__main__":
    main()
