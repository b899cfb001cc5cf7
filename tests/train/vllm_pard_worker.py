"""vLLM's own code on the `hf` export of a PARD draft, on this CPU: run in a process of its own by
tests/train/test_export.py (vLLM sets process-wide state: platform, distributed groups, custom ops).

    python tests/train/vllm_pard_worker.py VLLM_DIR TARGET_DIR EXPORT_DIR INPUTS OUT

What runs is vLLM's: `SpeculativeConfig` with `"method": "draft_model"` and `parallel_drafting` (how vLLM serves
PARD), its check that the draft's vocabulary is the target's, the model registry and default loader building the
draft from the export (a draft model shares nothing with the target), the proposer's choice of the mask token
from the draft's config (`_init_parallel_drafting_params`, which reads `pard_token` after any `mask_token_id`), and
the draft's forward and `compute_logits` on the proposer's slot layout for one request: the committed tokens (the
last one the bonus token), then k - 1 copies of the mask token at the next positions, causal. What is this CPU's and
not a GPU server's (tests/train/vllm_worker.py says why): the CPU platform with native custom ops, and the attention
kernel, PyTorch's causal scaled-dot-product attention on vLLM's q, k, v. The slot layout is written out here; on a
GPU vLLM's Triton kernel `copy_and_expand_eagle_inputs_kernel` builds it.

INPUTS (safetensors): `ids` (T,) and `k` (1,). OUT: `logits` (k, vocab) of the k drafting slots and `mask_token`,
and `architecture`, printed.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from vllm_worker import causal_attention, main, vllm_models  # noqa: E402


def _run(target_dir: str, export_dir: str, inputs: str, out: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    x = load_file(inputs)
    ids, k = x["ids"], int(x["k"][0])
    with vllm_models(target_dir, export_dir, "draft_model", k, "vllm.v1.spec_decode.draft_model.DraftModelProposer",
                     parallel_drafting=True) as (architecture, target, draft):
        from vllm.config import get_current_vllm_config
        from vllm.v1.spec_decode.draft_model import DraftModelProposer

        spec = get_current_vllm_config().speculative_config
        spec.verify_equal_vocab_size_if_draft_model()
        proposer = DraftModelProposer.__new__(DraftModelProposer)  # only its choice of the mask token is used
        proposer.draft_model_config, proposer.pass_hidden_states_to_model = spec.draft_model_config, False
        proposer._init_parallel_drafting_params()
        mask = proposer.parallel_drafting_token_id
        for layer in draft.model.layers:
            layer.self_attn.attn = causal_attention(layer.self_attn.attn)
        T = len(ids)
        tokens = torch.cat([ids, torch.full((k - 1,), mask, dtype=ids.dtype)])
        with torch.no_grad():
            hidden = draft(tokens, torch.arange(T + k - 1))
            logits = draft.compute_logits(hidden[T - 1:])
    save_file({"logits": logits.contiguous(), "mask_token": torch.tensor([mask])}, out)
    print(f"architecture: {architecture}")


if __name__ == "__main__":
    main(*sys.argv[1:], run=_run)
