"""Cutting a model into pipeline stages: which layers each stage holds (no processes needed)."""

from __future__ import annotations

import itertools

import pytest
import torch.nn as nn

from bunsan.pipeline.partition import StageModule, model_layers, partition
from parity import tiny_model


def test_llama_layers_are_embedding_blocks_and_head():
    layers = model_layers(tiny_model())
    assert [layer.paths for layer in layers] == [("embed_tokens",), ("layers.0",), ("layers.1",), ("layers.2",),
                                                 ("layers.3",), ("norm", "lm_head")]
    assert layers[0].cost == 0 and layers[0].params == 256 * 128   # a lookup does no matmul
    assert [layer.repeated for layer in layers] == [False, True, True, True, True, False]


def test_uniform_divides_blocks_and_keeps_embedding_first_and_head_last():
    layers = model_layers(tiny_model(num_hidden_layers=5))
    assert partition(layers, 2, "uniform") == [[0, 1, 2, 3], [4, 5, 6]]   # blocks 3 + 2, extra one first
    assert partition(layers, 5, "uniform") == [[0, 1], [2], [3], [4], [5, 6]]


def _best_max(weights, parts):
    """Brute force: the smallest heaviest run over all contiguous cuts."""
    n, best = len(weights), float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("method", ["parameters", "balanced"])
@pytest.mark.parametrize("parts", [2, 3, 4])
def test_weighted_partitions_are_contiguous_and_optimal(method, parts):
    layers = model_layers(tiny_model(num_hidden_layers=6, vocab_size=4096))   # a heavy embedding and head
    chunks = partition(layers, parts, method)
    assert [i for c in chunks for i in c] == list(range(len(layers))) and all(chunks)
    w = [layer.params if method == "parameters" else layer.cost for layer in layers]
    w = [max(x, 1) for x in w]   # partition() weighs a free layer as 1 so that no stage is left empty
    assert max(sum(w[i] for i in c) for c in chunks) == _best_max(w, parts)


def test_sequential_models_and_stage_modules_keep_their_names():
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    layers = model_layers(seq)
    chunks = partition(layers, 2, "uniform")
    assert chunks == [[0, 1], [2]]
    stage = StageModule(seq, [[layers[i] for i in chunks[1]]], [1], 2)
    assert [n for n, _ in stage.named_parameters()] == ["2.weight", "2.bias"]


def test_bad_partitions_say_what_to_change():
    layers = model_layers(tiny_model())
    with pytest.raises(ValueError, match="fewer than the 7 stages"):
        partition(layers, 7, "uniform")
    with pytest.raises(ValueError, match="one transformer block per stage"):
        partition(layers, 5, "uniform")
    with pytest.raises(ValueError, match="unknown; use one of"):
        partition(layers, 2, "greedy")
    with pytest.raises(ValueError, match="nn.Sequential"):
        model_layers(nn.Linear(2, 2))
