"""Convert a llama2.c model and tokenizer (the legacy `.bin` formats of karpathy/llama2.c) to a Hugging Face
Llama directory that every draftsmith command loads as a target or a draft:

    python scripts/import_llama2c.py --model ../shared/data/stories260K/stories260K.bin \
        --tokenizer ../shared/data/stories260K/tok512.bin --out runs/stories260K \
        [--draft-layers 1 --draft-out runs/stories260K-draft]

With --draft-layers N it also writes a draft LM made of the model's first N layers, its final norm and
its classifier (a layer-skip self-draft: what a team whose model has no smaller sibling starts from, and
what `python -m train` then distills).

The model file: 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative
vocab_size means the classifier is not shared with the embedding), then float32 tensors in llama2.c's
order (embedding, attention norms, wq, wk, wv, wo, MLP norms, w1, w2, w3, final norm, the legacy rotary
tables, the classifier if not shared). llama2.c rotates interleaved pairs of q and k, Hugging Face's Llama
rotates split halves: the rows of wq and wk are permuted so that both compute the same attention.

The tokenizer file: the longest piece's length (int32), then per piece its score (float32), its length
(int32) and its UTF-8 bytes, in id order, as llama2.c exports a SentencePiece BPE model (the word boundary
"▁" written as a space, BOS and EOS written as "\\n<s>\\n" and "\\n</s>\\n", bytes as "<0xXX>"). It becomes
the same BPE in the `tokenizers` library: the pieces, merges ranked by the score of the piece they make
(SentencePiece's order), byte fallback, and a Llama-2 normalizer and decoder.

llama2.c's models are base models trained on stories that each begin with BOS and end where the next one
begins: generation ends at BOS, so BOS is also the end of generation here. The chat template is plain
text (the turns' contents in order, after BOS), so a story opening in a `prompt` record is continued as
the model was trained to continue it.
"""

from __future__ import annotations

import argparse
import struct
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, normalizers
from tokenizers.models import BPE
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from traffic import models

BOS, EOS, UNK = 1, 2, 0
PLAIN_TEXT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


def read_model(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    raw = path.read_bytes()
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack("7i", raw[:28])
    shared, vocab = vocab > 0, abs(vocab)
    head_size, kv_dim = dim // heads, dim // heads * kv_heads
    data = np.frombuffer(raw, dtype=np.float32, offset=28)
    shapes = [("embed", (vocab, dim)), ("attn_norm", (layers, dim)), ("wq", (layers, dim, dim)),
              ("wk", (layers, kv_dim, dim)), ("wv", (layers, kv_dim, dim)), ("wo", (layers, dim, dim)),
              ("mlp_norm", (layers, dim)), ("w1", (layers, hidden, dim)), ("w2", (layers, dim, hidden)),
              ("w3", (layers, hidden, dim)), ("norm", (dim,)), ("rope_real", (seq_len, head_size // 2)),
              ("rope_imag", (seq_len, head_size // 2))] + ([] if shared else [("classifier", (vocab, dim))])
    expected = sum(int(np.prod(s)) for _, s in shapes)
    if data.size != expected:
        raise ValueError(f"{path}: {data.size} float32 values after the header, but a llama2.c model with "
                         f"dim {dim}, {layers} layers and vocabulary {vocab} has {expected}")
    tensors, at = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        tensors[name] = torch.from_numpy(data[at: at + n].copy()).view(shape)
        at += n
    config = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         tie_word_embeddings=shared, bos_token_id=BOS, eos_token_id=BOS, pad_token_id=UNK)
    state = {"model.embed_tokens.weight": tensors["embed"], "model.norm.weight": tensors["norm"],
             "lm_head.weight": tensors["embed"] if shared else tensors["classifier"]}
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": tensors["attn_norm"][i],
            p + "self_attn.q_proj.weight": _halves(tensors["wq"][i], heads),
            p + "self_attn.k_proj.weight": _halves(tensors["wk"][i], kv_heads),
            p + "self_attn.v_proj.weight": tensors["wv"][i],
            p + "self_attn.o_proj.weight": tensors["wo"][i],
            p + "post_attention_layernorm.weight": tensors["mlp_norm"][i],
            p + "mlp.gate_proj.weight": tensors["w1"][i],
            p + "mlp.down_proj.weight": tensors["w2"][i],
            p + "mlp.up_proj.weight": tensors["w3"][i],
        }
    return config, state


def _halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection reordered from interleaved rotary pairs to split halves, per head."""
    out_dim, in_dim = w.shape
    return w.view(heads, out_dim // heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def read_tokenizer(path: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    raw = path.read_bytes()
    at, pieces, scores = 4, [], []
    for _ in range(vocab_size):
        score, length = struct.unpack_from("fi", raw, at)
        piece = raw[at + 8: at + 8 + length].decode("utf-8")
        at += 8 + length
        pieces.append(piece)
        scores.append(score)
    if at != len(raw):
        raise ValueError(f"{path}: {len(raw) - at} bytes left after {vocab_size} pieces; not a llama2.c tokenizer "
                         "for this model")
    pieces = [p.replace(" ", "▁") for p in pieces]
    pieces[UNK], pieces[BOS], pieces[EOS] = "<unk>", "<s>", "</s>"
    vocab = {p: i for i, p in enumerate(pieces)}
    # SentencePiece BPE merges the pair whose merged piece scores highest first: rank the merges so.
    merges = sorted(((left, right) for p in pieces[3:] if not _is_byte(p) for k in range(1, len(p))
                     if (left := p[:k]) in vocab and (right := p[k:]) in vocab),
                    key=lambda m: (-scores[vocab[m[0] + m[1]]], vocab[m[0] + m[1]]))
    model = BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<s>", unk_token="<unk>",
                                   pad_token="<unk>", model_max_length=4096)
    fast.chat_template = PLAIN_TEXT_TEMPLATE
    return fast


def _is_byte(piece: str) -> bool:
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


def convert(model: Path, tokenizer: Path, out: Path) -> Path:
    config, state = read_model(model)
    tok = read_tokenizer(tokenizer, config.vocab_size)
    with torch.device("meta"):
        hf = LlamaForCausalLM(config)
    hf.load_state_dict(state, assign=True, strict=True)
    if config.tie_word_embeddings:
        hf.tie_weights()
    hf.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=BOS, pad_token_id=UNK)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def self_draft(model_dir: Path, layers: int, out: Path) -> Path:
    """The model at `model_dir` cut to its first `layers` layers (norm and classifier kept), with its tokenizer
    (traffic/models.py `self_draft`)."""
    return models.self_draft(model_dir, layers, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="llama2.c model (.bin)")
    parser.add_argument("--tokenizer", type=Path, required=True, help="llama2.c tokenizer (.bin)")
    parser.add_argument("--out", type=Path, required=True, help="Hugging Face directory to write")
    parser.add_argument("--draft-layers", type=int, help="also write a self-draft of the first N layers")
    parser.add_argument("--draft-out", type=Path, help="where the self-draft goes (with --draft-layers)")
    args = parser.parse_args()
    if (args.draft_layers is None) != (args.draft_out is None):
        parser.error("--draft-layers and --draft-out go together")
    print(convert(args.model, args.tokenizer, args.out))
    if args.draft_layers is not None:
        print(self_draft(args.out, args.draft_layers, args.draft_out))


if __name__ == "__main__":
    main()
