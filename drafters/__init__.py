"""Drafters: one per file, all speaking the protocol in `drafters.base`, and what they share with the loop that
drives them: how tokens are chosen (`drafters.sampling`) and a Hugging Face model's KV cache (`drafters.hf_cache`)."""
