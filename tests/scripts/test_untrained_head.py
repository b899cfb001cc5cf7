"""scripts/untrained_head.py: a head of the asked kind and shape with its starting weights, saved as training saves
one: draftsmith's loop drafts with it losslessly, its guesses near chance."""

from __future__ import annotations

import json

import pytest
import torch

from drafters.registry import load_head
from drafters.sampling import Sampling
from eval.run import build_drafter, load_target
from eval.speculative import autoregressive_generate, speculative_generate
from helpers import load_script

TARGET = "toyworld://tiny_deep/target"


@pytest.mark.parametrize("kind,settings", [("eagle", ["draft_vocab_size=100", "intermediate_size=16"]),
                                           ("dflash", ["block_size=4", "num_layers=1"])])
def test_an_untrained_head_has_the_shape_asked_and_drafts_losslessly(tiny_world, tmp_path, kind, settings):
    out = tmp_path / kind
    load_script("untrained_head").main([TARGET, str(out), "--kind", kind,
                                        *[a for s in settings for a in ("--setting", s)]])
    config = json.loads((out / "config.json").read_text())
    for key, value in (s.split("=") for s in settings):
        assert config[key] == int(value), key
    target, tok = load_target(TARGET, device=torch.device("cpu"))
    if kind == "eagle":  # the target's first ids and its end of sequence
        head = load_head(out, target)
        assert int(head.t2d.sum()) == 100 and bool(head.t2d[tok.eos_token_id]) and bool(head.t2d[:99].all())
    drafter = build_drafter({"name": kind, "kind": "head", "path": str(out)}, target=target, tokenizer=tok)
    prompt = torch.randint(0, target.config.vocab_size, (6,), generator=torch.Generator().manual_seed(0))
    plain = autoregressive_generate(target, prompt, sampling=Sampling(), max_new_tokens=24)
    out = speculative_generate(target, drafter, prompt, k=3, sampling=Sampling(), max_new_tokens=24)
    assert out.tokens == plain.tokens
    assert sum(r.accepted for r in out.rounds) < len(out.rounds)  # untrained: most rounds keep nothing


def test_a_setting_must_be_key_equals_value(tiny_world, tmp_path):
    with pytest.raises(SystemExit):
        load_script("untrained_head").main([TARGET, str(tmp_path / "h"), "--setting", "draft_vocab_size"])
