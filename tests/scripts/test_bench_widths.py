"""scripts/bench_widths.py times a forward and the output head at every width and dtype asked for."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_widths.py"


def test_reports_every_width_in_each_dtype_as_a_multiple_of_one_position(tiny_world):
    out = subprocess.run([sys.executable, str(SCRIPT), "--target", str(tiny_world / "target"), "--widths", "3,5",
                          "--dtypes", "float32,bfloat16", "--context", "8", "--blocks", "1", "--per-block", "2"],
                         capture_output=True, text=True, check=True).stdout
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| float32") or
            line.startswith("| bfloat16")]
    assert [(r[0], r[1]) for r in rows] == [("| float32", "forward"), ("| float32", "output head"),
                                           ("| bfloat16", "forward"), ("| bfloat16", "output head")]
    header = next(line for line in out.splitlines() if line.startswith("| dtype"))
    assert header.split(" | ")[2:5] == ["1", "3", "5"]  # width 1 added: every figure is a ratio to it
    for r in rows:
        assert r[2] == "1.00" and all(float(x) > 0 for x in r[3:5]) and r[5].endswith("ms |")


def test_refuses_an_unknown_dtype(tiny_world):
    out = subprocess.run([sys.executable, str(SCRIPT), "--target", str(tiny_world / "target"), "--dtypes", "int8"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "dtype must be one of" in out.stderr
