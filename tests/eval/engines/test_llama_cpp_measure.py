"""Reading what llama-server measured (eval/engines/llama_cpp_measure.py): its draft statistics per request and a
round's cost split into drafting and the rest."""

import pytest

from eval.engines import llama_cpp
from eval.engines.llama_cpp_measure import DraftCounters, DraftStats, RoundCosts


class FakeServer:
    """Hands out a log in the chunks given, as llama-server's log file grows between reads."""

    def __init__(self, *chunks):
        self.chunks = list(chunks)

    def new_log(self):
        return self.chunks.pop(0) if self.chunks else ""

STATS_1 = ("spec common_specu: statistics     draft-eagle3: #calls(b,g,a) =   10     94     94, #gen drafts =     94, "
           "#acc drafts =    81, #gen tokens =    373, #acc tokens =   274, #mean acc len = 3.91, dur(b,g,a) = 0.013, "
           "66.426, 0.043 ms\n")

STATS_2 = ("spec common_specu: statistics     draft-eagle3: #calls(b,g,a) =   11    109    109, #gen drafts =    109, "
           "#acc drafts =    95, #gen tokens =    433, #acc tokens =   321, #mean acc len = 3.94, dur(b,g,a) = 0.015, "
           "76.950, 0.051 ms\n")


def test_draft_counters_read_the_statistics_line_of_each_request_even_when_split_across_reads():
    counters = DraftCounters(FakeServer(STATS_1 + "slot release\n" + STATS_2[:60], "", STATS_2[60:]))
    assert counters.after(1) == DraftStats(verifications=94, drafted=373, accepted=274, draft_ms=66.426, rounds=94)
    assert counters.after(2) == DraftStats(verifications=109, drafted=433, accepted=321, draft_ms=76.950, rounds=109)
    with pytest.raises(RuntimeError, match="statistics for 2 of 3 requests"):
        counters.after(3, timeout=0.05)


def test_round_costs_split_a_round_into_drafting_and_the_rest():
    """Two answers of 11 tokens from a server that keeps no draft: each 1 token from the prompt, 9 from
    verifications and 1 from a plain step (too few left to draft). The plain step is 2 ms."""
    costs = RoundCosts()
    for _ in range(2):
        costs = costs.add(llama_cpp.Completion(list(range(11)), 36, 0, predicted_ms=9 * (4 * 1.0 + 6.0) + 2.0),
                          DraftStats(verifications=9, drafted=36, accepted=0, draft_ms=36.0))
    assert costs.requests == 2 and costs.tokens == 22 and costs.stats.verifications == 18
    assert costs.c(2.0) == pytest.approx(0.5)  # 1 ms per drafted token over a 2 ms step
    assert costs.beta(2.0) == pytest.approx(6.0 / 2.0 - 1)  # 6 ms of each round outside drafting
    assert RoundCosts().c(2.0) is None and RoundCosts().beta(2.0) is None
