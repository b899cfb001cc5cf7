"""vLLM's own code on the `dflash` export, on this CPU: run in a process of its own by tests/train/test_export.py
(vLLM sets process-wide state: platform, distributed groups, custom ops).

    python tests/train/vllm_dflash_worker.py VLLM_DIR TARGET_DIR EXPORT_DIR INPUTS OUT

What runs is vLLM's: `SpeculativeConfig` resolves the export's architecture for `"method": "dflash"`, the model
registry builds `DFlashQwen3ForCausalLM` and the target, the default loader reads both checkpoints, the proposer
shares the target's embedding and output head with the draft (the export carries neither), the draft's
`combine_hidden_states` fuses the target's features, `precompute_and_store_context_kv` projects them into each
layer's context keys and values, and the draft's forward and `compute_logits` run on the block. What is this CPU's
and not a GPU server's (tests/train/vllm_worker.py says why for the first two): vLLM's CPU platform with its custom
ops in their native PyTorch form; the attention kernel, here PyTorch's non-causal scaled-dot-product attention of
the block's q, k, v (as vLLM's layer computes them) over the context's keys and values (as vLLM's
`precompute_and_store_context_kv` computes them, handed to the cache update it calls); and vLLM's two compiled
kernels that precompute calls, RMSNorm and RoPE, given here by vLLM's own native RoPE (`RotaryEmbedding.
forward_static`) and RMSNorm's definition, with one weight per layer for the grouped k-norm as the kernel takes it.

INPUTS (safetensors): `features` (m, L*d), the target's states at the feature layers of context positions 0..m-1;
`block` (n+1,), the anchor and n mask ids, at positions m..m+n. OUT: `logits` (n+1, vocab) of the block, and
`architecture`, printed.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from vllm_worker import main, vllm_models  # noqa: E402


def _run(target_dir: str, export_dir: str, inputs: str, out: str) -> None:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file

    def rms_norm(out_, x, weight, eps):  # the compiled kernel's definition; a 2-d weight: one row per layer (dim 0)
        w = weight if weight.dim() == 1 else weight.view(weight.shape[0], *[1] * (x.dim() - 2), weight.shape[1])
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        out_.copy_((normed * w.float()).to(out_.dtype))

    def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, *rest):
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        q, k = RotaryEmbedding.forward_static(positions, query, key, head_size, head_size, cos_sin_cache, is_neox)
        query.copy_(q.view_as(query))
        if key is not None:
            key.copy_(k.view_as(key))

    class Context:
        """The cache update precompute calls, holding the layer's context keys and values."""

        def __init__(self) -> None:
            self.k = self.v = None

        def do_kv_cache_update(self, attn, k, v, kv_cache, slot_mapping) -> None:
            self.k, self.v = k, v  # (m, kv_heads, head_dim)

    class NonCausalSDPA(torch.nn.Module):
        """The attention kernel: the block's queries over the context's keys and values and the block's own."""

        def __init__(self, attn, context: Context) -> None:
            super().__init__()
            self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_size
            self.context = self.impl = context  # precompute writes through `impl` wherever it finds the layer
            self.kv_cache = None

        def forward(self, q, k, v, *args, **kwargs):
            T = q.shape[0]
            keys = torch.cat([self.context.k, k.view(T, self.kv_heads, self.head_dim)])
            values = torch.cat([self.context.v, v.view(T, self.kv_heads, self.head_dim)])
            q, keys, values = (t.transpose(0, 1)[None] for t in (q.view(T, self.heads, self.head_dim), keys, values))
            o = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)[0]
            return o.transpose(0, 1).reshape(T, self.heads * self.head_dim)

    x = load_file(inputs)
    features, block = x["features"], x["block"]
    with vllm_models(target_dir, export_dir, "dflash", len(block) - 1,
                     "vllm.v1.spec_decode.dflash.DFlashProposer") as (architecture, target, draft):
        from vllm import _custom_ops as ops  # after vllm_models has set the CPU platform

        ops.rms_norm, ops.rotary_embedding = rms_norm, rotary_embedding
        for layer in draft.model.layers:
            context = Context()
            layer.self_attn.attn.impl = context  # what precompute_and_store_context_kv writes through
            layer.self_attn.attn.kv_cache = None
            layer.self_attn.attn = NonCausalSDPA(layer.self_attn.attn, context)
        m = features.shape[0]
        with torch.no_grad():
            states = draft.combine_hidden_states(features)
            draft.precompute_and_store_context_kv(states, torch.arange(m), torch.arange(m))
            hidden = draft.model(block, torch.arange(m, m + len(block)))
            logits = draft.compute_logits(hidden)
    save_file({"logits": logits.contiguous()}, out)
    print(f"architecture: {architecture}")


if __name__ == "__main__":
    main(*sys.argv[1:], run=_run)
