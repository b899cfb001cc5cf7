"""train/recipe.py: what the base recipe checks before it trains."""

from types import SimpleNamespace

from omegaconf import OmegaConf
from transformers import AutoTokenizer

from traffic.records import Record, prompt_ids
from train.data import warn_long_prompts


def _record(i: int, category: str, words: int) -> Record:
    return Record(messages=[{"role": "user", "content": " ".join(["hello"] * words)}], category=category,
                  id=f"{category}-{i}", source="held_out.jsonl", line=i + 1)


def test_prompts_longer_than_the_training_window_are_warned_of(tiny_world, capsys, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_world / "target")
    records = [_record(0, "chat", 3), _record(1, "rag", 200), _record(2, "rag", 300), _record(3, "rag", 400)]
    recipe = SimpleNamespace(
        cfg=OmegaConf.create({"trainer": {"max_length": 64}, "data": {"on_bad_record": "error"},
                              "evaluate": {"prompts_per_category": 2, "max_new_tokens": 16}}),
        eval_traffic=SimpleNamespace(records=records), tokenizer=tokenizer)
    warn_long_prompts(recipe.cfg, recipe.eval_traffic, recipe.tokenizer)
    out = capsys.readouterr().out
    # The third rag prompt is past prompts_per_category: the final evaluation never serves it.
    assert out.startswith("warning: 2 of the 3 prompts the final evaluation serves (rag: 2 of 2) reach past "
                          "trainer.max_length=64 tokens with their 16 new ones")
    longest = len(prompt_ids(records[2], tokenizer)) + 16
    assert f"(the longest to {longest})" in out and f"trainer.max_length={longest} trains" in out
    assert "reach past trainer.max_length" in caplog.text

    recipe.cfg.trainer.max_length = longest  # every served position inside the window: nothing to say
    warn_long_prompts(recipe.cfg, recipe.eval_traffic, recipe.tokenizer)
    assert capsys.readouterr().out == ""
