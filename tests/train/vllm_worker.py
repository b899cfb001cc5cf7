"""vLLM's own code on the `vllm` EAGLE-1 export, on this CPU: run in a process of its own by
tests/train/test_export.py (vLLM sets process-wide state: platform, distributed groups, custom ops).

    python tests/train/vllm_worker.py VLLM_DIR TARGET_DIR EXPORT_DIR INPUTS OUT

VLLM_DIR is where `make install` put vLLM 0.33.0 without its CUDA dependencies. What runs is vLLM's:
`SpeculativeConfig` resolves the export's architecture for `"method": "eagle"`, the model registry builds
the draft model and the target, the default loader reads both checkpoints, the EAGLE proposer shares the
target's embedding and output head with the draft (the export carries neither), and the draft's forward
and `compute_logits` run on the export's inputs. Two things are this CPU's and not a GPU server's: the
platform is vLLM's CPU platform with its custom ops in their native PyTorch form (`custom_ops=["none"]`;
the CPU kernels live in the CPU build of vLLM), and the attention kernel, which needs a GPU or that build,
is PyTorch's causal scaled-dot-product attention on the q, k, v that vLLM's layer computes.

vLLM inspects a model class in a child process of its own (`python -m vllm.model_executor.models.registry`)
unless its cache under VLLM_CACHE_ROOT already holds the answer; the test points that cache at an empty
directory, so the child always runs, as on a machine that never ran vLLM. The child must import vLLM too,
with the venv's packages still first: see `_share_vllm_dir`.

INPUTS (safetensors): `ids` (T,) and `features` (T, d), the target's final-normed states. OUT: `hidden`
(T-1, d) and `logits` (T-1, vocab) of the draft's entries for tokens 1..T-1 on features 0..T-2, and
`architecture`, printed.
"""

import contextlib
import os
import sys
import tempfile


def _share_vllm_dir(vllm_dir: str, scratch: str) -> None:
    """Append VLLM_DIR to sys.path here and in every Python child this process starts. PYTHONPATH itself
    would put VLLM_DIR before the venv's site-packages, and vLLM's pinned packages would shadow the project's;
    a `sitecustomize` on PYTHONPATH runs after site-packages are on the path and appends it behind them."""
    sys.path.append(vllm_dir)
    with open(os.path.join(scratch, "sitecustomize.py"), "w") as f:
        f.write(f"import sys\nsys.path.append({vllm_dir!r})\n")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [scratch, os.environ.get("PYTHONPATH")]))


def main(vllm_dir: str, target_dir: str, export_dir: str, inputs: str, out: str, run=None) -> None:
    """`run` (this module's `_run` by default) with vLLM importable behind the venv's packages."""
    with tempfile.TemporaryDirectory() as scratch:
        _share_vllm_dir(vllm_dir, scratch)
        (run or _run)(target_dir, export_dir, inputs, out)


@contextlib.contextmanager
def vllm_models(target_dir: str, export_dir: str, method: str, k: int, proposer: str, **speculative):
    """vLLM on its CPU platform (custom ops native, no accelerator cache to free), one process group, and the target
    and the draft built by vLLM's config, registry and loader for `"method": method`; the draft shares the target's
    embedding and output head as vLLM's `proposer` class does (the export carries neither); `speculative`: more
    `SpeculativeConfig` settings (`parallel_drafting`). Yields (architecture vLLM resolved, target, draft) inside
    vLLM's current config."""
    import importlib

    import torch

    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms.current_platform = CpuPlatform()
    # The loader frees the accelerator's cache after loading; torch 2.13 raises without an accelerator.
    torch.accelerator.empty_cache = lambda: None
    from vllm.config import (CompilationConfig, DeviceConfig, ModelConfig, ParallelConfig, SpeculativeConfig,
                             VllmConfig, set_current_vllm_config)
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model

    model_config = ModelConfig(model=target_dir, dtype="float32", max_model_len=256, enforce_eager=True,
                               skip_tokenizer_init=True)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(model=export_dir, method=method, num_speculative_tokens=k,
                             target_model_config=model_config, target_parallel_config=parallel, **speculative)
    config = VllmConfig(model_config=model_config, speculative_config=spec, parallel_config=parallel,
                        device_config=DeviceConfig(device="cpu"),
                        compilation_config=CompilationConfig(custom_ops=["none"]))
    module, name = proposer.rsplit(".", 1)
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="tcp://127.0.0.1:0")
        initialize_model_parallel(1, 1)
        target = get_model(vllm_config=config)
        if method == "draft_model":  # a standalone draft: built from a config of its own, under a prefix of its own,
            # as vLLM's DraftModelProposer builds it (`_create_draft_vllm_config`, `_get_model`)
            from vllm.config.utils import replace

            draft = get_model(vllm_config=replace(config, model_config=spec.draft_model_config), prefix="draft_model")
        else:
            draft = get_model(vllm_config=config, model_config=spec.draft_model_config)
        cls = getattr(importlib.import_module(module), name)
        sharing = cls.__new__(cls)  # only its sharing of the target's weights is used
        sharing.model, sharing.vllm_config = draft, config
        sharing.use_local_argmax_reduction = spec.use_local_argmax_reduction
        sharing._maybe_share_embeddings(target)
        sharing._maybe_share_lm_head(target)
        yield spec.draft_model_config.hf_config.architectures[0], target, draft


def causal_attention(attn):
    """The attention kernel on the q, k, v vLLM's layer `attn` computes for one sequence (every position, causal):
    PyTorch's scaled-dot-product attention, in place of vLLM's, which needs a GPU or vLLM's CPU build."""
    import torch
    import torch.nn.functional as F

    class CausalSDPA(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_size

        def forward(self, q, k, v, *args, **kwargs):
            T = q.shape[0]
            q, k, v = (x.view(T, h, self.head_dim).transpose(0, 1)[None]
                       for x, h in ((q, self.heads), (k, self.kv_heads), (v, self.kv_heads)))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0]
            return o.transpose(0, 1).reshape(T, self.heads * self.head_dim)

    return CausalSDPA()


def _run(target_dir: str, export_dir: str, inputs: str, out: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    with vllm_models(target_dir, export_dir, "eagle", 3, "vllm.v1.spec_decode.eagle.EagleProposer") as (
            architecture, target, draft):
        for layer in draft.model.layers:
            layer.self_attn.attn = causal_attention(layer.self_attn.attn)
        x = load_file(inputs)
        ids, features = x["ids"], x["features"]
        with torch.no_grad():
            hidden, _ = draft(ids[1:], torch.arange(len(ids) - 1), features[:-1])
            logits = draft.compute_logits(hidden)
    save_file({"hidden": hidden.contiguous(), "logits": logits.contiguous()}, out)
    print(f"architecture: {architecture}")


if __name__ == "__main__":
    main(*sys.argv[1:])
