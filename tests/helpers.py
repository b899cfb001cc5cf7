"""Helpers the tests import: tiny models built in the test and stub drafters."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
import transformers as T
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from drafters.base import Proposal
from drafters.sampling import Sampling, probs_from_logits
from eval.speculative import speculative_generate

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """A script of `scripts/` (which is not a package) imported as a module, e.g. load_script("show_rounds")."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def killed_while_serving(argv: list[str], cwd: Path, server: str = "llama-server",
                         timeout: float = 300) -> tuple[int, int]:
    """Run `argv`, wait until a child process `server` runs, SIGTERM the run and wait for it to end: its exit status
    and the server's pid (see `gone`)."""
    log = tempfile.TemporaryFile()  # not a pipe: a run that logs more than a pipe holds would block on it
    run = subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and run.poll() is None:
            for child in _children(run.pid):
                if Path(child[1]).name == server:
                    time.sleep(1)  # past the run's own return from starting it
                    run.terminate()
                    return run.wait(timeout=120), child[0]
            time.sleep(0.2)
        log.seek(0)
        raise AssertionError(f"{argv} never started {server}: {log.read()[-2000:].decode(errors='replace')}")
    finally:
        if run.poll() is None:
            run.kill()
        log.close()


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, program) of each child of process `pid` (psutil, which accelerate depends on)."""
    found = []
    for child in psutil.Process(pid).children():
        try:
            found.append((child.pid, child.cmdline()[0]))
        except (psutil.NoSuchProcess, IndexError):  # it ended meanwhile (a zombie's cmdline is empty)
            pass
    return found


def gone(pid: int) -> bool:
    """Whether process `pid` has ended; one still running is killed, so a failing test leaves nothing behind."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    return False


def tiny_llama(vocab: int = 64, hidden: int = 32, layers: int = 2, seed: int = 0, logit_scale: float = 1.0,
               eos: int | None = None) -> LlamaForCausalLM:
    """A random Llama small enough to run thousands of times in a test. logit_scale > 1 sharpens its
    distributions (random init is close to uniform, which would hide sampling bugs)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=eos)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


class ScriptedDrafter:
    """A stub drafter that knows the target's greedy continuation and is right exactly where told.

    policy(position) -> bool says whether the guess for generated position `position` is right; a
    wrong guess is the right token + 1 (mod vocab).
    """

    parallel = False  # its k guesses cost k draft steps (drafters/base.py `Drafter.parallel`)

    def __init__(self, reference: list[int], vocab: int, policy, name: str = "scripted") -> None:
        self.reference, self.vocab, self.policy, self.name = reference, vocab, policy, name

    def start(self, prompt_ids):
        # Generated tokens committed so far: the loop starts a drafter after the first one, which the
        # prompt's own forward gave.
        self.committed = 1
        self.device = prompt_ids.device

    def propose(self, k, sampling: Sampling, generator=None):
        guesses = []
        for i in range(k):
            pos = self.committed + i
            right = self.reference[pos] if pos < len(self.reference) else 0
            guesses.append(right if self.policy(pos) else (right + 1) % self.vocab)
        return Proposal(torch.tensor(guesses, device=self.device), None)

    def commit(self, n_accepted, next_token):
        self.committed += n_accepted + 1


# --- distribution checks: sampled speculative decoding must follow the target ---------------------


def exact_joint(target, prompt, sampling, vocab, n=3):
    """p(x1, ..., xn) of the target's first n sampled tokens, by enumeration, flattened (x1 the slowest).

    Three tokens by default: the first comes from the prompt's forward, so a round drafting k = 2 then
    decides the second and the third (acceptance, residual and bonus alike)."""
    joint = torch.ones(1)
    seqs = prompt[None]
    with torch.no_grad():
        for _ in range(n):
            p = probs_from_logits(target(seqs).logits[:, -1], sampling)  # (vocab ** i, vocab)
            joint = (joint[:, None] * p).flatten()
            seqs = torch.cat([seqs.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(len(seqs))[:, None]], dim=1)
    return joint


def empirical_joint(target, drafter, prompt, sampling, vocab, k, samples, n=3, tree=None):
    """Counts of the first n tokens of `samples` speculative generations (chains of k, or `tree`s), flattened as
    exact_joint."""
    counts = torch.zeros(vocab ** n)
    g = torch.Generator().manual_seed(1234)
    for _ in range(samples):
        out = speculative_generate(target, drafter, prompt, k=k, sampling=sampling, max_new_tokens=n, generator=g,
                                   tree=tree)
        counts[sum(t * vocab ** (n - 1 - i) for i, t in enumerate(out.tokens))] += 1
    return counts


def batched_pvalues(target, make_drafter, sampling, vocab, batches, seed=7, n=3, slots=None):
    """Batches of 4 rows (two prompts of different lengths, twice each, decoded at once by eval/batching.py;
    with `slots` < 4, the later ones join as rows finish): each prompt's first n tokens, pooled over its rows
    and the batches, against the target's exact joint; the two chi-squared p-values. `make_drafter()` gives
    a fresh batch drafter."""
    from eval.batching import speculative_generate_batch

    prompts = [torch.tensor([1, 4, 2]), torch.tensor([3, 0, 5, 1, 1])]
    g = torch.Generator().manual_seed(seed)
    counts = [torch.zeros(vocab ** n) for _ in prompts]
    for _ in range(batches):
        out = speculative_generate_batch(target, make_drafter(), prompts * 2, k=2, sampling=sampling,
                                         max_new_tokens=n, generator=g, slots=slots)
        for row, gen in enumerate(out.rows):
            counts[row % 2][sum(t * vocab ** (n - 1 - i) for i, t in enumerate(gen.tokens))] += 1
    return [chi2_pvalue(c, exact_joint(target, p, sampling, vocab, n)) for p, c in zip(prompts, counts)]


def chi2_pvalue(counts, probs):
    expected = probs * counts.sum()
    keep = expected >= 5  # pool rare cells so the chi-square approximation holds
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


# --- confidence stop: where a drafter with `stop_below` ends its round --------------------------------


class Recording:
    """Wraps a drafter for the loop and keeps every proposal it makes."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.parallel = inner, inner.name, inner.parallel
        if getattr(inner, "feature_layers", None):
            self.feature_layers = inner.feature_layers
        self.proposals: list[Proposal] = []

    def start(self, *args) -> None:
        self.inner.start(*args)

    def propose(self, k, sampling, generator=None) -> Proposal:
        self.proposals.append(self.inner.propose(k, sampling, generator))
        return self.proposals[-1]

    def commit(self, *args) -> None:
        self.inner.commit(*args)


def stop_point(target, make_drafter, prompt, k: int, threshold: float, seed: int = 0) -> int:
    """Check the confidence stop on a first round and return where it ended it.

    `make_drafter(stop_below)` builds the drafter. The first proposal is drafted twice from the same
    draws (sampling, one generator seed), without a stop and with `stop_below=threshold`; the stopped
    proposal must be the other's prefix through its first guess whose own probability q(guess) is
    below the threshold, with the same q."""
    proposals = []
    for stop in (0.0, threshold):
        drafter = Recording(make_drafter(stop))
        speculative_generate(target, drafter, prompt, k=k, sampling=Sampling(temperature=1.0), max_new_tokens=2,
                             generator=torch.Generator().manual_seed(seed))
        proposals.append(drafter.proposals[0])
    full, stopped = proposals
    own = full.probs[torch.arange(len(full)), full.tokens]
    unsure = (own < threshold).nonzero()
    expected = int(unsure[0]) + 1 if len(unsure) else len(full)
    assert stopped.tokens.tolist() == full.tokens[:expected].tolist(), (own.tolist(), threshold)
    assert torch.equal(stopped.probs, full.probs[:expected])
    return expected


def trained_to_self(target, head, steps: int = 60):
    """A few steps of a head on the target's own greedy text, so that some guesses are accepted and rollback is
    exercised."""
    from train.hidden_states import capture

    g = torch.Generator().manual_seed(7)
    starts = torch.randint(0, target.config.vocab_size, (8, 1), generator=g)
    with torch.no_grad():
        ids = target.generate(starts, max_new_tokens=23, do_sample=False, pad_token_id=0)
    attn = torch.ones_like(ids)
    feats = capture(target, ids, attn, list(head.config.feature_layers)).flatten(2)
    with torch.no_grad():
        probs = torch.softmax(target(input_ids=ids).logits, -1)
    head.train()
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        loss, _ = head(feats, ids, attn, attn, probs)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def engine_states(target, ids: list[int], layers: list[int]) -> torch.Tensor:
    """(T, layers, d) as an engine's connector writes them (vLLM's, into the files speculators' data generation keeps):
    Hugging Face's hidden states but layer n, the last layer's output before the final norm."""
    from train.hidden_states import capture

    seen = {}
    hook = target.model.norm.register_forward_hook(lambda module, args, out: seen.update(pre=args[0]))
    try:
        states = capture(target, torch.tensor([ids]), None, layers)[0].clone()
    finally:
        hook.remove()
    for j, layer in enumerate(layers):  # every copy of n: a head whose own layers end at n asks for it twice
        if layer == target.config.num_hidden_layers:
            states[:, j] = seen["pre"][0]
    return states


def write_engine_files(target, data_cache: Path, folder: Path) -> Path:
    """An engine's hs_{i}.safetensors files (`engine_states`) for every record prepared under `data_cache`, the
    training and the held-out ones, at the layers of the offline cache there: what speculators' data generation would
    leave for `drafter.hidden_states=files`."""
    import datasets
    from safetensors.torch import save_file

    from train.hidden_states import ShardReader

    layers = ShardReader(next(Path(data_cache).glob("hidden-*/manifest.json")).parent).layers
    folder.mkdir(parents=True)
    rows = [r for split in sorted(Path(data_cache).glob("**/tokenized")) for r in datasets.load_from_disk(str(split))]
    for i, row in enumerate(rows):
        ids = torch.tensor(row["input_ids"])
        save_file({"hidden_states": engine_states(target, ids.tolist(), layers), "token_ids": ids},
                  folder / f"hs_{i}.safetensors")
    return folder


def train_tiny_deep(out, *overrides, target: str = "tiny_deep"):
    """A `python -m train` run on the tiny_deep world (a 4-layer target; or `target`), a few steps, no final
    evaluation."""
    from hydra import compose, initialize_config_dir

    from train.__main__ import train
    from train.config import register

    register()
    conf = str(Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=smoke", f"target={target}", "progress=false",
                                                      "evaluate.enabled=false", f"out_dir={out}",
                                                      f"data_cache={out.parent / 'data'}", *overrides])
    train(cfg)
    return out


def masked_spans(example, tok) -> list[str]:
    """The decoded runs of tokens an example's loss mask covers, in order (one per assistant turn)."""
    spans, current = [], []
    for token, m in zip(example.input_ids, example.loss_mask):
        if m:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return [tok.decode(s) for s in spans + ([current] if current else [])]


# --- agent traffic: a tool-calling conversation and a chat template that renders it -----------------------

# A prefix-preserving template in the style of the tool-calling chat models: the offered tools in the
# system turn, tool calls as <tool_call> JSON, tool results in their own turn, reasoning in <think>.
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}\n</think>\n{% endif %}"
    "{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "lookup_order", "parameters": {"type": "object"}}}]
CHAT = {
    "id": "c1", "category": "agent", "tools": TOOLS,
    "messages": [
        {"role": "developer", "content": "Answer with the order's status."},
        {"role": "user", "content": [{"type": "text", "text": "Where is order 42?"},
                                     {"type": "image_url", "image_url": {"url": "data:..."}}]},
        {"role": "assistant", "content": None, "reasoning_content": "I should look it up.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "lookup_order", "arguments": "{\"order\": 42}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"status\": \"shipped\"}"},
        {"role": "assistant", "content": "<think>It shipped.</think>Order 42 has shipped."},
    ],
}


# --- tiny random models of every common family, from transformers' config classes -------------------------

def _common(vocab: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=None)


# name -> (config class, model class, family-specific settings); the post-processing of the output logits
# is set well away from neutral so that a head reading plain lm_head logits would be visibly off.
FAMILIES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {"head_dim": 8}),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                                                           "moe_intermediate_size": 16}),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, {"head_dim": 8, "final_logit_softcapping": 1.5}),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, {"head_dim": 8, "final_logit_softcapping": 1.5}),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, {}),
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, None),
    "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, {"num_key_value_heads": None}),
    "granite": (T.GraniteConfig, T.GraniteForCausalLM, {"logits_scaling": 0.5}),
    "cohere": (T.CohereConfig, T.CohereForCausalLM, {"logit_scale": 0.5}),
}


def tiny(family: str, vocab: int = 48, seed: int = 0, sharpen: float = 4.0):
    """A random tiny target of `family`, its output head scaled by `sharpen` (random init is near uniform)."""
    config_class, model_class, extra = FAMILIES[family]
    if extra is None:  # GPT-2 names its sizes its own way
        config = config_class(vocab_size=vocab, n_embd=32, n_layer=3, n_head=4, n_positions=1024, bos_token_id=1,
                              eos_token_id=None)
    else:
        settings = {**_common(vocab), **extra}
        config = config_class(**{k: v for k, v in settings.items() if v is not None or k == "eos_token_id"})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    return model.requires_grad_(False)


def accept_path_without_residual(tree, target_probs, *, greedy, generator=None):
    """A planted mistake: rejected siblings keep their mass (the next sibling is tried against p itself)."""
    tokens = tree.tokens.tolist()
    path, node = [], -1
    while True:
        p = target_probs[node + 1]
        kept = None
        for c in tree.children(node):
            if float(torch.rand((), generator=generator)) < float(p[tokens[c]]):
                kept = c
                break
        if kept is None:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(kept)
        node = kept
        if not tree.children(node):
            return path, int(torch.multinomial(target_probs[node + 1], 1, generator=generator))
