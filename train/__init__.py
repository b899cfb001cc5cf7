"""Training: company traffic in (`train.data`), the built-in toy world (`train.toyworld`)."""
