"""The drafters in llama.cpp's formats (eval/engines/llama_cpp_drafters.py): the type each is served in, and the
settings llama-server takes for them."""

from pathlib import Path

import pytest
import torch

from eval.engines import llama_cpp
from eval.engines.formats import writing
from eval.engines.llama_cpp_drafters import Served, draft_dtype, llama_cpp_drafter
from eval.engines.llama_cpp_figures import engine_figures
from eval.engines.llama_cpp_measure import DraftStats


def row(drafter, tau, proposed, k=4, category="all"):
    return {"drafter": drafter, "k": k, "category": category, "temperature": 0.0, "acceptance_length": tau,
            "mean_proposed": proposed, "verdict": "pays off"}


def test_a_drafter_is_served_in_bf16_where_the_targets_hidden_states_outgrow_f16():
    """ggml converts a matmul's activations to its weights' type: an f16 head reading features past f16's range
    drafts from inf (Gemma-3-270M's reach 10^5), so such drafters are served in bf16, the others in f16."""
    from helpers import tiny

    target = tiny("llama")
    assert draft_dtype(target) == draft_dtype(target, [0, 3]) == "float16"
    with torch.no_grad():
        target.get_input_embeddings().weight.mul_(1e6)  # massive activations from the first layer's input on
    assert draft_dtype(target, [0]) == draft_dtype(target) == "bfloat16"


def test_a_confidence_stop_is_served_as_llama_cpps_p_min_only_with_its_rule(tmp_path, monkeypatch):
    """llama.cpp drops the unsure guess (--spec-draft-p-min): a drafter whose stop proposes it is not what
    the engine would run, so the engine refuses it rather than measure another drafter under its name."""
    spec = {"name": "h", "kind": "head", "path": str(tmp_path), "stop_below": 0.5}
    with pytest.raises(ValueError, match="drafter 'h': llama.cpp's confidence stop .* stop_rule: drop"):
        llama_cpp_drafter(spec, None, "target", tmp_path)
    with pytest.raises(ValueError, match="drafter 'm': llama.cpp's n-gram modes have no confidence stop"):
        llama_cpp_drafter({"name": "m", "kind": "llamacpp", "spec_type": "ngram-mod", "stop_below": 0.5,
                                  "stop_rule": "drop"}, None, "target", tmp_path)
    monkeypatch.setattr(llama_cpp, "binary", lambda name: Path("llama.cpp/bin") / name)  # a command, not a build
    server = llama_cpp.LlamaServer("t.gguf", draft="d.gguf", spec_type="draft-eagle3", k=4, p_min=0.5)
    assert server.command(8080)[-2:] == ["--spec-draft-p-min", "0.5"]
    with pytest.raises(ValueError, match="p_min is a draft model's confidence stop"):
        llama_cpp.LlamaServer("t.gguf", spec_type="ngram-mod", p_min=0.5)


def test_ngram_cache_is_served_and_reported_at_the_draft_length_llama_cpp_fixes_for_it(monkeypatch):
    """llama.cpp's ngram-cache drafts up to 8 tokens whatever --spec-draft-n-max says: a server asked for
    another k is an error, and the engine measures and reports it at k 8 alone, whatever ks are asked for."""
    with pytest.raises(ValueError, match="ngram-cache drafts up to 8 tokens .* k must be 8, got 4"):
        llama_cpp.LlamaServer("t.gguf", spec_type="ngram-cache", k=4)
    monkeypatch.setattr(llama_cpp, "binary", lambda name: Path("llama.cpp/bin") / name)  # a command, not a build
    assert "ngram-cache" in llama_cpp.LlamaServer("t.gguf", spec_type="ngram-cache", k=8).command(8080)
    cache, mod = Served("cache", spec_type="ngram-cache"), Served("mod", spec_type="ngram-mod")
    assert cache.ks([2, 4]) == [8] and mod.ks([2, 4]) == [2, 4]

    def gen(ms, n):
        return llama_cpp.Completion(tokens=list(range(10)), draft_n=n, draft_n_accepted=n // 2, predicted_ms=ms)

    items = [("code", i) for i in range(3)]
    measured = {"items": items, "costs": {},
                "completions": {"plain": {(0, c, i): gen(100.0, 0) for c, i in items},
                                ("cache", 8): {(0, c, i): gen(90.0, 4) for c, i in items},
                                **{("mod", k): {(0, c, i): gen(95.0, 2) for c, i in items} for k in (2, 4)}},
                "counters": {key: {(0, c, i): DraftStats(verifications=2, rounds=4, drafted=4, accepted=2)
                                   for c, i in items} for key in [("cache", 8), ("mod", 2), ("mod", 4)]}}
    greedy = [dict(row("ngram", 1.5, 2.0, k=k, category="code"), batch_size=1) for k in (2, 4)]
    served = [Served("ngram", note="no llama.cpp counterpart"), cache, mod]
    rows = engine_figures(greedy, measured, served, repeats=1, pays_off_at=1.05)
    assert sorted((r["drafter"], r["k"]) for r in rows) == [("cache", 8), ("mod", 2), ("mod", 4)]
    alone = engine_figures([], measured, served, repeats=1, pays_off_at=1.05, alone=True, ks=[2, 4])
    assert sorted({(r["drafter"], r["k"]) for r in alone}) == [("cache", 8), ("mod", 2), ("mod", 4)]
    assert all(r["engine_acceptance_length"] == pytest.approx(1.5) for r in alone)  # 1 + 2 accepted / 4 rounds


def test_a_draft_lm_gets_the_vocabulary_type_of_the_target_file_it_is_served_with(tmp_path):
    """llama-server drafts only with a draft whose vocabulary type is the target's. The converter writes a BPE
    vocabulary for a Gemma-3 directory without tokenizer.model where the shipped file has SentencePiece's: the
    draft's GGUF then takes the target file's tokenizer metadata, every other field and tensor unchanged; where the
    types already agree it is left alone."""
    import gguf
    import numpy as np

    def write(path, tokenizer: dict, tensors: dict):
        writer = gguf.GGUFWriter(path, arch="gemma3")
        writer.add_block_count(4)
        for key, (value, kind, sub_type) in tokenizer.items():
            writer.add_key_value(key, value, kind, sub_type=sub_type)
        for name, array in tensors.items():
            writer.add_tensor(name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    A, S, F, I = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.INT32
    tokens = ["<pad>", "<eos>", "a", "b"]
    weights = {"token_embd.weight": np.arange(8, dtype=np.float16).reshape(4, 2),
               "output_norm.weight": np.ones(2, dtype=np.float32)}
    write(tmp_path / "draft.gguf", {"tokenizer.ggml.model": ("gpt2", S, None), "tokenizer.ggml.tokens": (tokens, A, S),
                                    "tokenizer.ggml.merges": (["a b"], A, S)}, weights)
    write(tmp_path / "target.gguf", {"tokenizer.ggml.model": ("llama", S, None), "tokenizer.ggml.tokens": (tokens, A, S),
                                     "tokenizer.ggml.scores": ([0.0, 0.0, -1.0, -2.0], A, F),
                                     "tokenizer.ggml.token_type": ([3, 3, 1, 1], A, I)}, {})
    assert writing.with_tokenizer_of(tmp_path / "draft.gguf", tmp_path / "target.gguf")
    draft = gguf.GGUFReader(tmp_path / "draft.gguf")
    assert draft.fields["tokenizer.ggml.model"].contents() == "llama" and "tokenizer.ggml.merges" not in draft.fields
    assert draft.fields["tokenizer.ggml.scores"].contents() == [0.0, 0.0, -1.0, -2.0]
    assert draft.fields["general.architecture"].contents() == "gemma3" and draft.fields["gemma3.block_count"].contents() == 4
    assert {t.name: t.data.tolist() for t in draft.tensors} == {n: a.tolist() for n, a in weights.items()}
    assert not writing.with_tokenizer_of(tmp_path / "draft.gguf", tmp_path / "target.gguf")  # types agree now
