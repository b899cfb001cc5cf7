"""A drafter in the formats the serving engines load, and the collapse guard that refuses, before anything is
written, a head an engine would load and then accept nothing from (the field's most reported export failure).
`python -m train.export` (train/export.py) writes a training run's drafter in them; `python -m eval engine=llamacpp`
(eval/engines/engine.py) serves a trained head in llama.cpp through them. One module per format, and what they share:

- `checks.py`: the collapse guard (`check_eagle3`, `check_eagle1`, `ExportRefused`);
- `eagle3.py`: `sglang` and `speculators` (EAGLE-3, P-EAGLE), and an EAGLE-3 head's GGUF;
- `eagle1.py`: `vllm` (EAGLE-1);
- `dflash.py`: `dflash` (DFlash), and a DFlash drafter's GGUF;
- `writing.py`: `hf` and `gguf` (a draft LM's), and what every writer shares: the target's directory and tokenizer,
  a directory written whole or not at all, llama.cpp's converter.
"""
