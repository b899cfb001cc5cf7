"""vLLM's own code on the `speculators` export of a P-EAGLE head, on this CPU: run in a process of its own by
tests/train/test_export.py (vLLM sets process-wide state: platform, distributed groups, custom ops).

    python tests/train/vllm_peagle_worker.py VLLM_DIR TARGET_DIR EXPORT_DIR INPUTS OUT

What runs is vLLM's: `SpeculativeConfig` with `"method": "eagle3"` and `parallel_drafting` (how a local target is
served P-EAGLE) reads the speculators config (`peagle` becomes its Llama EAGLE-3 with `pard_token`), the model
registry builds the draft and the target, the default loader reads both checkpoints and takes `mask_hidden` into
its buffer, the proposer shares the target's output head with the draft, the mask slots' hidden state is
`combine_hidden_states(mask_hidden)` as the proposer computes it once at load, and the draft's forward and
`compute_logits` run on the proposer's slot layout for one request: the entries of tokens 1..T-1 on features
0..T-2 (the last one the bonus slot), then k - 1 slots of `pard_token` at the next positions, causal. What is this
CPU's and not a GPU server's (tests/train/vllm_worker.py says why): the CPU platform with native custom ops, and
the attention kernel, PyTorch's causal scaled-dot-product attention on vLLM's q, k, v. The slot layout itself is
written out here; on a GPU vLLM's Triton kernel `copy_and_expand_eagle_inputs_kernel` builds it.

INPUTS (safetensors): `ids` (T,), `features` (T, L*d) and `k` (1,). OUT: `logits` (k, vocab) of the k drafting
slots, `pard_token` and `mask_hidden`, and `architecture`, printed.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from vllm_worker import causal_attention, main, vllm_models  # noqa: E402


def _run(target_dir: str, export_dir: str, inputs: str, out: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    x = load_file(inputs)
    ids, features, k = x["ids"], x["features"], int(x["k"][0])
    with vllm_models(target_dir, export_dir, "eagle3", k, "vllm.v1.spec_decode.eagle.EagleProposer",
                     parallel_drafting=True) as (architecture, target, draft):
        from vllm.config import get_current_vllm_config

        pard = get_current_vllm_config().speculative_config.draft_model_config.hf_config.pard_token
        for layer in draft.model.layers:
            layer.self_attn.attn = causal_attention(layer.self_attn.attn)
        T = len(ids)
        with torch.no_grad():
            real = draft.combine_hidden_states(features[:-1])
            mask = draft.combine_hidden_states(draft.mask_hidden.view(-1))  # the proposer's, once at load
            tokens = torch.cat([ids[1:], torch.full((k - 1,), pard, dtype=ids.dtype)])
            hidden = torch.cat([real, mask.expand(k - 1, -1)])
            out_states, _ = draft(tokens, torch.arange(T - 1 + k - 1), hidden)
            logits = draft.compute_logits(out_states[T - 2:])
    save_file({"logits": logits.contiguous(), "pard_token": torch.tensor([pard]),
               "mask_hidden": draft.mask_hidden.contiguous()}, out)
    print(f"architecture: {architecture}")


if __name__ == "__main__":
    main(*sys.argv[1:], run=_run)
