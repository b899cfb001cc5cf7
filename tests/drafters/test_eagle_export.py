"""EAGLE-3 heads trained elsewhere, read back by draftsmith (drafters/eagle_export.py `load_engine_eagle3`): each
peer's own class (SpecForge's LlamaForCausalLMEagle3, speculators' Eagle3DraftModel), with random weights, saved as its
exporter saves it, gives the logits draftsmith's replay of the export gives, at every training-time-test step.

The draft's RoPE base is not the tiny target's (100,000 against 10,000), so a loader that built the head's attention
from the target's RoPE instead of the export's fails here; `norm_output` is covered in both values and both meanings
(SpecForge's: norm before lm_head, the un-normed state handed on; speculators': the normed state handed on)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from drafters.eagle import draft_vocabulary
from drafters.eagle_export import export_norms
from drafters.heads import export_rope, features_of
from drafters.registry import load_head
from helpers import tiny_llama

VENV = Path(__file__).resolve().parents[2] / ".venv"
VOCAB, HIDDEN, DRAFT_VOCAB, STEPS = 64, 32, 48, 3
LAYERS = [1, 2, 3]  # draftsmith's feature layers (indices into output_hidden_states), vLLM's top-level convention
DRAFT_ROPE = {"rope_type": "default", "rope_theta": 100_000.0}  # the tiny target's base is LlamaConfig's 10,000


def _beside_the_venv(name: str) -> None:
    """A peer `make install` puts in .venv/<name> (as tests/train/test_export.py imports it), appended to sys.path so
    the project's own packages win."""
    if not (VENV / name / ".installed").exists():
        pytest.skip(f"{name} is not installed in {VENV / name}: run `make install`")
    if str(VENV / name) not in sys.path:
        sys.path.append(str(VENV / name))


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, hidden=HIDDEN, layers=4, seed=0, logit_scale=4.0).requires_grad_(False)


@pytest.fixture(scope="module")
def inputs(target):
    """Target features at LAYERS (1, T, 3d) and the tokens (1, T) both classes read."""
    ids = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return features_of(out.hidden_states, LAYERS).flatten(2), ids


def _vocabulary():
    counts = torch.rand(VOCAB, generator=torch.Generator().manual_seed(2))
    return draft_vocabulary(counts, DRAFT_VOCAB)


def _randomize(model: torch.nn.Module, skip: tuple[str, ...] = ()) -> None:
    """Every weight random, norms around 1 (a norm of ones would hide which state a norm is applied to)."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in skip:
                continue
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.3 * noise if "norm" in name else 0.15 * noise)


def _replay(path: Path, target, inputs) -> list[torch.Tensor]:
    """draftsmith's logits of each step: the export loaded by load_head, unrolled as it trains (teacher-forced)."""
    features, ids = inputs
    head = load_head(path, target)
    head.config.ttt_steps = STEPS  # an export is loaded for drafting (one step); replay as many as the peer ran
    with torch.no_grad():
        return head.unroll(features, ids, torch.ones_like(ids))


# --- SpecForge -----------------------------------------------------------------------------------------------------


def _specforge_export(tmp_path: Path, target, norm_output: bool | None):
    """SpecForge 0.2.0's draft class with random weights, written as its SGLang exporter writes it
    (specforge/export/to_sglang.py: save_pretrained without the embedding, then apply_legacy_rope_scaling), plus the
    top-level eagle_aux_hidden_state_layer_ids scripts/peers/specforge.py adds (vLLM's convention, which draftsmith's
    loader requires)."""
    _beside_the_venv("specforge")
    from specforge.export.checkpoint_io import apply_legacy_rope_scaling
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    c = target.config
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                         head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, max_position_embeddings=512,
                         rope_parameters=dict(DRAFT_ROPE), tie_word_embeddings=False, draft_vocab_size=DRAFT_VOCAB,
                         target_hidden_size=HIDDEN, architectures=["LlamaForCausalLMEagle3"],
                         eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in LAYERS]},
                         **({} if norm_output is None else {"norm_output": norm_output}))
    model = LlamaForCausalLMEagle3(config, attention_backend="sdpa").eval()
    _randomize(model, skip=("embed_tokens.weight",))
    d2t, t2d = _vocabulary()
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    out = tmp_path / "specforge"
    model.save_pretrained(str(out), state_dict={k: v for k, v in model.state_dict().items() if "embed" not in k})
    apply_legacy_rope_scaling(str(out))
    raw = json.loads((out / "config.json").read_text())
    assert ("norm_output" in raw) == (norm_output is not None)  # absent: SpecForge's default, true
    raw["eagle_aux_hidden_state_layer_ids"] = LAYERS
    (out / "config.json").write_text(json.dumps(raw))
    return model, out


def _specforge_logits(model, target, inputs) -> list[torch.Tensor]:
    """SpecForge's own training-time test (specforge/algorithms/eagle3/model.py, its sdpa TTT loop): backbone on the
    previous step's output (un-normed), compute_logits, and the tokens shifted one left per step, zero-padded."""
    from specforge.utils import padding

    features, ids = inputs
    B, E = ids.shape[0], ids.shape[1] - 1
    hidden = model.project_hidden_states(features[:, :-1])
    tokens = ids[:, 1:]  # SpecForge pairs the features at t with token t + 1, as draftsmith does
    mask = model.prepare_decoder_attention_mask(torch.ones(B, E, dtype=torch.bool), hidden, B, E, 0)
    positions, cache, logits = torch.arange(E)[None], [[], []], []
    with torch.no_grad():
        for _ in range(STEPS):
            embeds = target.get_input_embeddings()(tokens)  # SGLang shares the target's embedding
            hidden = model.backbone(embeds, hidden, cache, mask, positions, None, True)
            logits.append(model.compute_logits(hidden))
            tokens = padding(tokens, left=False)
    return logits


@pytest.fixture
def eager():
    """SpecForge's LlamaRMSNorm is torch.compile'd: run it eagerly, the same arithmetic without half a minute of
    compiling on the CPU."""
    with torch.compiler.set_stance("force_eager"):
        yield


@pytest.mark.parametrize("norm_output", [True, False, None], ids=["norm_output", "no_norm_output", "absent"])
def test_specforge_export_replays_as_specforge_computes_it(norm_output, target, inputs, tmp_path, eager):
    model, path = _specforge_export(tmp_path, target, norm_output)
    theirs, ours = _specforge_logits(model, target, inputs), _replay(path, target, inputs)
    assert len(ours) == STEPS
    for step, (a, b) in enumerate(zip(theirs, ours)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {step}: {m}")
    # The check has teeth: SpecForge's norm_output=false drafts on the un-normed state, its true (or absent) on the
    # normed one, and the two give other logits.
    model.norm_output = not model.norm_output
    assert not torch.allclose(_specforge_logits(model, target, inputs)[0], ours[0], rtol=1e-3, atol=1e-3)


# --- speculators ---------------------------------------------------------------------------------------------------


def _speculators_export(tmp_path: Path, target, norm_output: bool):
    """speculators' Eagle3DraftModel with random weights (the target's embedding, which it stores), written by its own
    save_pretrained, with the architecture scripts/peers/speculators.py restores (transformers writes the class's)."""
    _beside_the_venv("speculators")
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1, "intermediate_size": 48,
                           "rope_parameters": dict(DRAFT_ROPE)})
    layer._attn_implementation = "eager"  # its default, flex attention, wants a GPU
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=DRAFT_VOCAB, norm_before_residual=False,
        norm_output=norm_output, eagle_aux_hidden_state_layer_ids=LAYERS, target_hidden_size=HIDDEN,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    model = Eagle3DraftModel(config).eval()
    _randomize(model, skip=("embed_tokens.weight",))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    d2t, t2d = _vocabulary()
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    out = tmp_path / "speculators"
    model.save_pretrained(str(out))
    raw = json.loads((out / "config.json").read_text())
    raw["architectures"] = ["Eagle3Speculator"]
    assert raw["norm_output"] is norm_output
    (out / "config.json").write_text(json.dumps(raw))
    return model, out


def _speculators_logits(model, inputs) -> list[torch.Tensor]:
    """speculators' own forward over STEPS teacher-forced steps, its lm_head's output at each."""
    features, ids = inputs
    logits = []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: logits.append(output))
    with torch.no_grad():  # speculators pairs hidden state t with token t + 1, as draftsmith does: the caller shifts
        model(hidden_states=features[:, :-1], input_ids=ids[:, 1:], document_ids=torch.zeros_like(ids[:, 1:]),
              ttt_steps=STEPS)
    hook.remove()
    return logits


@pytest.mark.parametrize("norm_output", [True, False], ids=["norm_output", "no_norm_output"])
def test_speculators_export_replays_as_speculators_computes_it(norm_output, target, inputs, tmp_path):
    model, path = _speculators_export(tmp_path, target, norm_output)
    theirs, ours = _speculators_logits(model, inputs), _replay(path, target, inputs)
    assert len(theirs) == len(ours) == STEPS
    E = ours[0].shape[1]
    for step, (a, b) in enumerate(zip(theirs, ours)):
        # Step s: speculators shifts its tokens s places; the last s entries read padding, which it masks otherwise.
        torch.testing.assert_close(b[:, : E - step], a[:, : E - step], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"step {step}: {m}")
    # The check has teeth: speculators' other norm_output hands another state on, so step 1 differs.
    model.config.norm_output = not norm_output
    assert not torch.allclose(_speculators_logits(model, inputs)[1][:, : E - 1], ours[1][:, : E - 1], rtol=1e-3,
                              atol=1e-3)


# --- what the loader reads -----------------------------------------------------------------------------------------


def test_an_export_without_rope_takes_the_targets_and_says_so(target, inputs, tmp_path, caplog):
    _, path = _specforge_export(tmp_path, target, None)
    raw = json.loads((path / "config.json").read_text())
    for key in ("rope_parameters", "rope_theta", "rope_scaling"):
        raw.pop(key, None)
    (path / "config.json").write_text(json.dumps(raw))
    with caplog.at_level(logging.INFO, logger="drafters.eagle_export"):
        head = load_head(path, target)
    assert "carries no RoPE" in caplog.text and str(path) in caplog.text
    assert head.config.rope_parameters["rope_theta"] == target.config.rope_parameters["rope_theta"] == 10000.0


def test_export_rope_reads_each_way_an_export_names_it():
    assert export_rope({"rope_theta": 5e5, "rope_scaling": None}) == {"rope_type": "default", "rope_theta": 5e5}
    assert export_rope({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}) == {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}  # transformers 4's older "type"
    gemma = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    assert export_rope({"rope_parameters": gemma}) == {"rope_type": "default", "rope_theta": 1e6}
    # speculators nests the layer's config; its RoPE wins over anything at the top level
    nested = {"rope_theta": 1e4, "transformer_layer_config": {"rope_parameters": {"rope_type": "default",
                                                                                 "rope_theta": 1e5}}}
    assert export_rope(nested)["rope_theta"] == 1e5
    assert export_rope({"hidden_size": 32}) is None


def test_norm_output_is_read_in_the_meaning_of_the_class_that_wrote_it():
    specforge = {"architectures": ["LlamaForCausalLMEagle3"]}
    assert export_norms(specforge)["head_norm"] and not export_norms(specforge)["norm_output"]
    assert export_norms({**specforge, "norm_output": True}) == {"norm_before_fc": False, "norm_before_residual": False,
                                                                "norm_output": False, "head_norm": True}
    assert not export_norms({**specforge, "norm_output": False})["head_norm"]
    # draftsmith's own sglang export names every switch, norm_output in the engines' (speculators') meaning
    ours = {**specforge, "norm_before_fc": True, "norm_before_residual": True, "norm_output": True}
    assert export_norms(ours) == {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}
    assert export_norms({"architectures": ["Eagle3Speculator"], "norm_output": True})["norm_output"]
