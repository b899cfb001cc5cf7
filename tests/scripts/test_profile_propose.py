"""scripts/profile_propose.py profiles a drafter's propose calls inside real generations and ranks what they run."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "profile_propose.py"


def _rows(out: str, header: str) -> list[list[str]]:
    """The rows of the table under the line starting with `header`."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header)) + 4  # blank, heading, rule
    rows = []
    for line in lines[start:]:
        if not line.startswith("| "):
            break
        rows.append(line.strip("| ").split(" | "))
    return rows


def test_ranks_the_draft_lms_functions_and_operations_by_their_share_of_propose(tiny_world):
    out = subprocess.run([sys.executable, str(SCRIPT), "--target", str(tiny_world / "target"),
                          "--drafter", f"{{name: small, kind: draft_lm, path: {tiny_world / 'draft'}}}",
                          "--data", str(tiny_world / "company_logs" / "eval.jsonl"), "--prompts", "1",
                          "--max-new-tokens", "8", "--k", "3", "--top", "5"],
                         capture_output=True, text=True, check=True).stdout
    first = out.splitlines()[0]
    assert first.startswith("small (draft_lm) on ") and ", k = 3, " in first and "ms a round (median of" in first
    ours = _rows(out, "draftsmith's functions")
    ops = _rows(out, "the operations")
    assert len(ours) == 5 and len(ops) == 5
    # The drafter's propose holds (nearly: its decorator aside) every profiled second; shares fall down the table;
    # every row is this repository's own code, named by its path.
    shares = [float(r[0]) for r in ours]
    assert shares[0] > 0.9 and shares == sorted(shares, reverse=True)
    assert "(propose)" in ours[0][2] and all(r[2].startswith(("drafters/", "eval/")) for r in ours)
    own = [float(r[0]) for r in ops]
    assert own == sorted(own, reverse=True) and 0 < sum(own) <= 1.0001
    assert all(float(r[1]) > 0 for r in ours + ops)  # calls a round


def test_refuses_a_drafter_that_is_not_a_spec(tiny_world):
    out = subprocess.run([sys.executable, str(SCRIPT), "--target", str(tiny_world / "target"), "--drafter", "eagle"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "--drafter must be a mapping with name and kind" in out.stderr
