"""The measuring instrument: the speculative loop, acceptance rules, metrics and report."""
