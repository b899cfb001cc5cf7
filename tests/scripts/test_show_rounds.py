"""scripts/show_rounds.py: the round-by-round rendering."""

import importlib.util
from pathlib import Path

from eval.speculative import Round

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "show_rounds.py"


def _module():
    spec = importlib.util.spec_from_file_location("show_rounds", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rounds_text_brackets_the_targets_own_token():
    decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)  # noqa: E731
    rounds = [Round(4, 2, 0.0, 0.0), Round(4, 0, 0.0, 0.0), Round(4, 4, 0.0, 0.0), Round(4, 1, 0.0, 0.0)]
    tokens = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # the last round was cut by the token budget after its guess
    assert _module().rounds_text(tokens, rounds, decode) == "ab[c][d]efgh[i]j[]"
