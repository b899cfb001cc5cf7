"""scripts/show_rounds.py: the round-by-round rendering."""

from eval.speculative import Round
from helpers import load_script


def test_rounds_text_brackets_the_targets_own_token():
    decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)  # noqa: E731
    rounds = [Round(4, 2, 0.0, 0.0), Round(4, 0, 0.0, 0.0), Round(4, 4, 0.0, 0.0), Round(4, 1, 0.0, 0.0)]
    tokens = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # the last round was cut by the token budget after its guess
    assert load_script("show_rounds").rounds_text(tokens, rounds, decode) == "ab[c][d]efgh[i]j[]"
