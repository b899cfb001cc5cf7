"""scripts/show_rounds.py: the round-by-round rendering."""

from eval.speculative import Round
from helpers import load_script


def test_rounds_text_brackets_the_targets_own_token():
    decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)  # noqa: E731
    rounds = [Round(4, 2, 0.0, 0.0), Round(4, 0, 0.0, 0.0), Round(4, 4, 0.0, 0.0), Round(4, 1, 0.0, 0.0)]
    # The first token comes from the prefill; the last round was cut by the token budget after its guess.
    tokens = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert load_script("show_rounds").rounds_text(tokens, rounds, decode) == "abc[d][e]fghi[j]k[]"
