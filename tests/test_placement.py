"""Placing a model's blocks over devices, CPU and disk: a pure function, checked with made-up devices."""

import pytest

from bunsan.inference import Block, place, summary

MB = 1024 ** 2


def blocks(n, size=10 * MB):
    return [Block(f"layers.{i}", size) for i in range(n)]


def test_sequential_fills_devices_in_order():
    m = place(blocks(4), {0: 25 * MB, 1: 25 * MB}, "sequential")
    assert [m[f"layers.{i}"] for i in range(4)] == [0, 0, 1, 1]


def test_balanced_spreads_the_model():
    m = place(blocks(4), {0: 100 * MB, 1: 100 * MB}, "auto")
    assert [m[f"layers.{i}"] for i in range(4)] == [0, 0, 1, 1]
    m = place(blocks(4), {0: 100 * MB, 1: 100 * MB}, "sequential")
    assert set(m.values()) == {0}


def test_spills_to_cpu_then_disk():
    m = place(blocks(4), {0: 20 * MB, "cpu": 15 * MB}, "sequential")
    assert [m[f"layers.{i}"] for i in range(4)] == [0, 0, "cpu", "disk"]
    assert place(blocks(2), {0: 5 * MB}) == {"layers.0": "disk", "layers.1": "disk"}


def test_headroom_is_kept_free():
    m = place(blocks(3), {0: 30 * MB, 1: 30 * MB}, "sequential", headroom={0: 15 * MB, 1: 0})
    assert [m[f"layers.{i}"] for i in range(3)] == [0, 1, 1]


def test_a_block_is_never_split():
    big = [Block("a", 10 * MB), Block("b", 40 * MB), Block("c", 10 * MB)]
    m = place(big, {0: 30 * MB, 1: 45 * MB}, "sequential")
    assert m == {"a": 0, "b": 1, "c": "disk"}
    assert all(v <= cap for v, cap in ((summary(big, m).get(d, 0), c) for d, c in ((0, 30 * MB), (1, 45 * MB))))


def test_tied_weights_share_a_device():
    model = [Block("embed_tokens", 10 * MB, tied="emb")] + blocks(4) + [Block("norm", 1),
                                                                     Block("lm_head", 10 * MB, tied="emb")]
    m = place(model, {0: 35 * MB, 1: 35 * MB}, "sequential")
    assert m["embed_tokens"] == m["lm_head"] == 0
    assert [m[f"layers.{i}"] for i in range(4)] == [0, 1, 1, 1]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="'fastest' is not a strategy"):
        place(blocks(1), {0: MB}, "fastest")
    with pytest.raises(ValueError, match="max_memory keys must be"):
        place(blocks(1), {"gpu0": MB})
    with pytest.raises(ValueError, match="device 0: max_memory 0.00 GiB is smaller than"):
        place(blocks(1), {0: MB}, headroom={0: 2 * MB})


def test_a_llama_is_placed_whole():
    from bunsan.estimator import load_shape
    shape = load_shape("7b")
    per = {}
    for name, p in shape.module.named_parameters():
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else name.rpartition(".")[0]
        per[key] = per.get(key, 0) + p.numel() * 2
    model = [Block(k, v) for k, v in per.items()]
    m = place(model, {0: 8 * 1024 * MB, 1: 8 * 1024 * MB, "cpu": 64 * 1024 * MB})   # 12.6 GiB in bf16: fits
    sums = summary(model, m)
    assert set(sums) == {0, 1} and abs(sums[0] - sums[1]) < 0.1 * sums[0]        # balanced
    m = place(model, {0: 5 * 1024 * MB, 1: 5 * 1024 * MB, "cpu": 64 * 1024 * MB})
    sums = summary(model, m)
    assert sum(sums.values()) == sum(per.values()) and sums[0] <= 5 * 1024 * MB and sums[1] <= 5 * 1024 * MB
    assert set(sums) == {0, 1, "cpu"}
