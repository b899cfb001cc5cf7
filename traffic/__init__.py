"""Company traffic, below evaluation and training, which both read it: the formats it is logged in
(`traffic.formats`), the checked records and the prompts and training examples made of them
(`traffic.records`), and the built-in toy world that stands in for a hub and a user's logs
(`traffic.toyworld`; it trains its models resumably with `traffic.checkpoint`, which `python -m train` uses too).
"""
