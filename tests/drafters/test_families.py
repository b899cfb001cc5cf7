"""Every common model family as the target: each head builds from the family's own config names, drafts
from the target's own output distribution (soft-capping and logit scaling included), trains, reloads, and
drafts losslessly; a draft LM of the same family too. Tiny random models from transformers' config classes
(tests/helpers.py, no downloads)."""

from __future__ import annotations

import pytest
import torch

from drafters.draft_lm import DraftLM
from drafters.pard import PardLM
from drafters.registry import build_head, load_head, save_head
from drafters.layers import SharedTarget
from drafters.sampling import Sampling
from drafters.tree import TreeShape
from eval.speculative import autoregressive_generate, speculative_generate
from helpers import FAMILIES, chi2_pvalue, empirical_joint, exact_joint, tiny
from train.hidden_states import capture, default_layers

GREEDY = Sampling()
SETTINGS = {
    "eagle": dict(ttt_steps=3, ttt_decay=0.8),
    "eagle1": dict(token_loss_weight=0.1),
    "mtp": dict(depth=3, module_decay=0.8),
    "medusa": dict(num_heads=3, num_layers=1, head_decay=0.8),
    "dflash": dict(num_layers=1, block_size=4, mask_token_id=1, loss_decay_gamma=4.0, max_anchors=16),
    "peagle": dict(num_depths=3, mask_token_id=1, cod_ratio=0.7, cod_min_ratio=0.2, max_anchors=64),
}
KINDS = sorted(SETTINGS)
NAMES = sorted(FAMILIES)


def make_head(kind: str, target, seed: int = 0):
    torch.manual_seed(seed)
    head = build_head(kind, target, default_layers(kind, target.config.num_hidden_layers), **SETTINGS[kind])
    with torch.no_grad():  # sharpen the random head so its guesses are decisive
        for p in head.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return head.eval()


def _ids(vocab: int, B: int = 2, T: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", NAMES)
def test_a_heads_label_and_drafting_distribution_is_the_targets_own(family):
    """The last hidden state through the output head, as heads label and draft with it, gives the softmax
    of the target forward's own logits: Gemma's soft-capping, Granite's and Cohere's scaling included."""
    target = tiny(family)
    ids = _ids(target.config.vocab_size)
    last = capture(target, ids, torch.ones_like(ids), [target.config.num_hidden_layers])[:, :, -1]
    ours = torch.softmax(SharedTarget(target).logits(last), -1)
    theirs = torch.softmax(target(input_ids=ids).logits.float(), -1)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["gemma3", "gpt2", "gpt_neox"])
def test_heads_use_silu_whatever_the_targets_activation(family):
    """The engines build a head's layer as their Llama block: vLLM's and SGLang's refuse any activation but
    SiLU, llama.cpp's EAGLE-3 graph computes SiLU. These families' own MLPs use GELU."""
    target = tiny(family)
    config = target.config.to_dict()
    assert "gelu" in next(config[k] for k in ("hidden_act", "hidden_activation", "activation_function") if config.get(k))
    for kind in ("eagle", "eagle1"):
        head = make_head(kind, target)
        assert head.config.hidden_act == "silu"
        ids = torch.tensor([[3, 5, 7]])  # the embedding's rows, without Gemma-3's scale: what the engines look up
        assert torch.equal(head.shared.embed_tokens(ids, torch.float32), target.get_input_embeddings().weight[ids])
        act, x = next(m for n, m in head.named_modules() if n.endswith("mlp")).act_fn, torch.linspace(-4, 4, 9)
        assert torch.equal(act(x), torch.nn.functional.silu(x))


@pytest.mark.parametrize("family", NAMES)
@pytest.mark.parametrize("kind", KINDS)
def test_every_head_trains_reloads_and_drafts_losslessly_on_every_family(family, kind, tmp_path):
    target = tiny(family)
    head = make_head(kind, target).train()
    ids = _ids(target.config.vocab_size, B=3, T=24, seed=1)
    attn, loss_mask = torch.ones_like(ids), torch.ones_like(ids)
    loss_mask[:, :6] = 0
    features = capture(target, ids, attn, list(head.config.feature_layers)).flatten(2)
    probs = torch.softmax(target(input_ids=ids).logits.float(), -1)
    opt = torch.optim.SGD([p for p in head.parameters() if p.requires_grad], lr=0.05)
    torch.manual_seed(1)  # the same draw both times where training samples (DFlash's anchors, P-EAGLE's depths)
    before, _ = head(features, ids, attn, loss_mask, probs)
    before.backward()
    opt.step()
    torch.manual_seed(1)
    after, _ = head(features, ids, attn, loss_mask, probs)
    assert torch.isfinite(before) and after < before  # one training step on this family's features
    head.eval()
    loaded = load_head(save_head(head, tmp_path / kind), target)
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    for prompt in ([5, 9, 3, 17], [40, 2, 11, 7, 30, 6]):
        prompt = torch.tensor(prompt)
        ref = autoregressive_generate(target, prompt, sampling=GREEDY, max_new_tokens=16).tokens
        for drafter in (head.drafter(kind), loaded.drafter(kind)):
            out = speculative_generate(target, drafter, prompt, k=3, sampling=GREEDY, max_new_tokens=16)
            assert out.tokens == ref, (family, kind, prompt.tolist())


def pard(model, depths=3):
    """`model` as a PARD draft (drafters/pard.py): its config names a mask token and its depths."""
    model.config.pard_token, model.config.pard_depths = 1, depths
    return model


@pytest.mark.parametrize("family", NAMES)
def test_a_draft_lm_of_the_same_family_drafts_losslessly(family):
    """A draft LM of the family, drafting in turn and as a PARD draft (k guesses in one forward from masks)."""
    target, draft = tiny(family, seed=0), tiny(family, seed=1)
    for prompt in ([5, 9, 3, 17], [40, 2, 11, 7, 30, 6]):
        prompt = torch.tensor(prompt)
        ref = autoregressive_generate(target, prompt, sampling=GREEDY, max_new_tokens=16).tokens
        for drafter in (DraftLM(draft), PardLM(pard(tiny(family, seed=1)))):
            out = speculative_generate(target, drafter, prompt, k=3, sampling=GREEDY, max_new_tokens=16)
            assert out.tokens == ref, (family, drafter.name, prompt.tolist())


@pytest.mark.parametrize("family", NAMES)
def test_trees_verify_losslessly_on_every_family(family):
    """Dynamic trees from the heads that draft them and from a draft LM of the family, verified in one target
    forward with the tree mask (per attention type: sliding-window layers included) and the tree's position ids."""
    target = tiny(family, seed=0)
    shape = TreeShape(3, 3, 8)
    drafters = [make_head("eagle", target).drafter("eagle"), make_head("eagle1", target).drafter("eagle1"),
                DraftLM(tiny(family, seed=1))]
    for prompt in ([5, 9, 3, 17], [40, 2, 11, 7, 30, 6]):
        prompt = torch.tensor(prompt)
        ref = autoregressive_generate(target, prompt, sampling=GREEDY, max_new_tokens=16).tokens
        for drafter in drafters:
            out = speculative_generate(target, drafter, prompt, k=0, tree=shape, sampling=GREEDY, max_new_tokens=16)
            assert out.tokens == ref, (family, drafter.name, prompt.tolist())


def test_trees_respect_sliding_windows_shorter_than_the_text():
    """Gemma-3 with sliding-window layers of 5 positions beside full ones, and Mistral windowed throughout: the
    tree's mask limits each node to the window ending at its own position (prompt and answer longer than it)."""
    import transformers as T

    from helpers import _common

    targets = [T.Gemma3ForCausalLM(T.Gemma3TextConfig(**{**_common(48), "eos_token_id": None}, head_dim=8,
                                                       sliding_window=5, layer_types=["sliding_attention",
                                                                                      "full_attention",
                                                                                      "sliding_attention"])),
               T.MistralForCausalLM(T.MistralConfig(**_common(48), sliding_window=5))]
    for target in targets:
        torch.manual_seed(0)
        target = target.eval().requires_grad_(False)
        with torch.no_grad():
            target.get_output_embeddings().weight.mul_(4.0)
        draft = type(target)(target.config).eval()
        for prompt in ([5, 9, 3, 17, 8, 21, 4, 33, 12], [40, 2, 11]):
            prompt = torch.tensor(prompt)
            ref = autoregressive_generate(target, prompt, sampling=GREEDY, max_new_tokens=20).tokens
            for drafter in (make_head("eagle", target).drafter("eagle"), DraftLM(draft), DraftLM(target)):
                out = speculative_generate(target, drafter, prompt, k=0, tree=TreeShape(3, 2, 6), sampling=GREEDY,
                                           max_new_tokens=20)
                assert out.tokens == ref, (target.config.model_type, drafter.name, prompt.tolist())


SMALL_V = 4  # 64 cells for three tokens: well above 5 expected counts each at 1,500 samples


@pytest.mark.parametrize("family", NAMES)
def test_sampled_output_follows_the_targets_distribution_on_every_family(family):
    """An EAGLE-3 head, the parallel heads (DFlash, P-EAGLE), a draft LM and a PARD draft on a 4-token vocabulary: the
    joint of the first three tokens sampled speculatively against the target's exact joint (chi-squared)."""
    target = tiny(family, vocab=SMALL_V, seed=10, sharpen=4.0)
    prompt = torch.tensor([1, 3, 2])
    sampling = Sampling(temperature=1.0)
    exact = exact_joint(target, prompt, sampling, SMALL_V)
    for drafter in (make_head("eagle", target).drafter("eagle"), make_head("dflash", target).drafter("dflash"),
                    make_head("peagle", target).drafter("peagle"), DraftLM(tiny(family, vocab=SMALL_V, seed=11)),
                    PardLM(pard(tiny(family, vocab=SMALL_V, seed=11)))):
        torch.manual_seed(3)
        counts = empirical_joint(target, drafter, prompt, sampling, SMALL_V, 2, 1500)
        assert chi2_pvalue(counts, exact) > 1e-3, (family, drafter.name)
