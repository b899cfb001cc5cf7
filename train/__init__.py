"""Training: the recipes behind `python -m train` (draft LMs: `train.distill`; heads: `train.heads`), the data
they prepare from company traffic (`train.prepare`), and shipping what they train (`train.export`)."""
