"""scripts/tinystories_traffic.py: story paragraphs into prompt records draftsmith reads."""

from helpers import load_script
from traffic.records import load_records

TEXT = """Once upon a time, there was a cat. The cat liked milk.

"Hello," said the dog. "Do you want to play?" The cat said yes.

They played all day. Then they slept.

The end."""


def test_paragraphs_become_prompt_records_split_into_train_and_eval(tmp_path):
    script = load_script("tinystories_traffic")
    rows = script.records(TEXT)
    assert [(r["category"], r["prompt"], r["response"]) for r in rows] == [
        ("opening", "Once upon a time, there was a cat.", " The cat liked milk."),
        ("dialogue", '"Hello," said the dog.', ' "Do you want to play?" The cat said yes.'),
        ("narration", "They played all day.", " Then they slept."),
    ]  # a one-sentence paragraph has nothing to answer
    source = tmp_path / "stories.txt"
    source.write_text("\n\n".join([TEXT] * 40))
    counts = script.write(source, tmp_path / "traffic")
    assert sum(counts["train"].values()) == 110 and sum(counts["eval"].values()) == 10  # the tenth block of ten
    records, _ = load_records(str(tmp_path / "traffic" / "eval.jsonl"))
    assert {r.category for r in records} == {"opening", "dialogue", "narration"}
    assert records[0].messages == [{"role": "user", "content": rows[0]["prompt"]},
                                   {"role": "assistant", "content": rows[0]["response"]}]
