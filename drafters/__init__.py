"""Drafters: one per file, all speaking the protocol in `drafters.base`."""
