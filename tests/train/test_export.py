"""`python -m train.export`: the engine formats' contents, the collapse guard, and the round trip back
into `python -m eval`. (llama.cpp loading and serving the exports: tests/eval/engines/test_llama_cpp.py.)"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import eval.__main__ as eval_entry
from drafters.pard import PardLM
from drafters.registry import load_head
from drafters.sampling import Sampling
from helpers import train_tiny_deep
from eval import config as eval_config
from eval.engines.formats.checks import EAGLE3_OWN, ExportRefused
from eval.engines.formats.writing import target_directory
from eval.run import build_drafter, load_target
from eval.speculative import speculative_generate
from train import config as train_config
from train.export import ExportSettings, export, formats_for
from train.hidden_states import capture

CONF = str(Path(__file__).resolve().parents[2] / "conf")
eval_config.register()  # compose_cfg composes conf/eval.yaml and conf/export.yaml
train_config.register()
TARGET = "toyworld://tiny_deep/target"  # 4 layers: an EAGLE-3 head on layers 1..3, which engines capture


def compose_cfg(name, *overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def test_the_eagle3_exports_carry_what_each_engine_reads(eagle_run, tmp_path):
    written = export(eagle_run, tmp_path / "out", ExportSettings(formats=["sglang", "speculators"]))
    target, _ = load_target(TARGET, device=torch.device("cpu"))
    head_config = json.loads((eagle_run / "best" / "config.json").read_text())
    layers = head_config["feature_layers"]
    assert layers == [1, 2, 3]

    sglang = json.loads((written["sglang"] / "config.json").read_text())
    assert sglang["architectures"] == ["LlamaForCausalLMEagle3"] and sglang["num_hidden_layers"] == 1
    assert sglang["vocab_size"] == 320 and sglang["draft_vocab_size"] == 120 and not sglang["tie_word_embeddings"]
    assert sglang["eagle_aux_hidden_state_layer_ids"] == layers  # vLLM's and llama.cpp's convention
    assert sglang["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}
    assert sglang["norm_before_residual"] is False and sglang["rope_theta"] == 10000.0
    assert sglang["max_position_embeddings"] == target.config.max_position_embeddings
    tensors = load_file(str(written["sglang"] / "model.safetensors"))
    assert set(tensors) == {*EAGLE3_OWN, "lm_head.weight"}  # no embedding: the target's is reused
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    target_ids = torch.arange(120) + tensors["d2t"]  # offsets
    assert torch.equal(tensors["t2d"].nonzero().flatten(), target_ids)
    assert torch.equal(tensors["lm_head.weight"], target.lm_head.weight.detach()[target_ids])
    assert tensors["fc.weight"].shape == (64, 3 * 64) and tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 128

    spec = json.loads((written["speculators"] / "config.json").read_text())
    assert spec["architectures"] == ["Eagle3Speculator"] and spec["speculators_model_type"] == "eagle3"
    assert spec["eagle_aux_hidden_state_layer_ids"] == layers and spec["norm_before_residual"] is False
    assert spec["transformer_layer_config"]["num_hidden_layers"] == 1
    assert Path(spec["speculators_config"]["verifier"]["name_or_path"], "config.json").exists()
    renamed = load_file(str(written["speculators"] / "model.safetensors"))
    assert {n.replace("midlayer.", "layers.0.") for n in tensors} | {"embed_tokens.weight"} == set(renamed)
    assert torch.equal(renamed["embed_tokens.weight"], target.model.embed_tokens.weight.detach())


def test_an_own_output_head_is_exported_as_trained(eagle_own_run, tmp_path):
    """`drafter.own_lm_head=true`: the exports carry the head's trained output head, not the target's rows, and
    draftsmith reads it back from them as the head's own."""
    from drafters.registry import load_head

    written = export(eagle_own_run, tmp_path / "out", ExportSettings(formats=["sglang", "speculators"]))
    target, _ = load_target(TARGET, device=torch.device("cpu"))
    saved = load_file(str(eagle_own_run / "best" / "model.safetensors"))
    assert json.loads((eagle_own_run / "best" / "config.json").read_text())["own_lm_head"] is True
    tensors = load_file(str(written["sglang"] / "model.safetensors"))
    target_ids = torch.arange(120) + tensors["d2t"]
    assert set(tensors) == {*EAGLE3_OWN, "lm_head.weight"}
    assert torch.equal(tensors["lm_head.weight"], saved["lm_head.weight"])
    assert not torch.allclose(tensors["lm_head.weight"], target.lm_head.weight.detach()[target_ids], atol=1e-3)
    for fmt in ("sglang", "speculators"):
        head = load_head(written[fmt], target)
        assert head.config.own_lm_head and torch.equal(head.lm_head.weight, saved["lm_head.weight"])
    assert load_head(eagle_own_run / "best", target).lm_head is not None


def test_an_own_output_head_that_is_missing_is_refused(eagle_own_run, tmp_path):
    run = _planted(eagle_own_run, tmp_path, "own_missing")
    _edit_weights(run, lambda s: s.pop("lm_head.weight"))
    with pytest.raises(ExportRefused, match="own_lm_head but lm_head.weight is missing"):
        export(run, tmp_path / "out", ExportSettings(formats=["sglang"], force=True))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_every_export_loads_back_into_eval_with_the_runs_greedy_tau(eagle_run, eagle_own_run, eagle1_run, draft_run,
                                                                    tmp_path):
    heads = export(eagle_run, tmp_path / "eagle", ExportSettings(formats=["sglang", "speculators"]))
    own = export(eagle_own_run, tmp_path / "eagle_own", ExportSettings(formats=["sglang", "speculators"]))
    draft = export(draft_run, tmp_path / "draft", ExportSettings(formats=["hf"]))
    eagle1 = export(eagle1_run, tmp_path / "eagle1", ExportSettings(formats=["vllm"]))
    drafters = [f"{{name: run_head, kind: head, path: {eagle_run / 'best'}}}",
                f"{{name: run_eagle1, kind: head, path: {eagle1_run / 'best'}}}",
                f"{{name: vllm_eagle1, kind: head, path: {eagle1['vllm']}}}",
                f"{{name: sglang, kind: head, path: {heads['sglang']}}}",
                f"{{name: speculators, kind: head, path: {heads['speculators']}}}",
                f"{{name: run_own, kind: head, path: {eagle_own_run / 'best'}}}",
                f"{{name: sglang_own, kind: head, path: {own['sglang']}}}",
                f"{{name: speculators_own, kind: head, path: {own['speculators']}}}",
                f"{{name: run_draft, kind: draft_lm, path: {draft_run / 'best'}}}",
                f"{{name: hf, kind: draft_lm, path: {draft['hf']}}}"]
    report = eval_entry.run(compose_cfg("eval", "target=tiny_deep", f"drafters=[{','.join(drafters)}]", "ks=[3]",
                                        "repeats=1", "warmup=0", "max_new_tokens=16",
                                        "data.max_prompts_per_category=2", "progress=false",
                                        f"out_dir={tmp_path / 'report'}"))
    tau = {(r["category"], r["drafter"]): r["acceptance_length"] for r in report["results"]}
    for category in {c for c, _ in tau}:
        assert tau[category, "sglang"] == tau[category, "speculators"] == tau[category, "run_head"]
        assert tau[category, "sglang_own"] == tau[category, "speculators_own"] == tau[category, "run_own"]
        assert tau[category, "hf"] == tau[category, "run_draft"]
        assert tau[category, "vllm_eagle1"] == tau[category, "run_eagle1"]
    assert all(r["lossless"] for r in report["results"])


def _planted(eagle_run: Path, tmp_path: Path, name: str) -> Path:
    """A copy of the run to plant a fault in."""
    copy = tmp_path / name
    shutil.copytree(eagle_run, copy, ignore=shutil.ignore_patterns("checkpoints"))
    return copy


def _edit_weights(run: Path, edit) -> None:
    path = run / "best" / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path))


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _without_eos(state):
    """Consistent maps of the same size that leave the target's EOS (id 2) out."""
    kept = (torch.arange(state["d2t"].numel()) + state["d2t"]).tolist()
    spare = next(i for i in range(state["t2d"].numel()) if i not in kept)
    ids = sorted([i for i in kept if i != 2] + [spare])
    state["d2t"] = torch.tensor(ids) - torch.arange(len(ids))
    state["t2d"] = torch.zeros_like(state["t2d"])
    state["t2d"][ids] = True


FAULTS = {
    "maps_disagree": (lambda run: _edit_weights(run, lambda s: s["t2d"].__setitem__(
        int((~s["t2d"]).nonzero()[0]), True)), "t2d marks 121 target tokens but d2t maps 120"),
    "no_eos": (lambda run: _edit_weights(run, _without_eos), "lacks the target's EOS token 2"),
    "layer_outside": (lambda run: _edit_json(run / "best" / "config.json",
                                             lambda c: c.__setitem__("feature_layers", [0, 2, 3])),
                      r"outside 1\.\.3"),
    "no_fc": (lambda run: _edit_weights(run, lambda s: s.pop("fc.weight")), r"\['fc.weight'\] are missing"),
    # A head saved when heads took the target's activation (Gemma's): the engines' layers compute SiLU.
    "gelu": (lambda run: _edit_json(run / "best" / "config.json",
                                    lambda c: c.__setitem__("hidden_act", "gelu_pytorch_tanh")),
             "activation is 'gelu_pytorch_tanh'"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_the_collapse_guard_refuses_and_writes_nothing(eagle_run, tmp_path, fault):
    plant, message = FAULTS[fault]
    run = _planted(eagle_run, tmp_path, fault)
    plant(run)
    with pytest.raises(ExportRefused, match=message):
        export(run, tmp_path / "out", ExportSettings(formats=["sglang"], force=True))  # force does not override
    assert not (tmp_path / "out").exists()


def test_a_head_at_chance_is_refused_unless_forced(eagle_run, tmp_path, caplog):
    run = _planted(eagle_run, tmp_path, "chance")
    _edit_json(run / "best" / "best.json", lambda b: b.__setitem__("top1", 0.01))  # 1.2 x 1/120
    with pytest.raises(ExportRefused, match="at chance.*force=true"):
        export(run, tmp_path / "out", ExportSettings(formats=["sglang"]))
    assert not (tmp_path / "out").exists()
    written = export(run, tmp_path / "out", ExportSettings(formats=["sglang"], force=True))
    assert (written["sglang"] / "model.safetensors").exists() and "exporting because force=true" in caplog.text


def test_kinds_and_formats_are_checked():
    assert formats_for("eagle", ["auto"]) == ["sglang", "speculators", "gguf"]
    assert formats_for("draft_lm", ["auto"]) == ["hf", "gguf"]
    assert formats_for("eagle1", ["auto"]) == ["vllm"]
    with pytest.raises(ValueError, match="medusa heads cannot be exported: no engine loads them .vLLM dropped"):
        formats_for("medusa", ["auto"])
    with pytest.raises(ValueError, match="mtp heads cannot be exported: .*chains k times.*eagle1 -> vllm"):
        formats_for("mtp", ["vllm"])
    with pytest.raises(ValueError, match=r"cannot be written as \['sglang'\]"):
        formats_for("draft_lm", ["sglang"])
    with pytest.raises(ValueError, match="unknown export formats"):
        formats_for("eagle", ["onnx"])


def test_the_entry_point_composes_and_names_what_it_wrote(eagle_run, tmp_path, capsys):
    from train.export import run

    run(compose_cfg("export", f"run={eagle_run}", f"out_dir={tmp_path}", "formats=[sglang]"))
    assert f"sglang: {tmp_path / 'sglang'}" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="not a training run"):
        run(compose_cfg("export", f"run={tmp_path}", f"out_dir={tmp_path / 'x'}"))


VENV = Path(__file__).resolve().parents[2] / ".venv"


def _beside_the_venv(name: str):
    """A package `make install` puts in .venv/<name> without its CUDA dependencies (pip would pull CUDA
    torch), appended to sys.path so the project's own packages win."""
    import importlib
    import sys

    if not (VENV / name / ".installed").exists():
        pytest.skip(f"{name} is not installed in {VENV / name}: run `make install`")
    if str(VENV / name) not in sys.path:
        sys.path.append(str(VENV / name))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def speculators():
    return _beside_the_venv("speculators")


@pytest.fixture(scope="module")
def specforge():
    return _beside_the_venv("specforge")


def _head_inputs(eagle_run):
    """The target's features and draftsmith's step-0 draft logits for one held-out-style prompt."""
    from drafters.heads import features_of
    from drafters.registry import load_head

    target, tok = load_target(TARGET, device=torch.device("cpu"))
    head = load_head(eagle_run / "best", target)
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "Return this as JSON: order 7 is paid"}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        features = features_of(out.hidden_states, head.config.feature_layers).flatten(2)  # (1, T, 3d)
        ours = head.unroll(features, ids, torch.ones_like(ids))[0]  # (1, T-1, draft vocab): step 0
    return target, head, ids, features, ours


def _second_step(head, features, ids) -> torch.Tensor:
    """draftsmith's draft logits of step 1, its training-time unroll on its own step-0 outputs."""
    with torch.no_grad():
        return head.unroll(features, ids, torch.ones_like(ids))[1]


@pytest.mark.parametrize("run", ["eagle_run", "eagle_own_run"])
def test_specforge_loads_the_sglang_export_and_computes_the_heads_logits(run, request, tmp_path, specforge):
    """SpecForge's LlamaForCausalLMEagle3 (the class SGLang's format comes from) on the `sglang` export:
    lm_head(forward(...)) (its forward ends with the final norm) gives draftsmith's draft logits.

    The model is built from the export's config.json and the weights loaded by name, every name matched:
    SpecForge 0.2.0 pins transformers 5.8.1, and its `from_pretrained` under 5.24 leaves the rotary
    tables (buffers outside the checkpoint) uninitialised, NaN in places, whatever the checkpoint."""
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    eagle_run = request.getfixturevalue(run)
    written = export(eagle_run, tmp_path / "out", ExportSettings(formats=["sglang"]))
    target, head, ids, features, ours = _head_inputs(eagle_run)
    model = LlamaForCausalLMEagle3(LlamaConfig.from_pretrained(written["sglang"]), attention_backend="sdpa").eval()
    missing, unexpected = model.load_state_dict(load_file(str(written["sglang"] / "model.safetensors")), strict=False)
    assert missing == ["embed_tokens.weight"] and unexpected == []  # no embedding: SGLang reuses the target's
    assert torch.equal(model.lm_head.weight, head._draft_rows())  # the target's rows, or the head's own
    assert torch.equal(model.d2t, head.d2t)
    with torch.no_grad():  # the embedding is the target's, passed in as SGLang passes it
        theirs = model.lm_head(model(hidden_states=features[:, :-1],
                                     inputs_embeds=target.get_input_embeddings()(ids[:, 1:])))
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("run", ["eagle_run", "eagle_own_run", "eagle31_run"])
def test_speculators_loads_the_export_and_computes_the_heads_logits(run, request, tmp_path, speculators):
    """speculators' own from_pretrained on the export: its EAGLE-3 forward gives draftsmith's head's draft
    logits on the same target features and tokens (within 1e-5: the same fp32 arithmetic in another order), at
    the first two draft steps (the second reads the state the first hands on: EAGLE-3.1's norm_output)."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    eagle_run = request.getfixturevalue(run)
    written = export(eagle_run, tmp_path / "out", ExportSettings(formats=["speculators"]))
    target, head, ids, features, ours = _head_inputs(eagle_run)

    def speculators_logits(directory):
        config = SpeculatorModelConfig.from_pretrained(directory)
        config.transformer_layer_config._attn_implementation = "eager"  # its default, flex attention, wants a GPU
        model = SpeculatorModel.from_pretrained(directory, config=config).eval()
        assert type(model).__name__ == "Eagle3DraftModel"
        # What its loader fills silently (or leaves uninitialised) when a checkpoint lacks it.
        assert torch.equal(model.embed_tokens.weight, target.model.embed_tokens.weight)
        assert torch.equal(model.lm_head.weight, head._draft_rows())  # the target's rows, or the head's own
        logits = []
        hook = model.lm_head.register_forward_hook(lambda module, args, output: logits.append(output))
        with torch.no_grad():  # speculators pairs hidden state t with token t+1, as draftsmith does: the caller shifts
            model(hidden_states=features[:, :-1], input_ids=ids[:, 1:], document_ids=torch.zeros_like(ids[:, 1:]),
                  ttt_steps=2)
        hook.remove()
        return logits[0].float(), logits[1].float()

    theirs, second = speculators_logits(written["speculators"])
    assert theirs.shape == ours.shape
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    # Step 1: speculators shifts its inputs one token on each step; draftsmith's entry e of step 1 is its e + 1.
    ours_second = _second_step(head, features, ids)
    torch.testing.assert_close(second[:, : ours_second.shape[1] - 1], ours_second[:, :-1], rtol=1e-4, atol=1e-4)
    # The check has teeth: the same weights read with the other residual convention give other logits.
    _edit_json(written["speculators"] / "config.json", lambda c: c.__setitem__(
        "norm_before_residual", not head.config.norm_before_residual))
    assert not torch.allclose(speculators_logits(written["speculators"])[0], ours, rtol=1e-3, atol=1e-3)


def test_training_exports_at_the_end_when_asked(tiny_world, tmp_path):
    run = train_tiny_deep(tmp_path / "run", "drafter=eagle", "trainer.max_steps=2", "drafter.draft_vocab_size=120",
                          "export.formats=[sglang]", "export.force=true")  # 2 steps: at chance, forced
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["export"] == {"sglang": str(run / "export" / "sglang")}
    assert (run / "export" / "sglang" / "model.safetensors").exists()


# --- EAGLE-1: vLLM's layout ----------------------------------------------------------------------------


def test_the_eagle1_export_carries_what_vllm_reads(eagle1_run, tmp_path):
    written = export(eagle1_run, tmp_path / "out", ExportSettings(formats=["vllm"]))
    target, _ = load_target(TARGET, device=torch.device("cpu"))
    config = json.loads((written["vllm"] / "config.json").read_text())
    assert config["architectures"] == ["EagleLlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["vocab_size"] == 320 and config["hidden_size"] == 64 and config["rope_theta"] == 10000.0
    tensors = load_file(str(written["vllm"] / "model.safetensors"))
    own = load_file(str(eagle1_run / "best" / "model.safetensors"))
    assert {n.replace("layer.", "layers.0.", 1) for n in own} == set(tensors)  # no embedding, no output head
    assert not any("input_layernorm" in n for n in tensors) and tensors["fc.weight"].shape == (64, 128)
    assert all(torch.equal(tensors[n.replace("layer.", "layers.0.", 1)], t) for n, t in own.items())


def _eagle1_inputs(eagle1_run, tmp_path):
    """The target's last (normed) states on a prompt, and draftsmith's head's outputs and logits on them."""
    from drafters.registry import load_head
    from drafters.layers import causal_mask

    target, tok = load_target(TARGET, device=torch.device("cpu"))
    head = load_head(eagle1_run / "best", target)
    ids = torch.tensor(tok.apply_chat_template([{"role": "user", "content": "Return this as JSON: order 7 is paid"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False))
    with torch.no_grad():
        features = target(ids[None], output_hidden_states=True).hidden_states[-1][0]
        mask = causal_mask(len(ids) - 1, 0, ids.device)
        hidden = head._entries(features[None, :-1], ids[None, 1:], 0, mask)
        logits = head.shared.logits(hidden)[0]
    inputs = tmp_path / "inputs.safetensors"
    save_file({"ids": ids, "features": features.contiguous()}, str(inputs))
    return inputs, hidden[0], logits


def _vllm(export_dir: Path, inputs: Path, out: Path, worker: str = "vllm_worker.py") -> tuple[str, dict]:
    """tests/train/vllm_worker.py (or `worker`) on the export: the architecture vLLM resolved and its outputs."""
    import os
    import subprocess
    import sys

    # An empty vLLM cache: vLLM inspects the architectures in a child process, as on a machine that never
    # ran it (a cache left by an earlier run would skip that child and hide a failure in it).
    env = {**os.environ, "VLLM_CACHE_ROOT": str(out.parent / "vllm-cache")}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name(worker)), str(VENV / "vllm"),
                           str(target_directory(TARGET)), str(export_dir), str(inputs), str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split("architecture: ")[-1].strip(), load_file(str(out))


def test_vllm_loads_the_eagle1_export_and_computes_the_heads_logits(eagle1_run, tmp_path):
    """vLLM 0.33's config, registry, loader and EAGLE-1 model on the export (tests/train/vllm_worker.py says
    what of it runs here): its outputs and logits are draftsmith's head's on the same features and tokens,
    within 1e-5 (fp32, the same operations; vLLM fuses q/k/v and gate/up into one matrix each)."""
    if not (VENV / "vllm" / ".installed").exists():
        pytest.skip(f"vllm is not installed in {VENV / 'vllm'}: run `make install`")
    written = export(eagle1_run, tmp_path / "out", ExportSettings(formats=["vllm"]))
    inputs, hidden, logits = _eagle1_inputs(eagle1_run, tmp_path)
    architecture, theirs = _vllm(written["vllm"], inputs, tmp_path / "vllm.safetensors")
    assert architecture == "EagleLlamaForCausalLM"
    torch.testing.assert_close(theirs["hidden"], hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(theirs["logits"], logits, rtol=1e-5, atol=1e-5)
    # The check has teeth: the same weights under another RoPE base give other logits.
    _edit_json(written["vllm"] / "config.json", lambda c: c.__setitem__("rope_theta", 500.0))
    _, other = _vllm(written["vllm"], inputs, tmp_path / "other.safetensors")
    assert not torch.allclose(other["logits"], logits, rtol=1e-3, atol=1e-3)


def _old_eagle1(run: Path) -> None:
    """The head as draftsmith saved it before the layer lost its input norm."""
    _edit_json(run / "best" / "config.json", lambda c: c.pop("input_norm"))
    _edit_weights(run, lambda s: s.__setitem__("layer.input_layernorm.weight", torch.ones(64)))


EAGLE1_FAULTS = {
    "input_norm": (_old_eagle1, "norm before its layer's attention"),
    "layer": (lambda run: _edit_json(run / "best" / "config.json", lambda c: c.__setitem__("feature_layers", [3])),
              r"reads layers \[3\].*\[4\]"),
    "no_fc": (lambda run: _edit_weights(run, lambda s: s.pop("fc.weight")), r"\['fc.weight'\] are missing"),
    "gelu": (lambda run: _edit_json(run / "best" / "config.json", lambda c: c.__setitem__("hidden_act", "gelu")),
             "activation is 'gelu'"),
}


@pytest.mark.parametrize("fault", sorted(EAGLE1_FAULTS))
def test_the_collapse_guard_refuses_an_eagle1_head_vllm_would_misread(eagle1_run, tmp_path, fault):
    plant, message = EAGLE1_FAULTS[fault]
    run = _planted(eagle1_run, tmp_path, fault)
    plant(run)
    with pytest.raises(ExportRefused, match=message):
        export(run, tmp_path / "out", ExportSettings(formats=["vllm"], force=True))
    assert not (tmp_path / "out").exists()


def test_an_eagle1_head_at_chance_is_refused_unless_forced(eagle1_run, tmp_path):
    run = _planted(eagle1_run, tmp_path, "chance")
    _edit_json(run / "best" / "best.json", lambda b: b.__setitem__("top1", 0.005))  # 1.6 x 1/320
    with pytest.raises(ExportRefused, match="at chance.*force=true"):
        export(run, tmp_path / "out", ExportSettings(formats=["vllm"]))
    assert (export(run, tmp_path / "out", ExportSettings(formats=["vllm"], force=True))["vllm"] / "config.json").exists()


def test_a_norm_output_head_is_not_sent_to_llama_cpp(eagle31_run, tmp_path):
    """llama.cpp's EAGLE-3 graph hands the un-normed state to its next draft step: an EAGLE-3.1 head with
    norm_output would draft other tokens there, so neither the gguf export nor `python -m eval` sends it."""
    from eval.engines.llama_cpp_drafters import llama_cpp_drafter

    with pytest.raises(ExportRefused, match="norm_output"):
        export(eagle31_run, tmp_path / "out", ExportSettings(formats=["speculators", "gguf"]))
    assert not (tmp_path / "out").exists()
    target, _ = load_target(TARGET, device=torch.device("cpu"))
    served = llama_cpp_drafter({"name": "h", "kind": "head", "path": str(eagle31_run / "best")}, target, TARGET,
                               tmp_path / "engine")
    assert served.gguf is None and "norm_output" in served.note


def test_a_dflash_drafter_exports_in_the_layout_vllm_and_llama_cpp_read(dflash_run, tmp_path):
    """z-lab's DFlashDraftModel layout: a Qwen3 config of the drafter's layers with block_size and dflash_config,
    target_layer_ids as 0-based layer outputs (draftsmith's feature layers less one), weights without a `model.`
    prefix (vLLM adds it) and without the target's embedding or output head (both engines share the target's)."""
    written = export(dflash_run, tmp_path / "out", ExportSettings(formats=["dflash"]))
    head = json.loads((dflash_run / "best" / "config.json").read_text())
    config = json.loads((written["dflash"] / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": head["mask_token_id"],
                                       "target_layer_ids": [i - 1 for i in head["feature_layers"]]}
    assert config["block_size"] == head["block_size"] and config["num_hidden_layers"] == head["num_layers"]
    assert "rope_theta" in config and config["layer_types"] == ["full_attention"] * head["num_layers"]
    weights = load_file(str(written["dflash"] / "model.safetensors"))
    saved = load_file(str(dflash_run / "best" / "model.safetensors"))
    assert set(weights) == set(saved) and all(torch.equal(weights[k], saved[k]) for k in saved)
    assert not any(k.startswith(("model.", "embed_tokens", "lm_head")) for k in weights)
    assert (written["dflash"] / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="cannot be written as"):
        formats_for("dflash", ["sglang"])


def test_a_dflash_drafter_with_a_draft_vocabulary_exports_its_maps_and_rows(dflash_vocab_run, tmp_path):
    """A draft vocabulary as vLLM's DFlash reads it: `draft_vocab_size` in the config, `d2t` offsets and `t2d` as
    saved, and `lm_head` the target's output-head rows of the draft tokens (the drafter drafts through them); maps
    that disagree are refused before anything is written."""
    written = export(dflash_vocab_run, tmp_path / "out", ExportSettings(formats=["dflash"]))
    config = json.loads((written["dflash"] / "config.json").read_text())
    assert config["draft_vocab_size"] == 120 and config["vocab_size"] == 320
    assert config["architectures"] == ["DFlashDraftModel"]
    weights = load_file(str(written["dflash"] / "model.safetensors"))
    saved = load_file(str(dflash_vocab_run / "best" / "model.safetensors"))
    assert torch.equal(weights["d2t"], saved["d2t"]) and torch.equal(weights["t2d"], saved["t2d"])
    target, _ = load_target(TARGET, device=torch.device("cpu"))
    target_ids = torch.arange(120) + saved["d2t"]
    assert torch.equal(weights["lm_head.weight"], target.lm_head.weight.detach()[target_ids])
    assert set(weights) == set(saved) | {"lm_head.weight"}
    broken = shutil.copytree(dflash_vocab_run, tmp_path / "broken")
    saved["t2d"][int(target_ids[0])] = False  # t2d no longer marks a token d2t maps to
    save_file(saved, str(broken / "best" / "model.safetensors"))
    with pytest.raises(ExportRefused, match="t2d"):
        export(broken, tmp_path / "refused", ExportSettings(formats=["dflash", "gguf"]))
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("run", ["dflash_run", "dflash_vocab_run"])  # the whole vocabulary, or a draft vocabulary
def test_vllm_loads_the_dflash_export_and_computes_the_drafters_block(run, tmp_path, request):
    """vLLM 0.33's config, registry, loader and DFlash model on the export (tests/train/vllm_dflash_worker.py says
    what of it runs here): the block's logits are draftsmith's drafter's on the same context and block, within
    1e-4 (fp32; vLLM fuses the context's k/v projections of every layer into one matrix), so vLLM drafts the same
    tokens. With a draft vocabulary, vLLM's own lm_head of the draft rows and its scatter through `d2t` give
    draftsmith's logits over the target's vocabulary, -inf where the drafter cannot propose."""
    if not (VENV / "vllm" / ".installed").exists():
        pytest.skip(f"vllm is not installed in {VENV / 'vllm'}: run `make install`")
    dflash_run = request.getfixturevalue(run)
    written = export(dflash_run, tmp_path / "out", ExportSettings(formats=["dflash"]))
    target, _ = load_target(TARGET, device=torch.device("cpu"))
    head = load_head(dflash_run / "best", target)
    ids = torch.randint(3, target.config.vocab_size, (1, 14), generator=torch.Generator().manual_seed(0))
    features = capture(target, ids, torch.ones_like(ids), list(head.config.feature_layers))[0, :-1].flatten(1)
    m, n = features.shape[0], head.config.block_size - 1
    block = torch.tensor([int(ids[0, -1])] + [head.config.mask_token_id] * n)
    with torch.no_grad():
        context = head.context_kv(head.context(features[None]), torch.arange(m)[None])
        ours = head.target_logits(head.blocks(context, block[None], torch.arange(m, m + n + 1)[None], None)[0])
    inputs = tmp_path / "inputs.safetensors"
    save_file({"features": features.contiguous(), "block": block}, str(inputs))
    architecture, theirs = _vllm(written["dflash"], inputs, tmp_path / "vllm.safetensors", "vllm_dflash_worker.py")
    assert architecture == "DFlashDraftModel"
    assert torch.equal(theirs["logits"][1:].isinf(), ours[1:].isinf())
    draft_vocab = getattr(head.config, "draft_vocab_size", None) or target.config.vocab_size
    assert int(ours[1:].isfinite().sum(-1)[0]) == draft_vocab
    torch.testing.assert_close(theirs["logits"][1:], ours[1:], rtol=1e-4, atol=1e-4)
    assert theirs["logits"][1:].argmax(-1).tolist() == ours[1:].argmax(-1).tolist()
    # The check has teeth: the same weights under another RoPE base give other logits.
    _edit_json(written["dflash"] / "config.json", lambda c: c.__setitem__("rope_theta", 500.0))
    _, other = _vllm(written["dflash"], inputs, tmp_path / "other.safetensors", "vllm_dflash_worker.py")
    assert not torch.allclose(other["logits"][1:], ours[1:], rtol=1e-3, atol=1e-3)


def _peagle_inputs(head, target, k):
    """The target's features for a prompt and draftsmith's k parallel drafting slots' logits there (the last real
    entry and k - 1 mask entries, one forward), over the full vocabulary (-inf outside the draft vocabulary, as
    vLLM scatters them)."""
    from drafters.kv_cache import KVCache

    ids = torch.randint(3, target.config.vocab_size, (14,), generator=torch.Generator().manual_seed(0))
    features = capture(target, ids[None], torch.ones_like(ids[None]), list(head.config.feature_layers))[0].flatten(1)
    T = len(ids)
    with torch.no_grad():
        hidden = torch.cat([head.fuse(features[:-1]), head.mask_state().expand(k - 1, -1)])[None]
        tokens = torch.cat([ids[1:], torch.full((k - 1,), head.config.mask_token_id)])
        out = head.step(hidden, tokens, 0, KVCache())[0, T - 2:]
        draft = head.draft_logits(out)
    ours = torch.full((k, target.config.vocab_size), float("-inf"))
    ours[:, head.target_ids()] = draft
    return ids, features, ours


def test_a_peagle_head_exports_in_the_speculators_layout_and_loads_back(peagle_run, tmp_path):
    """speculators' PEagleSpeculator: its model type and algorithm `peagle`, the mask token, the depths trained as the
    draft length, `mask_hidden` beside EAGLE-3's weights, the aux-state count vLLM's Llama reads; a draft length past
    the depths is refused; `python -m eval` reads the export back as the head it is and drafts the same tokens."""
    written = export(peagle_run, tmp_path / "out", ExportSettings(formats=["auto"], num_speculative_tokens=4))
    assert set(written) == {"speculators"}
    head_config = json.loads((peagle_run / "best" / "config.json").read_text())
    config = json.loads((written["speculators"] / "config.json").read_text())
    assert config["architectures"] == ["PEagleSpeculator"] and config["speculators_model_type"] == "peagle"
    assert config["speculators_config"]["algorithm"] == "peagle"
    assert config["mask_token_id"] == head_config["mask_token_id"]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == head_config["num_depths"] == 4
    assert config["transformer_layer_config"]["num_aux_hidden_states"] == 3
    assert config["norm_before_fc"] and config["norm_before_residual"] and not config["norm_output"]
    weights = load_file(str(written["speculators"] / "model.safetensors"))
    saved = load_file(str(peagle_run / "best" / "model.safetensors"))
    assert torch.equal(weights["mask_hidden"], saved["mask_hidden"]) and weights["mask_hidden"].shape == (1, 1, 192)
    with pytest.raises(ExportRefused, match="num_speculative_tokens=5 is more than the 4 depths"):
        export(peagle_run, tmp_path / "more", ExportSettings(num_speculative_tokens=5))
    with pytest.raises(ValueError, match="cannot be written as"):
        formats_for("peagle", ["sglang"])
    target, _ = load_target(TARGET, device=torch.device("cpu"))
    ours, theirs = load_head(peagle_run / "best", target), load_head(written["speculators"], target)
    assert type(theirs).__name__ == "PEagle" and theirs.config.mask_token_id == ours.config.mask_token_id
    prompt = torch.tensor([1, 40, 7, 99, 3, 12, 5])
    runs = [speculative_generate(target, head.drafter("p"), prompt, k=4, sampling=Sampling(), max_new_tokens=24)
            for head in (ours, theirs)]
    assert [r.proposed for r in runs[0].rounds] == [r.proposed for r in runs[1].rounds]
    assert runs[0].tokens == runs[1].tokens and [r.accepted for r in runs[0].rounds] == [r.accepted for r in runs[1].rounds]


def test_vllm_serves_the_peagle_export_as_parallel_eagle3_and_drafts_what_draftsmith_drafts(peagle_run, tmp_path):
    """vLLM 0.33's config, registry, loader and Llama EAGLE-3 model with parallel drafting on the export
    (tests/train/vllm_peagle_worker.py says what of it runs here): the mask token reaches the proposer as
    `pard_token`, `mask_hidden` loads as trained, and the k drafting slots' logits are draftsmith's within 1e-4, so
    vLLM drafts the same k tokens in its one forward."""
    if not (VENV / "vllm" / ".installed").exists():
        pytest.skip(f"vllm is not installed in {VENV / 'vllm'}: run `make install`")
    written = export(peagle_run, tmp_path / "out", ExportSettings(formats=["speculators"], num_speculative_tokens=4))
    target, _ = load_target(TARGET, device=torch.device("cpu"))
    head = load_head(peagle_run / "best", target)
    k = 4
    ids, features, ours = _peagle_inputs(head, target, k)
    inputs = tmp_path / "inputs.safetensors"
    save_file({"ids": ids, "features": features.contiguous(), "k": torch.tensor([k])}, str(inputs))
    architecture, theirs = _vllm(written["speculators"], inputs, tmp_path / "vllm.safetensors", "vllm_peagle_worker.py")
    assert architecture == "PeagleLlamaForCausalLM"
    assert int(theirs["pard_token"][0]) == head.config.mask_token_id
    torch.testing.assert_close(theirs["mask_hidden"].view(-1), head.mask_hidden.detach().view(-1))
    kept = head.target_ids()
    torch.testing.assert_close(theirs["logits"][:, kept], ours[:, kept], rtol=1e-4, atol=1e-4)
    assert theirs["logits"].argmax(-1).tolist() == ours.argmax(-1).tolist()
    # The check has teeth: the same weights with the other residual convention give other logits.
    _edit_json(written["speculators"] / "config.json", lambda c: c.__setitem__("norm_before_residual", False))
    _, other = _vllm(written["speculators"], inputs, tmp_path / "other.safetensors", "vllm_peagle_worker.py")
    assert not torch.allclose(other["logits"][:, kept], ours[:, kept], rtol=1e-3, atol=1e-3)


def test_speculators_loads_the_peagle_export_and_computes_every_depth_as_draftsmith(peagle_run, tmp_path, speculators,
                                                                                   monkeypatch):
    """speculators' own from_pretrained on the P-EAGLE export builds its PEagleDraftModel with the trained
    `mask_hidden` (its loader would leave a missing one random, silently), and its training forward, with its
    conditional drop set to keep every anchor at every depth, gives draftsmith's logits for every (anchor, depth):
    the same mask entries, positions and depth-aware mask (within 1e-4, fp32)."""
    import speculators.models.peagle.core as peagle_core
    from speculators import SpeculatorModel, SpeculatorModelConfig
    from speculators.losses.utils import resolve_loss_config

    written = export(peagle_run, tmp_path / "out", ExportSettings(formats=["speculators"], num_speculative_tokens=4))
    target, _ = load_target(TARGET, device=torch.device("cpu"))
    head = load_head(peagle_run / "best", target)
    ids = torch.randint(3, target.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    features = capture(target, ids, torch.ones_like(ids), list(head.config.feature_layers)).flatten(2)
    E, D = ids.shape[1] - 1, head.depths
    with torch.no_grad():
        _, _, _, states = head._every_anchor(features, ids, torch.ones_like(ids))
    pairs = [(a, d) for d in range(D) for a in range(E - d)]  # speculators reads each chain's token inside the row
    anchors, depths = torch.tensor([a for a, _ in pairs]), torch.tensor([d for _, d in pairs])
    monkeypatch.setattr(peagle_core, "generate_cod_sample_indices", lambda **kwargs: (anchors, depths))

    def speculators_logits(directory):
        config = SpeculatorModelConfig.from_pretrained(directory)
        config.transformer_layer_config._attn_implementation = "eager"  # its default, flex attention, wants a GPU
        model = SpeculatorModel.from_pretrained(directory, config=config).eval()
        assert type(model).__name__ == "PEagleDraftModel" and model.mask_token_id == head.config.mask_token_id
        torch.testing.assert_close(model.mask_hidden.detach(), head.mask_hidden.detach())
        logits = []
        hook = model.lm_head.register_forward_hook(lambda module, args, output: logits.append(output))
        with torch.no_grad():  # speculators pairs hidden state t with token t+1: the caller shifts, as for EAGLE-3
            model(hidden_states=features[:, :-1], input_ids=ids[:, 1:], document_ids=torch.zeros_like(ids[:, 1:]),
                  loss_mask=torch.ones_like(ids[:, 1:]), num_depths=D,
                  loss_config=resolve_loss_config("kl_div", "eager"),  # its fused losses want Triton
                  verifier_last_hidden_states=torch.zeros(1, E, target.config.hidden_size))
        hook.remove()
        return logits[0][0].float()

    ours = head.draft_logits(states[0, [d * E + a for a, d in pairs]])
    theirs = speculators_logits(written["speculators"])
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    # The check has teeth: another mask token gives other logits at every depth past the first.
    _edit_json(written["speculators"] / "config.json", lambda c: c.__setitem__("mask_token_id", 5))
    head.config.mask_token_id = 5  # (so the class check above still holds)
    other = speculators_logits(written["speculators"])
    deeper = depths > 0
    assert not torch.allclose(other[deeper], ours[deeper], rtol=1e-3, atol=1e-3)


def test_a_pard_draft_exports_as_a_hugging_face_model_naming_its_mask_token(pard_run, tmp_path):
    """PARD's `hf` export: the draft's own directory and the target's tokenizer, its config naming `pard_token` (and
    no other mask id vLLM would read first) and the depths; `python -m eval` drafts with it in parallel."""
    written = export(pard_run, tmp_path / "out", ExportSettings(formats=["auto"]))
    assert set(written) == {"hf"}
    config = json.loads((written["hf"] / "config.json").read_text())
    assert config["pard_token"] == json.loads((pard_run / "best" / "config.json").read_text())["pard_token"]
    assert config["pard_depths"] == 4 and config.get("mask_token_id") is None
    with pytest.raises(ValueError, match="cannot be written as"):
        formats_for("pard", ["gguf"])
    cfg = compose_cfg("eval", "target=tiny_deep", f"drafters=[{{name: pard, kind: draft_lm, path: {written['hf']}}}]")
    target, tokenizer = load_target(TARGET, device=torch.device("cpu"))
    drafter = build_drafter(dict(cfg.drafters[0]), target=target, tokenizer=tokenizer)
    assert type(drafter).__name__ == "PardLM" and drafter.depths == 4


def test_vllm_serves_the_pard_export_as_a_parallel_draft_model_and_drafts_what_draftsmith_drafts(pard_run, tmp_path):
    """vLLM 0.33's config, vocabulary check, registry, loader and the draft's own model with parallel drafting on the
    export (tests/train/vllm_pard_worker.py says what of it runs here): its proposer takes `pard_token` as the mask,
    and the k drafting slots' logits are draftsmith's PARD draft's within 1e-4, so vLLM drafts the same k tokens."""
    if not (VENV / "vllm" / ".installed").exists():
        pytest.skip(f"vllm is not installed in {VENV / 'vllm'}: run `make install`")
    written = export(pard_run, tmp_path / "out", ExportSettings(formats=["hf"]))
    target, _ = load_target(TARGET, device=torch.device("cpu"))
    draft = PardLM(AutoModelForCausalLM.from_pretrained(written["hf"]), lean=False)
    k = 4
    ids = torch.randint(3, target.config.vocab_size, (12,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        tokens = torch.cat([ids, torch.full((k - 1,), draft.mask_token_id)])
        ours = draft.model(input_ids=tokens[None]).logits[0, len(ids) - 1:]
    draft.start(ids)
    assert draft.propose(k, Sampling()).tokens.tolist() == ours.argmax(-1).tolist()  # the loop drafts exactly these
    inputs = tmp_path / "inputs.safetensors"
    save_file({"ids": ids, "k": torch.tensor([k])}, str(inputs))
    architecture, theirs = _vllm(written["hf"], inputs, tmp_path / "vllm.safetensors", "vllm_pard_worker.py")
    assert architecture == "LlamaForCausalLM" and int(theirs["mask_token"][0]) == draft.mask_token_id
    torch.testing.assert_close(theirs["logits"], ours, rtol=1e-4, atol=1e-4)
    # The check has teeth: vLLM reads a top-level mask_token_id before pard_token; another one drafts otherwise.
    _edit_json(written["hf"] / "config.json", lambda c: c.__setitem__("mask_token_id", 5))
    _, other = _vllm(written["hf"], inputs, tmp_path / "other.safetensors", "vllm_pard_worker.py")
    assert int(other["mask_token"][0]) == 5 and not torch.allclose(other["logits"][1:], ours[1:], rtol=1e-3, atol=1e-3)


def test_llama_cpp_rows_say_why_it_cannot_serve_p_eagle_or_pard(peagle_run, pard_run, tmp_path):
    """llama.cpp drafts neither in one forward from mask entries: `python -m eval engine=llamacpp` converts neither
    (its draft-simple would run a PARD draft one token at a time, another drafter) and the row says why."""
    from eval.engines.llama_cpp_drafters import llama_cpp_drafter

    target, _ = load_target(TARGET, device=torch.device("cpu"))
    peagle = llama_cpp_drafter({"name": "p", "kind": "head", "path": str(peagle_run / "best")}, target, TARGET,
                               tmp_path / "engine")
    pard = llama_cpp_drafter({"name": "q", "kind": "draft_lm", "path": str(pard_run / "best")}, target, TARGET,
                             tmp_path / "engine")
    assert peagle.gguf is None and "P-EAGLE" in peagle.note and "parallel_drafting" in peagle.note
    assert pard.gguf is None and "PARD" in pard.note and not list((tmp_path / "engine").glob("*.gguf"))
