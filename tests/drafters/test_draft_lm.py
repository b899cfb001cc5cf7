import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from drafters.draft_lm import DraftLM, TokenizerMismatchError
from drafters.sampling import Sampling
from helpers import tiny_llama

VOCAB = 32


def word_tokenizer(words, eos="<eos>"):
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=eos)


WORDS = ["<unk>", "<eos>", "<bos>"] + [f"w{i}" for i in range(VOCAB - 3)]


def save(tmp_path, name, model, tokenizer):
    path = tmp_path / name
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def target():
    return tiny_llama(VOCAB, seed=0), word_tokenizer(WORDS)


def test_loads_a_draft_with_the_same_tokenizer(tmp_path, target):
    model, tok = target
    path = save(tmp_path, "draft", tiny_llama(VOCAB, seed=1), word_tokenizer(WORDS))
    drafter = DraftLM.from_pretrained(path, target=model, target_tokenizer=tok, name="d")
    drafter.start(torch.tensor([1, 2, 3]))
    assert len(drafter.propose(3, Sampling())) == 3


def test_weights_only_draft_is_checked_by_vocabulary_size(tmp_path, target):
    model, tok = target
    path = save(tmp_path, "draft", tiny_llama(VOCAB, seed=1), None)
    assert DraftLM.from_pretrained(path, target=model, target_tokenizer=tok).name == str(path)
    bad = save(tmp_path, "bad", tiny_llama(VOCAB + 8, seed=1), None)
    with pytest.raises(TokenizerMismatchError, match="40 logits but the target has 32"):
        DraftLM.from_pretrained(bad, target=model, target_tokenizer=tok)


def test_different_tokenizer_of_the_same_size_is_an_error(tmp_path, target):
    model, tok = target
    shuffled = WORDS[:3] + list(reversed(WORDS[3:]))
    path = save(tmp_path, "draft", tiny_llama(VOCAB, seed=1), word_tokenizer(shuffled))
    with pytest.raises(TokenizerMismatchError, match="different tokenizer"):
        DraftLM.from_pretrained(path, target=model, target_tokenizer=tok, name="shuffled")


def test_different_special_tokens_are_an_error(tmp_path, target):
    model, tok = target
    path = save(tmp_path, "draft", tiny_llama(VOCAB, seed=1), word_tokenizer(WORDS, eos="<bos>"))
    with pytest.raises(TokenizerMismatchError, match="eos_token_id"):
        DraftLM.from_pretrained(path, target=model, target_tokenizer=tok)


def test_toy_world_draft_matches_its_target(tiny_world):
    from eval.run import load_target, pick_device

    model, tok = load_target(str(tiny_world / "target"), device=pick_device("cpu"))
    drafter = DraftLM.from_pretrained(tiny_world / "draft", target=model, target_tokenizer=tok, name="toy")
    assert drafter.name == "toy"
