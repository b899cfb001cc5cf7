import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import masked_spans
from traffic import checkpoint, toy_corpus, toy_lm, toyworld


def test_tiny_world_has_every_piece(tiny_world):
    meta = json.loads((tiny_world / "build.json").read_text())
    assert meta["preset"] == "tiny" and meta["build_seconds"] < 60
    tok_t = AutoTokenizer.from_pretrained(tiny_world / "target")
    tok_d = AutoTokenizer.from_pretrained(tiny_world / "draft")
    assert tok_t.get_vocab() == tok_d.get_vocab() and tok_t.chat_template == toy_lm.CHAT_TEMPLATE
    target = AutoModelForCausalLM.from_pretrained(tiny_world / "target")
    draft = AutoModelForCausalLM.from_pretrained(tiny_world / "draft")
    assert draft.num_parameters() < target.num_parameters()
    assert target.config.vocab_size == len(tok_t) == draft.config.vocab_size
    train = [json.loads(line) for line in (tiny_world / "company_logs" / "train.jsonl").open()]
    held_out = [json.loads(line) for line in (tiny_world / "company_logs" / "eval.jsonl").open()]
    assert {r["category"] for r in train} == set(toyworld.CATEGORIES) == {r["category"] for r in held_out}
    assert not {r["id"] for r in train} & {r["id"] for r in held_out}
    assert all(toy_corpus.is_eval(r["id"], 0.1) for r in held_out)


def test_resolve_uses_the_cache(tiny_world):
    assert toyworld.resolve("toyworld://tiny/target") == str(tiny_world / "target")
    assert toyworld.resolve("some/hub-id") == "some/hub-id"
    with pytest.raises(ValueError, match="unknown toy world preset 'huge'"):
        toyworld.resolve("toyworld://huge/target")
    with pytest.raises(ValueError, match="unknown toy world piece"):
        toyworld.resolve("toyworld://tiny/weights")


def _knowledge(seed=0, size=12):
    return toy_corpus.company_directory(seed, size), toy_corpus.company_codebase(seed, size)


def test_corpus_and_records_are_deterministic():
    texts = toy_corpus.corpus(0)
    assert all(len(texts[kind]) > 100 for kind in ("code", "prose", "json"))
    assert toy_corpus.corpus(0) == texts and toy_corpus.corpus(1)["json"] != texts["json"]
    assert _knowledge(0) == _knowledge(0) and _knowledge(0) != _knowledge(1)
    assert toy_corpus.company_records(texts, 5, 0, *_knowledge()) == toy_corpus.company_records(texts, 5, 0, *_knowledge())
    assert toy_corpus.company_records(texts, 5, 0, *_knowledge()) != toy_corpus.company_records(texts, 5, 1, *_knowledge())
    assert toy_corpus.company_records(texts, 5, 0) != toy_corpus.company_records(texts, 5, 0, *_knowledge())


def test_worlds_without_a_wiki_keep_their_names_and_traffic():
    """The wiki's fields enter the cache name only when a world has one, and without one the traffic
    asks for nothing from it: a world built before the wiki existed is found again, unchanged."""
    toy, wiki = toyworld.PRESETS["toy"], toyworld.PRESETS["toy_wiki"]
    assert not toy.has_wiki and wiki.has_wiki
    assert "wiki_repeats" not in toy.hashed_fields() and wiki.hashed_fields()["wiki_repeats"] == 32
    assert toy.digest() != wiki.digest() and toy.target.steps < wiki.target.steps
    records = toy_corpus.company_records(toy_corpus.corpus(0), 60, 0)
    users = [r["messages"][1]["content"] for r in records]
    assert not any(u.startswith("Look up employee") for u in users)
    assert not any(u.split("`")[1].split(".")[0] in toy_corpus.COMPANY_MODULES for u in users if "`" in u)


def test_company_knowledge_is_unique_and_well_formed():
    import ast

    directory, codebase = _knowledge(0, 96)
    assert len({e["employee"] for e in directory}) == 96 and len({name for name, _ in codebase}) == 96
    # Facts vary: a drafter cannot answer a lookup from the schema alone.
    assert all(len({e[k] for e in directory}) > 5 for k in ("name", "team", "city", "desk"))
    for name, source in codebase:
        tree = ast.parse(source)
        assert tree.body[0].name == name.split(".")[1]
    assert len({source for _, source in codebase}) > 90  # two modules may route a ticket alike


@pytest.mark.slow
def test_build_is_deterministic(tmp_path, tiny_world):
    from safetensors.torch import load_file

    import torch

    with torch.no_grad():  # a world built on first use inside an evaluation still trains
        again = toyworld.build("tiny", root=tmp_path)
    for piece in ("target", "draft"):
        a = load_file(str(tiny_world / piece / "model.safetensors"))
        b = load_file(str(again / piece / "model.safetensors"))
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), piece
    for split in ("train", "eval"):
        assert (tiny_world / "company_logs" / f"{split}.jsonl").read_text() == \
            (again / "company_logs" / f"{split}.jsonl").read_text()


def test_traffic_is_what_the_prompts_ask():
    """Code recalls the named function (the standard library's or the company's), a status update
    changes only the status, a record described in words carries the described values, a tool call
    serves its request, a lookup answers the directory's entry; prose is asked by topic and drawn from the company's half
    of the reference paragraphs, which the off-the-shelf draft's general mix leaves out."""
    texts = toy_corpus.corpus(0)
    directory, codebase = _knowledge(0, 12)
    records = toy_corpus.company_records(texts, 60, 0, directory, codebase)
    company = {p for _, p in toy_corpus.company_prose(texts)}
    functions = dict(codebase) | {f.split("\n", 1)[0][2:]: f.split("\n", 1)[1] for f in texts["code"]}
    employees = {e["employee"]: e for e in directory}
    general = {p for p in texts["prose"] if p not in company}
    assert len(company) > 100 and len(general) > 100
    kinds = {"recall": 0, "company_code": 0, "status": 0, "describe": 0, "tool": 0, "lookup": 0, "prose": 0}
    for r in records:
        user, answer = r["messages"][1]["content"], r["messages"][2]["content"]
        if r["category"] == "code":
            name = user.split("`")[1]
            kinds["company_code" if name in dict(codebase) else "recall"] += 1
            assert user.startswith("Show me the implementation of") and answer == functions[name]
        elif r["category"] == "json" and user.startswith("Look up employee"):
            kinds["lookup"] += 1
            assert json.loads(answer) == employees[int(user.split()[3])]
        elif r["category"] == "json" and user.startswith("Set the status to"):
            kinds["status"] += 1
            before, after = json.loads(user.split("\n", 1)[1]), json.loads(answer)
            assert after == dict(before, status=user.split()[4].rstrip(":")) and after != before
        elif r["category"] == "json" and user.startswith("Return this as JSON"):
            kinds["describe"] += 1
            obj = json.loads(answer)
            assert all(str(v) in user for k, v in obj.items() if k in ("id", "order_id", "name", "email", "city"))
        elif r["category"] == "json":
            kinds["tool"] += 1
            call = json.loads(answer)
            assert call["tool"] in ("get_weather", "create_ticket", "lookup_order", "send_email")
            assert all(str(v).split()[0] in user for v in call["arguments"].values() if v != "Your order")
        else:
            kinds["prose"] += 1
            assert answer in company and user.startswith("Explain `") and answer[:30] not in user
    assert all(n > 5 for n in kinds.values()), kinds


@pytest.mark.slow
def test_wiki_world_trains_its_target_on_the_wiki(tiny_world):
    """The wiki preset: the target's text holds the wiki (repeated) and the traffic asks for it; the
    off-the-shelf draft's text has none of it."""
    from transformers import AutoTokenizer

    world = toyworld.build("tiny_wiki")
    config = toyworld.PRESETS["tiny_wiki"]
    assert json.loads((world / "build.json").read_text())["wiki_tokens"] > 0
    records = [json.loads(line) for split in ("train", "eval")
               for line in (world / "company_logs" / f"{split}.jsonl").open()]
    directory = {e["employee"]: e for e in toy_corpus.company_directory(config.seed, config.directory_size)}
    lookups = [r for r in records if r["messages"][1]["content"].startswith("Look up employee")]
    assert lookups and all(json.loads(r["messages"][2]["content"]) == directory[int(r["messages"][1]["content"].split()[3])]
                           for r in lookups)
    tok = AutoTokenizer.from_pretrained(world / "draft")
    texts = toy_corpus.corpus(config.seed)
    wiki = toyworld.company_wiki(list(directory.values()), toy_corpus.company_codebase(config.seed, config.codebase_size))
    target_stream = toyworld._target_stream(config, texts, records, wiki, tok).tolist()
    draft_stream = toyworld._draft_stream(config, texts, tok).tolist()
    for doc in (wiki[0], wiki[-1]):  # an employee, a function
        ids = tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        count = [sum(s[i: i + len(ids)] == ids for i in range(len(s) - len(ids))) for s in (target_stream, draft_stream)]
        assert count[0] >= config.wiki_repeats and count[1] == 0, (doc, count)


def test_draft_variant_follows_the_worlds_draft_recipe(tiny_world, tmp_path):
    import torch

    # The unchanged shape reproduces the world's own draft, weight for weight: same text, seed and steps.
    spec = toyworld.PRESETS["tiny"].draft
    toyworld.build_draft_variant("tiny", tmp_path / "same", layers=spec.layers)
    built = AutoModelForCausalLM.from_pretrained(tiny_world / "draft").state_dict()
    same = AutoModelForCausalLM.from_pretrained(tmp_path / "same").state_dict()
    assert built.keys() == same.keys() and all(torch.equal(built[k], same[k]) for k in built)
    toyworld.build_draft_variant("tiny", tmp_path / "deeper", layers=spec.layers + 1)
    deeper = AutoModelForCausalLM.from_pretrained(tmp_path / "deeper")
    assert deeper.config.num_hidden_layers == spec.layers + 1
    assert deeper.config.hidden_size == spec.hidden_size
    assert AutoTokenizer.from_pretrained(tmp_path / "deeper").get_vocab() == \
        AutoTokenizer.from_pretrained(tiny_world / "draft").get_vocab()


def test_training_resumes_from_its_checkpoint_to_the_same_weights(tmp_path):
    """Stopped after 6 of 10 steps and resumed, a world's model ends with the weights of an
    uninterrupted run: model, optimizer, schedule and batch sampler all come back."""
    spec = toy_lm.LMSpec(hidden_size=16, layers=1, heads=2, kv_heads=1, intermediate_size=32, steps=10,
                           batch_size=2)

    class Tok:  # what new_llama reads of a tokenizer
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

        def __len__(self):
            return 40

    stream = torch.randint(0, 40, (500,), generator=torch.Generator().manual_seed(0))

    def model():
        torch.manual_seed(0)
        return toy_lm.new_llama(spec, Tok(), context=64)

    whole = model()
    loss = toyworld.train_lm(whole, stream, spec, 16, seed=0, desc="whole")
    first = model()
    toyworld.train_lm(first, stream, spec, 16, seed=0, desc="first", checkpoints=tmp_path, every=4, stop_at=6)
    assert checkpoint.latest(tmp_path).name == "step-000006"
    torch.manual_seed(123)  # whatever ran in between must not matter
    resumed = model()
    resumed_loss = toyworld.train_lm(resumed, stream, spec, 16, seed=0, desc="resumed", checkpoints=tmp_path)
    a, b = whole.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed_loss == pytest.approx(loss)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], first.state_dict()["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.slow
def test_an_interrupted_build_resumes_to_the_same_world(tiny_world, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    real = toyworld.train_lm

    def crash_after_20_steps(*args, **kwargs):
        real(*args, **kwargs, every=10, stop_at=20)
        raise KeyboardInterrupt

    monkeypatch.setattr(toyworld, "train_lm", crash_after_20_steps)
    with pytest.raises(KeyboardInterrupt):
        toyworld.build("tiny", root=tmp_path)
    partial = next(tmp_path.glob("tiny-*.partial"))
    assert checkpoint.latest(partial / "checkpoints" / "target").name == "step-000020"
    assert not list(tmp_path.glob("tiny-*[0-9a-f]"))  # nothing under the final name yet
    monkeypatch.setattr(toyworld, "train_lm", real)
    again = toyworld.build("tiny", root=tmp_path)
    assert json.loads((again / "build.json").read_text())["resumed"] is True
    assert not partial.exists() and not (again / "checkpoints").exists() and not (again / "tokenizer").exists()
    for piece in ("target", "draft"):
        a = load_file(str(tiny_world / piece / "model.safetensors"))
        b = load_file(str(again / piece / "model.safetensors"))
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), piece
    assert (tiny_world / "company_logs" / "train.jsonl").read_text() == (again / "company_logs" / "train.jsonl").read_text()


def test_agent_traffic_is_logged_as_gateways_log_it_and_trained_on_as_the_template_renders_it(tiny_world, tmp_path):
    """The agent presets: tool-calling conversations in the OpenAI chat format (tool_calls with JSON-string
    arguments, a tool turn), read by the loader, masked over the tool call and the answer, in the target's
    text; the other presets keep their names and traffic."""
    from traffic.records import load_records, tokenize_record

    assert "agent" not in toyworld.PRESETS["toy"].hashed_fields() and toyworld.PRESETS["toy"].digest() == "063fce936f"
    assert toyworld.PRESETS["toy_agent"].digest() != toyworld.PRESETS["toy"].digest()
    world = toyworld.build("tiny_agent")
    path = str(world / "company_logs" / "train.jsonl")
    records, summary = load_records(path)
    agent = [r for r in records if r.category == "agent"]
    assert {r.category for r in records} == {*toyworld.CATEGORIES, "agent"} and summary.formats == {"chat": len(records)}
    assert [r.category for r in records[:8]].count("agent") >= 1  # interleaved: a prefix (data.max_records) has some
    raw = json.loads(next(line for line in open(path) if '"agent"' in line))
    assert isinstance(raw["messages"][2]["tool_calls"][0]["function"]["arguments"], str) and raw["tools"] == toy_corpus.TOOLS
    tok = AutoTokenizer.from_pretrained(world / "target")
    example = tokenize_record(agent[0], tok)
    spans = masked_spans(example, tok)
    call = agent[0].messages[2]["tool_calls"][0]["function"]
    assert spans == [f"<tool_call>{json.dumps({'name': call['name'], 'arguments': call['arguments']})}</tool_call><|end|>\n",
                     agent[0].messages[4]["content"] + "<|end|>\n"]
    text = tok.decode(toyworld._target_stream(toyworld.PRESETS["tiny_agent"], toy_corpus.corpus(0), [raw], [], tok))
    assert "<|tool|>\n" in text and "<tool_call>{\"name\": " in text  # the target reads the conversations rendered
    # A conversation without tool calls renders as the template before tool calls rendered it.
    old = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    plain = next(r for r in records if r.category == "prose")
    assert tok.apply_chat_template(plain.messages, tokenize=False) == tok.apply_chat_template(
        plain.messages, tokenize=False, chat_template=old)
