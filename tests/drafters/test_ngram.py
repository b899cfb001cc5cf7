import pytest
import torch

from drafters.ngram import NgramDrafter
from drafters.sampling import Sampling


def test_proposes_continuation_of_latest_longest_match():
    d = NgramDrafter(max_ngram=3)
    d.start(torch.tensor([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]))
    # The suffix [1, 2, 3] occurred twice before; the latest occurrence is followed by 7, 8, 5.
    assert d.propose(3, Sampling()).tokens.tolist() == [7, 8, 5]
    assert d.propose(10, Sampling()).tokens.tolist() == [7, 8, 5, 1, 2, 3]


def test_falls_back_to_shorter_ngrams_and_to_nothing():
    d = NgramDrafter(max_ngram=3, min_ngram=1)
    d.start(torch.tensor([4, 5, 6, 5]))
    assert d.propose(2, Sampling()).tokens.tolist() == [6, 5]  # only the 1-gram [5] matches
    d.start(torch.tensor([1, 2, 3]))
    assert len(d.propose(2, Sampling())) == 0


def test_commit_appends_kept_guesses_and_the_target_token():
    d = NgramDrafter()
    d.start(torch.tensor([1, 2, 1]))
    assert d.propose(2, Sampling()).tokens.tolist() == [2, 1]
    d.commit(1, 9)
    assert d.ids == [1, 2, 1, 2, 9]


def test_rejects_bad_ngram_bounds():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(max_ngram=1, min_ngram=2)
