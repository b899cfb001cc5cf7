"""scripts/import_llama2c.py on a real pretrained model: llama2.c's stories260K, converted to Hugging Face's
Llama, decodes greedily from BOS the text its author published, token for token, and draftsmith's loop
with a drafter reproduces it too, as does llama.cpp serving its GGUF."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from drafters.draft_lm import DraftLM
from drafters.ngram import NgramDrafter
from drafters.sampling import Sampling
from eval.speculative import speculative_generate
from helpers import load_script

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "stories260K"
pytestmark = pytest.mark.skipif(not (SHARED / "stories260K.bin").exists(), reason=(
    f"the real llama2.c model is not at {SHARED} (../shared/data beside the clone, see its SOURCES.md)"))


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    script = load_script("import_llama2c")
    return script.convert(SHARED / "stories260K.bin", SHARED / "tok512.bin", tmp_path_factory.mktemp("stories260K"))


@pytest.fixture(scope="module")
def converted(directory):
    return AutoModelForCausalLM.from_pretrained(directory).eval(), AutoTokenizer.from_pretrained(directory)


def published_greedy_text() -> str:
    """The output of `./run stories260K.bin -z tok512.bin -t 0.0` in the author's note: 256 tokens after BOS."""
    note = (SHARED / "stories260K.md").read_text()
    return note.split("-t 0.0\n", 1)[1].split("\n```", 1)[0]


def test_greedy_decoding_from_bos_reproduces_the_published_text(converted):
    model, tok = converted
    with torch.inference_mode():
        ids = model.generate(torch.tensor([[tok.bos_token_id]]), max_new_tokens=256, do_sample=False)[0, 1:].tolist()
    assert tok.decode(ids) == published_greedy_text()
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids  # the tokenizer reads back its own pieces


def test_the_converted_model_is_a_lossless_target_in_the_speculative_loop(converted):
    model, tok = converted
    prompt = torch.tensor([tok.bos_token_id] + tok.encode("Once upon a time", add_special_tokens=False))
    plain = model.generate(prompt[None], max_new_tokens=64, do_sample=False)[0, len(prompt):].tolist()
    out = speculative_generate(model, NgramDrafter(), prompt, k=4, sampling=Sampling(), max_new_tokens=64,
                               eos_token_id=tok.eos_token_id)
    assert out.tokens == plain
    assert sum(r.accepted for r in out.rounds) > 0  # the stories repeat themselves: the n-gram drafter is right


def test_a_self_draft_of_the_first_layers_drafts_losslessly(directory, converted, tmp_path):
    model, tok = converted
    out = load_script("import_llama2c").self_draft(directory, 2, tmp_path / "draft")
    draft = DraftLM.from_pretrained(out, target=model, target_tokenizer=tok)
    assert draft.model.config.num_hidden_layers == 2 and draft.lean is not None  # the lean decode path runs it
    prompt = torch.tensor([tok.bos_token_id] + tok.encode("One day, Tim", add_special_tokens=False))
    plain = model.generate(prompt[None], max_new_tokens=48, do_sample=False)[0, len(prompt):].tolist()
    out = speculative_generate(model, draft, prompt, k=3, sampling=Sampling(), max_new_tokens=48,
                               eos_token_id=tok.eos_token_id)
    assert out.tokens == plain and sum(r.accepted for r in out.rounds) > 0
    with pytest.raises(ValueError, match="keeps 1 to 4 of the 5 layers of .*, got 5"):
        load_script("import_llama2c").self_draft(directory, 5, tmp_path / "bad")


def test_llama_cpp_converts_and_serves_the_converted_model_as_transformers_runs_it(directory, converted, tmp_path):
    from eval.engines import llama_cpp

    if not llama_cpp.available():
        pytest.skip(f"llama.cpp is not built at {llama_cpp.home()}: `make llama-cpp` (make test builds it)")
    model, tok = converted
    assert llama_cpp.tokenizer_pre_of(directory) == ""  # a SentencePiece-style vocabulary: no pre-tokenizer name
    gguf = llama_cpp.convert_to_gguf(directory, tmp_path / "stories260K.gguf")
    prompts = [[tok.bos_token_id] + tok.encode(text, add_special_tokens=False)
               for text in ("Once upon a time", "One day, Tim", '"Hi Sam," said Tim.')]
    with llama_cpp.LlamaServer(gguf) as server:
        for prompt in prompts:
            ours = model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)[0, len(prompt):].tolist()
            assert server.complete(prompt, 48).tokens == ours
