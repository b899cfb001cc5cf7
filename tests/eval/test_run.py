import json
import re

import pytest
import torch

from drafters.layers import finish_logits
from eval.run import (build_drafter, dtype_of, load_prompts, load_target, load_target_ends, prompt_budget, read_traffic,
                      resolve_data, tokenize_prompts)
from helpers import FAMILIES, tiny
from eval.report_tables import traffic_lines
from traffic.records import RecordError


def test_configured_chat_template_replaces_the_tokenizers(tiny_world, tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    _, tok = load_target(str(tiny_world / "target"), device=torch.device("cpu"), chat_template=template)
    assert tok.chat_template == template
    path = tmp_path / "t.jinja"
    path.write_text(template)
    _, tok = load_target(str(tiny_world / "target"), device=torch.device("cpu"), chat_template=str(path))
    assert tok.chat_template == template


def test_prompts_per_category_are_capped(tiny_world):
    _, tok = load_target("toyworld://tiny/target", device=torch.device("cpu"))
    prompts = load_prompts("toyworld://tiny/company_logs/eval.jsonl", tok, device=torch.device("cpu"),
                           max_per_category=2)
    assert set(prompts) == {"code", "json", "prose"} and all(len(p) == 2 for p in prompts.values())


def test_a_prompt_longer_than_the_context_allows_is_an_error_naming_both_settings_or_skipped_and_counted(
        tiny_world, tmp_path):
    """The limit defaults to the target's context less the generation budget; on_bad_record=skip skips and
    counts a longer prompt (it does not take a category's place), and the report's data entry says so."""
    target, tok = load_target("toyworld://tiny/target", device=torch.device("cpu"))
    context = target.config.max_position_embeddings
    assert prompt_budget(target.config, 64) == (context - 64, f"the target's context of {context} tokens less "
                                                "max_new_tokens=64; data.max_prompt_tokens sets another")
    assert prompt_budget(target.config, 64, 300) == (300, "data.max_prompt_tokens")
    with pytest.raises(ValueError, match=f"max_new_tokens={context} leaves no room"):
        prompt_budget(target.config, context)
    short, long = "Say hi.", "word " * context
    path = tmp_path / "logs.jsonl"
    path.write_text("".join(f'{{"id": "r{i}", "category": "prose", "prompt": "{text}"}}\n'
                            for i, text in enumerate([short, long, short])))
    limit, why = prompt_budget(target.config, 16)
    traffic = read_traffic(str(path))
    with pytest.raises(RecordError, match=rf"logs.jsonl:2: field 'messages': prompt is \d+ tokens, longer than the "
                                          rf"{limit} allowed \(the target's context .*\); data.on_bad_record=skip"):
        tokenize_prompts(traffic, tok, device=torch.device("cpu"), max_prompt_tokens=limit, why=why)
    prompts = tokenize_prompts(traffic, tok, device=torch.device("cpu"), max_prompt_tokens=limit, why=why,
                               on_bad_record="skip", max_per_category=2)
    assert len(prompts["prose"]) == 2 and traffic.too_long == 1
    assert traffic.describe(prompts)["skipped_too_long"] == 1


def test_a_category_of_only_over_long_prompts_is_named_as_not_measured_and_the_others_are_measured(
        tiny_world, tmp_path):
    """Long RAG prompts on a target with a short context: that category is left out and named with its count;
    with every prompt skipped, the error names the limit and the setting behind it."""
    target, tok = load_target("toyworld://tiny/target", device=torch.device("cpu"))
    long = "word " * target.config.max_position_embeddings
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(f'{{"question_id": {i}, "category": "{category}", "turns": ["{text}"]}}\n' for i, (category, text)
                            in enumerate([("rag", long), ("chat", "Say hi."), ("rag", long), ("chat", "Hello.")])))
    limit, why = prompt_budget(target.config, 8)
    traffic = read_traffic(str(path), format="questions")
    prompts = tokenize_prompts(traffic, tok, device=torch.device("cpu"), max_prompt_tokens=limit, why=why,
                               on_bad_record="skip", max_per_category=2)
    assert list(prompts) == ["chat"] and len(prompts["chat"]) == 2  # no empty entry for rag
    assert traffic.describe(prompts)["emptied"] == {"rag": 2} and traffic.too_long == 2
    assert ("not measured: rag, all 2 of its prompts read were longer than the context allows"
            in traffic_lines({"data": traffic.describe(prompts)}))  # what the report and the console print

    rag = read_traffic(str(path), format="questions")
    rag.records = [r for r in rag.records if r.category == "rag"]
    with pytest.raises(ValueError, match=rf"all 2 prompts read are longer than the {limit} tokens allowed "
                                         r"\(the target's context of \d+ tokens less max_new_tokens=8; "
                                         r"data.max_prompt_tokens sets another\), so none is left to measure"):
        tokenize_prompts(rag, tok, device=torch.device("cpu"), max_prompt_tokens=limit, why=why, on_bad_record="skip")


def test_clear_errors_for_bad_names(tiny_world):
    with pytest.raises(ValueError, match="no preset 'mymodel'.*data.path=FILE"):
        resolve_data("toyworld://mymodel/company_logs/eval.jsonl")
    with pytest.raises(ValueError, match="dtype must be one of"):
        dtype_of("fp8")
    target, tok = load_target("toyworld://tiny/target", device=torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a path"):
        build_drafter({"name": "d", "kind": "draft_lm"}, target=target, tokenizer=tok)


def test_the_confidence_stop_reaches_the_drafter(tiny_world):
    target, tok = load_target("toyworld://tiny/target", device=torch.device("cpu"))
    draft = build_drafter({"name": "d", "kind": "draft_lm", "path": "toyworld://tiny/draft", "stop_below": 0.3},
                          target=target, tokenizer=tok)
    assert draft.stop.below == 0.3
    with pytest.raises(ValueError, match="drafter 'd': stop_below must be in"):
        build_drafter({"name": "d", "kind": "draft_lm", "path": "toyworld://tiny/draft", "stop_below": 1.5},
                      target=target, tokenizer=tok)
    with pytest.raises(ValueError, match="stop_below needs a drafter with probabilities"):
        build_drafter({"name": "n", "kind": "ngram", "stop_below": 0.3}, target=target, tokenizer=tok)


def test_the_built_in_worlds_draft_with_another_target_stops_before_any_work():
    """A command that set target.name_or_path alone keeps the toy world's draft (conf/target/toy.yaml): stopped as
    soon as the target is loaded, naming the key and the fix, not by the vocabulary check at the end of a run."""
    from eval.run import check_draft_vocabulary
    from helpers import tiny_llama

    mine = tiny_llama(vocab=128_256 // 1000)
    with pytest.raises(ValueError, match=r"target.off_the_shelf_draft=toyworld://toy/draft is the built-in 'toy' "
                                         r"world's draft \(4096 tokens\).*vocabulary of 128.*off_the_shelf_draft=null"):
        check_draft_vocabulary(mine, "toyworld://toy/draft", "target.off_the_shelf_draft")
    # The same vocabulary (a model of another family on the world's tokenizer, a GGUF of its target) is a pairing.
    check_draft_vocabulary(tiny_llama(vocab=320), "toyworld://tiny/draft", "target.off_the_shelf_draft")
    check_draft_vocabulary(mine, "/models/draft", "target.off_the_shelf_draft")  # the user's own: checked when loaded
    check_draft_vocabulary(mine, None, "target.off_the_shelf_draft")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_targets_ends_load_without_its_layers_and_give_its_logits_from_its_last_feature(family, tmp_path):
    """drafter.target_weights=ends: the embedding, final norm and output head read from the safetensors shards that
    hold them (every other shard deleted first, so no layer can have been read), and from the last layer's feature
    they give the whole target's logits, as head training reads them. Running the target is an error."""
    full = tiny(family)
    full.save_pretrained(tmp_path, max_shard_size="20KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    layers = {name for name in weight_map if re.search(r"\.(layers|h)\.\d+\.", name)}
    ends_files = {weight_map[name] for name in weight_map.keys() - layers}
    for name in set(weight_map.values()) - ends_files:
        (tmp_path / name).unlink()
    assert set(weight_map.values()) - ends_files, "the shards were too large to leave any out"
    ends = load_target_ends(str(tmp_path), dtype=torch.float32)
    assert sum(p.numel() for p in ends.parameters()) < sum(p.numel() for p in full.parameters()) / 2
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        out = full(input_ids=ids, output_hidden_states=True)
        logits = finish_logits(ends.config, ends.get_output_embeddings()(out.hidden_states[-1]))
        torch.testing.assert_close(logits, out.logits)
        torch.testing.assert_close(ends.get_input_embeddings()(ids), full.get_input_embeddings()(ids))
        with pytest.raises(RuntimeError, match="layer 0 was not loaded: drafter.target_weights=ends loads"):
            ends(input_ids=ids)


def test_a_targets_ends_name_what_they_cannot_read(tiny_world, tmp_path):
    with pytest.raises(ValueError, match="must be one of \\['all', 'ends'\\], got 'middle'"):
        load_target(str(tiny_world / "target"), device=torch.device("cpu"), weights="middle")
    full = tiny("llama")
    full.save_pretrained(tmp_path / "bin", safe_serialization=True)
    (tmp_path / "bin" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors; drafter.target_weights=ends reads safetensors"):
        load_target_ends(str(tmp_path / "bin"), dtype=torch.float32)
    target, tok = load_target(str(tiny_world / "target"), device=torch.device("cpu"), weights="ends")
    assert tok.eos_token_id is not None and not any(p.is_meta for p in target.parameters())
