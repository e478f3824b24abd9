"""Sizes of the hot buffer and the layer groups that share one plan.

Hot buffer of one request, per layer (rows; all layers of a block-major device block at once):

    [ LRU rows: cached host rows of past positions ........ | newest rows | alignment ]
      0 .. lru_rows-1                                         lru_rows .. lru_rows + max_new_rows - 1

`lru_rows` = max(device_buffer_size, max_new_rows * topk): a step's rows (the decode row, or 1 + drafts
verify rows) select at most max_new_rows * topk distinct positions, so their union always fits and a plan
never needs to ask the host how many misses there were. The newest rows of a step are written straight
into the reserved rows (and backed up to the host), so the attention of that step never waits for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv.cache import KVCacheSpec


@dataclass(frozen=True)
class HotLayout:
    topk: int
    lru_rows: int
    max_new_rows: int  # rows one request computes in a decode step: 1 + drafts
    block_size: int = 64

    @classmethod
    def create(cls, topk: int, device_buffer_size: int | None, num_spec_tokens: int,
               block_size: int = 64) -> HotLayout:
        max_new = 1 + num_spec_tokens
        lru = max(device_buffer_size or 2 * topk, max_new * topk)
        return cls(topk=topk, lru_rows=lru, max_new_rows=max_new, block_size=block_size)

    @property
    def rows(self) -> int:
        """round_up(lru_rows + max_new_rows, block_size)."""
        n = self.lru_rows + self.max_new_rows
        return -(-n // self.block_size) * self.block_size

    @property
    def num_blocks(self) -> int:
        return self.rows // self.block_size


@dataclass(frozen=True)
class LayerGroups:
    """Model layers grouped by the full indexer layer whose top-k they use (IndexShare).

    Group g = index cache layer g (the MTP layer has its own indexer, so its own group)."""

    group_of: dict[int, int]  # model layer id -> group
    layers: tuple[tuple[int, ...], ...]  # group -> model layer ids (leader first)

    @classmethod
    def from_spec(cls, spec: KVCacheSpec) -> LayerGroups:
        group_of: dict[int, int] = {}
        layers: list[list[int]] = [[] for _ in range(spec.num_index_layers)]
        g = -1
        for layer in range(len(spec.mla_layer_of)):
            if spec.index_layer_of[layer] >= 0:
                g = spec.index_layer_of[layer]
            if g < 0:
                raise ValueError(f"layer {layer} shares a top-k but no full indexer layer comes before it")
            group_of[layer] = g
            layers[g].append(layer)
        return cls(group_of=group_of, layers=tuple(tuple(x) for x in layers))

    def is_leader(self, layer: int) -> bool:
        return self.layers[self.group_of[layer]][0] == layer

    @property
    def num_groups(self) -> int:
        return len(self.layers)
