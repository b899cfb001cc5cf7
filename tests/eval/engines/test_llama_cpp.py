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
from eval.engines import llama_cpp
from eval.engines.formats.writing import draft_lm_gguf, target_directory
from eval.engines.llama_cpp_drafters import llama_cpp_drafter
from eval.engines.llama_cpp_measure import DraftCounters
from eval.run import build_drafter, load_target
from eval.speculative import autoregressive_generate, speculative_generate
from traffic import models, toyworld
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


def test_a_run_killed_with_sigterm_stops_the_llama_server_it_started(world, tmp_path):
    """`kill` on `python -m eval` / `python -m train` (their entry points call `stop_on_sigterm`) ends the run through
    its context managers, so the llama-server it started stops too instead of outliving it with its memory."""
    import os
    import subprocess
    import sys

    child = (f"import sys, time\nfrom eval.engines import llama_cpp\nfrom eval.engines.engine import stop_on_sigterm\n"
             f"stop_on_sigterm()\nwith llama_cpp.LlamaServer({str(world['gguf'])!r}) as server:\n"
             f"    print(server.process.pid, flush=True)\n    time.sleep(120)\n")
    run = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True,
                           cwd=Path(__file__).resolve().parents[3])
    server = int(run.stdout.readline())
    os.kill(server, 0)  # serving
    run.terminate()
    assert run.wait(timeout=60) == 143
    with pytest.raises(ProcessLookupError):
        os.kill(server, 0)


def test_an_interrupt_while_the_server_loads_stops_it(world, monkeypatch):
    """Ctrl-C or `kill` while llama-server loads (before `with` has a server to exit) stops the process it started."""
    import urllib.request

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(urllib.request, "urlopen", interrupted)  # the first health check
    server = llama_cpp.LlamaServer(world["gguf"])
    with pytest.raises(KeyboardInterrupt):
        server.__enter__()
    assert server.process.poll() is not None


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


def draftsmith_tau(world, drafter, new_tokens: int = NEW_TOKENS) -> float:
    """draftsmith's own loop on the same prompts, k and budget (greedy), τ as its reports define it."""
    accepted = rounds = 0
    for p in world["prompts"]:
        g = speculative_generate(world["target"], drafter, torch.tensor(p), k=K, sampling=Sampling(),
                                 max_new_tokens=new_tokens, eos_token_id=world["tok"].eos_token_id)
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


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_the_built_server_loads_and_decodes_a_quantized_gguf(world, qtype):
    """A target as teams deploy it, quantized by llama.cpp's own llama-quantize, loads and decodes in the built
    server. The tiny target's matrices are multiples of 32 wide and high, so on a CPU with AMX they are what
    ggml's AMX kernels take (Q4_0, Q4_1, Q8_0 and K-quants, sizes in steps of 32): the build that ran those
    kernels died here with SIGSEGV on such a machine, in the server's warm-up decode
    (scripts/build_llama_cpp.sh leaves them out there)."""
    quantized = llama_cpp.quantize(world["gguf"], world["out"] / f"target-{qtype}.gguf", qtype)
    with llama_cpp.LlamaServer(quantized) as server:
        completions = [server.complete(p, NEW_TOKENS).tokens for p in world["prompts"][:4]]
    # Quantized weights answer differently, and may end sooner, but every answer is tokens of the vocabulary.
    assert all(0 < len(tokens) <= NEW_TOKENS for tokens in completions)
    assert all(0 <= t < world["target"].config.vocab_size for tokens in completions for t in tokens)
    if qtype == "Q8_0":  # 8-bit weights: the float model's first greedy tokens
        assert [t[:4] for t in completions] == [t[:4] for t in world["plain"][:4]]


@pytest.mark.parametrize("run", ["eagle_run", "eagle_own_run"])  # drafting through the target's output head, or its own
def test_the_exported_eagle3_head_runs_in_llama_cpp_as_in_draftsmith(world, run, request):
    eagle_run = request.getfixturevalue(run)
    written = export(eagle_run, world["out"] / run, ExportSettings(formats=["gguf"]))
    stats = []
    completions = serve(world, written["gguf"], "draft-eagle3", stats)
    assert [c.tokens for c in completions] == world["plain"]  # lossless in the engine
    proposed, accepted = sum(c.draft_n for c in completions), sum(c.draft_n_accepted for c in completions)
    assert accepted / proposed > 10 / 120  # far above chance (a uniform guess over 120 draft tokens)
    head = build_drafter({"name": "head", "kind": "head", "path": str(eagle_run / "best")},
                         target=world["target"], tokenizer=world["tok"])
    ours, theirs = draftsmith_tau(world, head), llama_tau(stats[0])
    assert abs(theirs / ours - 1) <= TAU_TOLERANCE, (ours, theirs)


@pytest.mark.parametrize("run", ["dflash_run", "dflash_vocab_run"])  # the whole vocabulary, or a draft vocabulary
def test_the_exported_dflash_drafter_runs_in_llama_cpp_as_in_draftsmith(world, run, request):
    """llama.cpp's own converter reads the `dflash` export with the target's directory, and llama-server's
    draft-dflash drafts a block in one forward as draftsmith's loop does: lossless, and the same τ. A draft
    vocabulary reaches the engine: the GGUF carries `d2t` as the target ids of the draft tokens (llama.cpp's graph
    scatters the block's logits through it)."""
    import gguf

    dflash_run = request.getfixturevalue(run)
    written = export(dflash_run, world["out"] / run, ExportSettings(formats=["dflash", "gguf"]))
    config = json.loads((written["dflash"] / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == K + 1
    tensors = {t.name: t for t in gguf.GGUFReader(str(written["gguf"])).tensors}
    saved = load_file(str(dflash_run / "best" / "model.safetensors"))
    if "draft_vocab_size" in config:
        assert tensors["d2t"].data.tolist() == (torch.arange(saved["d2t"].numel()) + saved["d2t"]).tolist()
        assert tuple(tensors["output.weight"].shape) == (config["hidden_size"], config["draft_vocab_size"])
    else:
        assert "d2t" not in tensors and "output.weight" not in tensors  # the target's output head, shared
    vocabulary = config.get("draft_vocab_size") or world["target"].config.vocab_size
    stats = []
    completions = serve(world, written["gguf"], "draft-dflash", stats)
    assert [c.tokens for c in completions] == world["plain"]  # lossless in the engine
    proposed, accepted = sum(c.draft_n for c in completions), sum(c.draft_n_accepted for c in completions)
    assert accepted / proposed > 10 / vocabulary  # far above chance
    drafter = build_drafter({"name": "dflash", "kind": "head", "path": str(dflash_run / "best")},
                            target=world["target"], tokenizer=world["tok"])
    ours, theirs = draftsmith_tau(world, drafter), llama_tau(stats[0])
    assert abs(theirs / ours - 1) <= TAU_TOLERANCE, (ours, theirs)


@pytest.mark.parametrize("run,spec_type", [("eagle_run", "draft-eagle3"), ("dflash_run", "draft-dflash")])
def test_a_head_with_a_gguf_type_is_quantized_by_llama_cpp_and_stays_lossless(world, run, spec_type, request):
    """`gguf_type` on a head's spec (as on a draft LM's): converted, then quantized by llama-quantize; llama-server
    serves the Q8_0 file losslessly, and it keeps what the 16-bit file keeps within 8-bit weights' rounding."""
    head = request.getfixturevalue(run) / "best"
    out = world["out"] / f"quantized_{run}"
    out.mkdir()
    f16 = llama_cpp_drafter({"name": "head", "kind": "head", "path": str(head)}, world["target"], TARGET, out)
    q8 = llama_cpp_drafter({"name": "head", "kind": "head", "path": str(head), "gguf_type": "Q8_0"}, world["target"],
                           TARGET, out)
    assert (q8.gguf.name, q8.dtype, q8.spec_type) == ("head-Q8_0.gguf", "Q8_0", spec_type)
    assert models.gguf_type(q8.gguf) == "Q8_0" and models.gguf_type(f16.gguf) in ("F16", "BF16")
    assert q8.gguf.stat().st_size < f16.gguf.stat().st_size
    stats = []
    for served in (f16, q8):
        assert [c.tokens for c in serve(world, served.gguf, spec_type, stats)] == world["plain"]
    assert stats[1].accepted > 0
    assert abs(llama_tau(stats[1]) / llama_tau(stats[0]) - 1) <= 0.1, (llama_tau(stats[0]), llama_tau(stats[1]))


@pytest.mark.parametrize("form", ["sglang", "speculators"])
def test_a_head_in_an_engines_format_is_served_as_it_is(world, eagle_run, form):
    """An EAGLE-3 head given to `python -m eval` in SGLang's or speculators' layout (a peer trainer's export, say)
    goes through llama.cpp's converter unchanged, and llama.cpp drafts with it as draftsmith's loop does."""
    written = export(eagle_run, world["out"] / f"as_{form}", ExportSettings(formats=[form]))
    spec = {"name": f"as_{form}", "kind": "head", "path": str(written[form])}
    served = llama_cpp_drafter(spec, world["target"], TARGET, world["out"] / f"served_{form}")
    assert served.gguf is not None and served.spec_type == "draft-eagle3", served
    stats = []
    completions = serve(world, served.gguf, served.spec_type, stats)
    assert [c.tokens for c in completions] == world["plain"]
    head = build_drafter(spec, target=world["target"], tokenizer=world["tok"])  # the export, read by draftsmith
    assert abs(llama_tau(stats[0]) / draftsmith_tau(world, head) - 1) <= TAU_TOLERANCE


def test_llama_cpps_confidence_stop_is_the_drop_rule_of_draftsmiths_loop(world, eagle_run):
    """The head served with --spec-draft-p-min (eval/engines/llama_cpp_drafters.py passes a drafter's stop_below with stop_rule
    drop): lossless, some rounds draft nothing, and τ per round (its draft calls) is draftsmith's loop's with
    the same stop, which llama.cpp's f16 head reproduces but for a decision near the threshold."""
    written = export(eagle_run, world["out"] / "stop", ExportSettings(formats=["gguf"]))
    stop = 0.8
    with llama_cpp.LlamaServer(world["gguf"], draft=written["gguf"], spec_type="draft-eagle3", k=K, log_verbosity=4,
                               p_min=stop) as server:
        completions = [server.complete(p, NEW_TOKENS) for p in world["prompts"]]
        stats = DraftCounters(server).after(len(completions))
    assert [c.tokens for c in completions] == world["plain"]
    assert 0 < stats.verifications < stats.rounds  # the stop left some rounds without a draft, and not all
    head = build_drafter({"name": "head", "kind": "head", "path": str(eagle_run / "best"), "stop_below": stop,
                          "stop_rule": "drop"}, target=world["target"], tokenizer=world["tok"])
    ours, theirs = draftsmith_tau(world, head), 1 + stats.accepted / stats.rounds
    assert abs(theirs / ours - 1) <= 0.05, (ours, theirs)


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


def test_a_gemma3_target_serves_an_eagle3_head_in_llama_cpp_as_in_draftsmith(tiny_world, tmp_path):
    """The build's patch (eval/engines/llama_cpp_patches/gemma3-layer-inputs.patch): llama.cpp's Gemma-3 graph hands its
    layers' inputs to an EAGLE-3 drafter, as its Llama graph does (unpatched, llama-server aborts at the first
    decode). A tiny Gemma-3 target (transformers' config class, the toy world's tokenizer) and a head trained on
    its outputs for a few seconds, both through llama.cpp's converter: lossless, and llama.cpp's τ is
    draftsmith's on the same prompts, so it drafts from the same features (Gemma's scaled embedding included)."""
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    from helpers import _common

    tok = AutoTokenizer.from_pretrained(toyworld.resolve(TARGET))
    # Six layers: the head's default features [1, 3, 5] are layer inputs (helpers.tiny's three would read index n,
    # the final norm's output, which llama.cpp's EAGLE-3 does not take). One rope base and the attention scale
    # given as llama.cpp's converter reads them (it does not read transformers 5's per-layer-type rope_parameters).
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    config = Gemma3TextConfig(**{**_common(len(tok)), "head_dim": 8, "num_hidden_layers": 6, "query_pre_attn_scalar": 8,
                                 "rope_parameters": {"sliding_attention": rope, "full_attention": rope}})
    torch.manual_seed(0)
    serves_eagle3_as_draftsmith(Gemma3ForCausalLM(config), tok, tmp_path)


def test_a_qwen2_target_serves_an_eagle3_head_in_llama_cpp_as_in_draftsmith(tiny_world, tmp_path):
    """The build's patch (eval/engines/llama_cpp_patches/qwen2-layer-inputs.patch): llama.cpp's Qwen2 graph hands its
    layers' inputs to an EAGLE-3 drafter (Qwen2.5-Coder's architecture, docs/benchmarks/qwen-coder.md). A tiny Qwen2
    target with the attention biases Llama lacks, as the Gemma-3 test does it: lossless, and llama.cpp's τ is
    draftsmith's. Its vocabulary has room to spare: llama.cpp's converter loads the toy tokenizer as Qwen2's, which
    adds <|endoftext|>."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from helpers import _common

    tok = AutoTokenizer.from_pretrained(toyworld.resolve(TARGET))
    config = Qwen2Config(**{**_common(len(tok) + 16), "num_hidden_layers": 6})
    torch.manual_seed(0)
    # 400 steps: at 150 this random target's head keeps τ 1.1, too near chance to show a wrong feature
    serves_eagle3_as_draftsmith(Qwen2ForCausalLM(config), tok, tmp_path, steps=400)


def serves_eagle3_as_draftsmith(target, tok, tmp_path, steps: int = 150) -> None:
    """A head trained on `target`'s outputs for a few seconds, target and head through llama.cpp's converter, served
    by llama-server: lossless, and its τ is draftsmith's on the same prompts."""
    from drafters.registry import build_head, save_head
    from eval.engines.formats.eagle3 import eagle3_gguf
    from train.hidden_states import capture, default_layers

    target = target.eval().requires_grad_(False)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(4.0)  # random init is near uniform: decisive argmaxes
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    n = target.config.num_hidden_layers
    layers = default_layers("eagle", n)
    assert max(layers) < n  # layer inputs, which the patched graph exposes
    torch.manual_seed(0)
    head = build_head("eagle", target, layers, ttt_steps=3, ttt_decay=0.8)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):  # the head learns the target's argmax on random text: acceptance far above chance
        ids = torch.randint(3, len(tok), (8, 32), generator=generator)
        attn = torch.ones_like(ids)
        features = capture(target, ids, attn, layers).flatten(2)
        labels = target(input_ids=ids).logits.argmax(-1)
        loss, _ = head(features, ids, attn, attn, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval()
    head_gguf = eagle3_gguf(save_head(head, tmp_path / "head"), target, str(target_dir), tmp_path / "head.gguf")
    target_gguf = llama_cpp.convert_to_gguf(target_dir, tmp_path / "target.gguf")
    prompts = [torch.randint(3, len(tok), (12,), generator=generator).tolist() for _ in range(6)]
    with llama_cpp.LlamaServer(target_gguf) as server:
        plain = [server.complete(p, 32).tokens for p in prompts]
    with llama_cpp.LlamaServer(target_gguf, draft=head_gguf, spec_type="draft-eagle3", k=K, log_verbosity=4) as server:
        completions = [server.complete(p, 32) for p in prompts]
        stats = DraftCounters(server).after(len(prompts))
    assert [c.tokens for c in completions] == plain  # lossless in the engine
    ours_plain = [autoregressive_generate(target, torch.tensor(p), sampling=Sampling(), max_new_tokens=32,
                                          eos_token_id=tok.eos_token_id).tokens for p in prompts]
    for p, ours_tokens, theirs in zip(prompts, ours_plain, plain):  # the same model in both engines
        if ours_tokens != theirs:  # a parting only at a near tie of the two engines' roundings
            j = next(i for i, (a, b) in enumerate(zip(ours_tokens, theirs)) if a != b)
            with torch.no_grad():
                logits = target(input_ids=torch.tensor([p + ours_tokens[:j]])).logits[0, -1]
            assert abs(float(logits[ours_tokens[j]] - logits[theirs[j]])) < 1e-3, (p, j, ours_tokens, theirs)
    head.attach(target)
    ours = draftsmith_tau({"target": target, "tok": tok, "prompts": prompts}, head.drafter("head"), new_tokens=32)
    assert ours > 1.2  # far above chance (1/320 a guess): a wrong feature would show in the engine's τ
    assert abs(llama_tau(stats) / ours - 1) <= TAU_TOLERANCE, (ours, llama_tau(stats))


def test_eagle3_keeps_its_guesses_when_requests_draft_together(world, eagle_run):
    """eval/engines/llama_cpp_patches/eagle3-backend-sampler-outputs.patch: unpatched, llama-server's EAGLE-3 drafts of
    requests decoded together read the last request's candidate tokens (τ 1.37 at one slot, 1.11 at four on
    SmolLM2). Four slots with the requests sent together keep what one slot keeps, outputs unchanged."""
    from concurrent.futures import ThreadPoolExecutor

    written = export(eagle_run, world["out"] / "eagle-slots", ExportSettings(formats=["gguf"]))
    taus = {}
    for slots in (1, 4):
        with llama_cpp.LlamaServer(world["gguf"], draft=written["gguf"], spec_type="draft-eagle3", k=K,
                                   parallel=slots, log_verbosity=4) as server:
            with ThreadPoolExecutor(slots) as pool:
                completions = list(pool.map(lambda p: server.complete(p, NEW_TOKENS), world["prompts"]))
            assert [c.tokens for c in completions] == world["plain"]
            taus[slots] = llama_tau(DraftCounters(server).after(len(completions)))
    assert taus[1] > 1.5 and abs(taus[4] / taus[1] - 1) <= TAU_TOLERANCE, taus


def test_a_draft_shipped_as_a_gguf_is_served_as_it_is_and_a_trained_one_in_the_type_asked(world, draft_run):
    """The off-the-shelf draft as a team has it (here tiny_deep's draft as a Q8_0 file) is served as that file, not
    re-converted; a trained draft with `gguf_type` is converted, then quantized by llama-quantize, and stays lossless."""
    out = world["out"] / "shipped"
    out.mkdir()
    f16 = draft_lm_gguf(target_directory("toyworld://tiny_deep/draft"), out / "draft-f16.gguf", "float16", TARGET)
    shipped = llama_cpp.quantize(f16, out / "draft-Q8_0.gguf", "Q8_0")
    served = llama_cpp_drafter({"name": "off_the_shelf", "kind": "draft_lm", "path": str(shipped)}, world["target"],
                               TARGET, out)
    assert (served.gguf, served.dtype, served.spec_type) == (shipped.resolve(), "Q8_0", "draft-simple")
    assert not (out / "off_the_shelf.gguf").exists()
    trained = llama_cpp_drafter({"name": "trained", "kind": "draft_lm", "path": str(draft_run / "best"),
                                 "gguf_type": "Q8_0"}, world["target"], TARGET, out)
    assert (trained.gguf.name, trained.dtype) == ("trained-Q8_0.gguf", "Q8_0")
    assert models.gguf_type(trained.gguf) == "Q8_0" and models.gguf_type(out / "trained.gguf") in ("F16", "BF16")
    completions = serve(world, trained.gguf, "draft-simple")
    assert [c.tokens for c in completions] == world["plain"]
    assert sum(c.draft_n_accepted for c in completions) > 0


def test_a_tokenizer_draftsmith_cannot_name_is_left_to_the_converters_own_table(tiny_world, tmp_path):
    """A released model's tokenizer (Qwen2's regex split, say) is one draftsmith's `tokenizer_pre_of` cannot name but
    llama.cpp's converter knows by its hash: the conversion is tried, not refused. Where the converter does not know
    it either (this toy vocabulary's hash), the error gives both."""
    import shutil

    target_dir = tmp_path / "target"
    shutil.copytree(toyworld.resolve(TARGET), target_dir)
    tokenizer = json.loads((target_dir / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{N}| ?[^\s\p{L}\p{N}]+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    (target_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="no llama.cpp pre-tokenizer is known"):
        llama_cpp.tokenizer_pre_of(target_dir)
    with pytest.raises(RuntimeError, match=r"(?s)BPE pre-tokenizer was not recognized.*no llama.cpp pre-tokenizer is known"):
        llama_cpp.convert_to_gguf(target_dir, tmp_path / "target.gguf")
