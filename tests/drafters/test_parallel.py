import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from drafters.parallel import mask_token_for, unused_row


def word_tokenizer(words, **special):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


TEXT = ["<unk>", "<|endoftext|>", "<|im_end|>", "def", "return", "x"]


def test_the_tokenizers_mask_token_comes_first():
    tok = word_tokenizer(TEXT + ["<mask>"], mask_token="<mask>", eos_token="<|im_end|>")
    assert mask_token_for(tok, vocab_size=16) == 6


def test_an_embedding_padded_past_the_tokenizer_gives_its_first_unused_row():
    tok = word_tokenizer(TEXT, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    assert mask_token_for(tok, vocab_size=8) == len(TEXT)


def test_a_gguf_vocabulary_names_its_padding_rows_and_the_first_is_the_mask_not_a_text_token():
    # llama.cpp's converter lists the rows past the tokenizer as `[PAD<i>]` (Qwen2.5: 151665 onwards), so the
    # tokenizer transformers reads from the GGUF file covers the whole embedding; the mask is the first padding row,
    # as with the model's own tokenizer, never `<|endoftext|>` (the pad token), which the drafter reads in its text
    gguf = word_tokenizer(TEXT + ["[PAD6]", "[PAD7]"], pad_token="<|endoftext|>", eos_token="<|im_end|>")
    assert len(gguf) == 8 and unused_row(gguf, 8) == 6
    assert mask_token_for(gguf, vocab_size=8) == 6
    hf = word_tokenizer(TEXT, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    assert mask_token_for(hf, vocab_size=8) == mask_token_for(gguf, vocab_size=8)


def test_a_padding_name_at_another_id_is_a_text_token():
    tok = word_tokenizer(TEXT + ["[PAD9]"], pad_token="<|endoftext|>", eos_token="<|im_end|>")
    assert unused_row(tok, 7) is None
    assert mask_token_for(tok, vocab_size=7) == 1  # no unused row: the pad token


def test_without_any_candidate_it_asks_for_drafter_mask_token_id():
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token=None)))
    with pytest.raises(ValueError, match="drafter.mask_token_id"):
        mask_token_for(tok, vocab_size=2)
