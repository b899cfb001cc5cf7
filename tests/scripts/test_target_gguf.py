"""scripts/target_gguf.py: a quantized target converted to f16 by llama.cpp's converter is the same model at
another type. The source is a Q8_0 GGUF of the tiny_deep world's target, written by that converter here."""

from __future__ import annotations

import pytest
import torch

from eval.engines import llama_cpp
from eval.run import load_target
from helpers import load_script
from traffic import toyworld

pytestmark = pytest.mark.skipif(not llama_cpp.available(), reason=(
    f"llama.cpp is not built at {llama_cpp.home()} (its converter writes the GGUF): `make llama-cpp`"))


def test_a_q8_target_converted_to_f16_is_the_same_model_at_another_type(tiny_world, tmp_path):
    q8 = llama_cpp.convert_to_gguf(toyworld.resolve("toyworld://tiny_deep/target"), tmp_path / "t-Q8_0.gguf",
                                   outtype="q8_0")
    out = tmp_path / "t-f16.gguf"
    load_script("target_gguf").main([str(q8), str(out), "--outtype", "f16"])

    import gguf  # the package transformers reads GGUF files with

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.attn_q.weight"] == "F16"  # the converter wrote the type asked for
    quantized, tok = load_target(str(q8), device=torch.device("cpu"))
    converted, tok16 = load_target(str(out), device=torch.device("cpu"))
    assert tok.get_vocab() == tok16.get_vocab()
    # The Q8_0 file's dequantized weights, rounded to f16: the same model up to that rounding.
    for (name, a), (_, b) in zip(quantized.state_dict().items(), converted.state_dict().items()):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-4), name
    ids = torch.tensor([tok("def add(a, b):\n    return a + b").input_ids])
    with torch.no_grad():
        assert torch.equal(quantized(ids).logits.argmax(-1), converted(ids).logits.argmax(-1))


def test_the_output_must_be_a_gguf_file(tmp_path):
    with pytest.raises(SystemExit):
        load_script("target_gguf").main(["pypi://smollm2", str(tmp_path / "out.bin")])
