"""llama.cpp loads and serves what draftsmith exports: the engine is the test.

The tiny_deep world's target, an exported EAGLE-3 head and an exported draft LM are converted by
llama.cpp's own converter and served by its own `llama-server` on 127.0.0.1 (built by `make llama-cpp`,
which `make test` runs first). Greedy output with each drafter must equal the output without it, the
head's acceptance must be far above chance, and llama.cpp's acceptance length with the head must match
draftsmith's own loop on the same prompts: llama.cpp runs the same head on the same features, so the two
agree to rounding. Each of the field's export collapses, planted on purpose, fails that check.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafters.sampling import Sampling
from eval import llama_cpp
from eval.engine import DraftCounters
from eval.run import build_drafter, load_target
from eval.speculative import speculative_generate
from traffic import toyworld
from train.export import ExportSettings, export

# One worker runs the whole module under `pytest -n` (--dist loadgroup): its served world is built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("llama_cpp"), pytest.mark.skipif(not llama_cpp.available(), reason=(
    f"llama.cpp is not built at {llama_cpp.home()}: `make llama-cpp` (make test builds it)"))]

TARGET = "toyworld://tiny_deep/target"
K, NEW_TOKENS, PROMPTS = 4, 48, 12
TAU_TOLERANCE = 0.02  # llama.cpp's tau against draftsmith's, same head, same prompts (measured: 0.1 % apart)


@pytest.fixture(scope="module")
def world(tiny_world, tmp_path_factory):
    """The target as llama.cpp serves it, and held-out prompts as token ids."""
    target_dir = Path(toyworld.resolve(TARGET))
    out = tmp_path_factory.mktemp("gguf")
    gguf = llama_cpp.convert_to_gguf(target_dir, out / "target.gguf")
    target, tok = load_target(TARGET, device=torch.device("cpu"))
    records = [json.loads(line) for line in (target_dir.parent / "company_logs" / "eval.jsonl").open()][:PROMPTS]
    prompts = [tok.apply_chat_template(r["messages"][:-1], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for r in records]
    with llama_cpp.LlamaServer(gguf) as server:
        plain = [server.complete(p, NEW_TOKENS).tokens for p in prompts]
    return {"gguf": gguf, "dir": target_dir, "target": target, "tok": tok, "prompts": prompts, "plain": plain,
            "out": out}


def serve(world, draft_gguf, spec_type, stats=None, accept_none=False):
    """Completions of every prompt; with `stats` (a list), llama-server's drafting counters appended to it."""
    with llama_cpp.LlamaServer(world["gguf"], draft=draft_gguf, spec_type=spec_type, k=K, log_verbosity=4,
                               accept_none=accept_none) as server:
        completions = [server.complete(p, NEW_TOKENS) for p in world["prompts"]]
        if stats is not None:
            stats.append(DraftCounters(server).after(len(completions)))
        return completions


def llama_tau(stats) -> float:
    """1 + accepted drafts per verification, from llama-server's own counters: the field's acceptance length."""
    return 1 + stats.accepted / stats.verifications


def draftsmith_tau(world, drafter) -> float:
    """draftsmith's own loop on the same prompts, k and budget (greedy), τ as its reports define it."""
    accepted = rounds = 0
    for p in world["prompts"]:
        g = speculative_generate(world["target"], drafter, torch.tensor(p), k=K, sampling=Sampling(),
                                 max_new_tokens=NEW_TOKENS, eos_token_id=world["tok"].eos_token_id)
        accepted, rounds = accepted + sum(r.accepted for r in g.rounds), rounds + len(g.rounds)
    return 1 + accepted / rounds


def test_llama_cpp_tokenizes_like_the_target_tokenizer(world):
    """The converter was told the toy tokenizer's pre-tokenizer (gpt-2): prompts become the same ids."""
    with llama_cpp.LlamaServer(world["gguf"]) as server:
        for text in ['{"order_id": 20728, "status": "refunded"}\n', "def f(x):\n    return x ** 2  # sq\n",
                     "<|user|>\nhi  there<|end|>\n<|assistant|>\n", "unicode: héllo ñ 🦙"]:
            ours = world["tok"](text, add_special_tokens=False)["input_ids"]
            assert server._post("/tokenize", {"content": text, "add_special": False,
                                              "parse_special": True})["tokens"] == ours


def test_the_exported_eagle3_head_runs_in_llama_cpp_as_in_draftsmith(world, eagle_run):
    written = export(eagle_run, world["out"] / "eagle", ExportSettings(formats=["gguf"]))
    stats = []
    completions = serve(world, written["gguf"], "draft-eagle3", stats)
    assert [c.tokens for c in completions] == world["plain"]  # lossless in the engine
    proposed, accepted = sum(c.draft_n for c in completions), sum(c.draft_n_accepted for c in completions)
    assert accepted / proposed > 10 / 120  # far above chance (a uniform guess over 120 draft tokens)
    head = build_drafter({"name": "head", "kind": "head", "path": str(eagle_run / "best")},
                         target=world["target"], tokenizer=world["tok"])
    ours, theirs = draftsmith_tau(world, head), llama_tau(stats[0])
    assert abs(theirs / ours - 1) <= TAU_TOLERANCE, (ours, theirs)


def test_the_exported_draft_lm_runs_in_llama_cpp(world, draft_run):
    written = export(draft_run, world["out"] / "draft", ExportSettings(formats=["gguf"]))
    completions = serve(world, written["gguf"], "draft-simple")
    assert [c.tokens for c in completions] == world["plain"]
    proposed, accepted = sum(c.draft_n for c in completions), sum(c.draft_n_accepted for c in completions)
    assert accepted / proposed > 10 / 320
    # The same drafter keeping none of its drafts (what the engine's c and β are measured on): every round
    # drafts k and verifies, each emits the target's own token, so the output is still the plain output.
    stats = []
    none_kept = serve(world, written["gguf"], "draft-simple", stats, accept_none=True)
    assert [c.tokens for c in none_kept] == world["plain"]
    generated = sum(len(c.tokens) - 1 for c in none_kept)  # each answer's first token is the prompt forward's
    assert stats[0].accepted == 0 and 0.9 * generated <= stats[0].verifications <= generated
    assert stats[0].drafted >= 0.9 * K * stats[0].verifications


def _sglang_copy(eagle_run, world, name) -> Path:
    written = export(eagle_run, world["out"] / name, ExportSettings(formats=["sglang"]))
    return written["sglang"]


def _plant_layers_off_by_one(directory: Path) -> None:
    """SGLang's 0-based ids written where vLLM's and llama.cpp's belong (the field's classic)."""
    config = json.loads((directory / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    (directory / "config.json").write_text(json.dumps(config))


def _edit_weights(directory: Path, edit) -> None:
    state = load_file(str(directory / "model.safetensors"))
    edit(state)
    save_file(state, str(directory / "model.safetensors"))


def _plant_d2t_as_ids(directory: Path) -> None:
    _edit_weights(directory, lambda s: s.__setitem__("d2t", torch.arange(s["d2t"].numel()) + s["d2t"]))


def _plant_no_lm_head(directory: Path) -> None:
    _edit_weights(directory, lambda s: s.pop("lm_head.weight"))


@pytest.mark.parametrize("plant", [_plant_layers_off_by_one, _plant_d2t_as_ids, _plant_no_lm_head],
                         ids=["layers_off_by_one", "d2t_as_ids", "no_lm_head"])
def test_a_collapsed_export_fails_the_engine_check(world, eagle_run, plant):
    """Bypassing the export guard, each collapse either fails llama.cpp's conversion or serving, or moves
    llama.cpp's acceptance length away from draftsmith's: the check above catches it."""
    directory = _sglang_copy(eagle_run, world, plant.__name__)
    plant(directory)
    try:
        gguf = llama_cpp.convert_to_gguf(directory, world["out"] / f"{plant.__name__}.gguf", target_dir=world["dir"])
        stats = []
        completions = serve(world, gguf, "draft-eagle3", stats)
    except (RuntimeError, OSError):  # refused by llama.cpp's converter or server: a loud failure
        return
    head = build_drafter({"name": "head", "kind": "head", "path": str(eagle_run / "best")},
                         target=world["target"], tokenizer=world["tok"])
    lossless = [c.tokens for c in completions] == world["plain"]
    close = abs(llama_tau(stats[0]) / draftsmith_tau(world, head) - 1) <= TAU_TOLERANCE
    assert not (lossless and close)
