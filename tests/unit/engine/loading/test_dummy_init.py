"""`--load-format dummy` weights: an expert-parallel rank draws the same experts as one rank holding all."""

from __future__ import annotations

import torch

from engine.config.presets import preset
from engine.loading.loader import build_model, dummy_init


def test_expert_shards_draw_the_same_weights_as_the_whole_model():
    cfg = preset("tiny")
    full = build_model(cfg)
    dummy_init(full, seed=3)
    n = cfg.n_routed_experts // 2
    for rank in range(2):
        shard = build_model(cfg, expert_shard=(rank * n, n))
        dummy_init(shard, seed=3)
        whole = dict(full.named_parameters())
        checked = 0
        for name, p in shard.named_parameters():
            ref = whole[name]
            if name.endswith(("experts.w13", "experts.w2")):
                ref = ref[rank * n: (rank + 1) * n]
                checked += 1
            assert torch.equal(p, ref), name
        assert checked >= 2
    other = build_model(cfg)
    dummy_init(other, seed=4)
    assert not torch.equal(dict(other.named_parameters())["model.embed_tokens.weight"],
                           dict(full.named_parameters())["model.embed_tokens.weight"])
