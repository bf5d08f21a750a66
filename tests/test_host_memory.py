"""Host memory that goes back to the OS: page-dropping buffers and heap trimming."""

import torch

import bunsan
from bunsan.zero.host_buffer import HostBuffer, HostPool
from parity import batches, optimizer_config, tiny_model


def test_host_buffer_release_drops_pages_and_reads_zeros():
    buf = HostBuffer(1 << 18, torch.float32)            # 1 MiB
    assert buf.resident_bytes() == 0                    # nothing touched yet
    buf.tensor.fill_(3.0)
    assert buf.resident_bytes() >= 1 << 20
    view = buf.tensor[10:20]                            # views (as autograd saves them) stay valid
    buf.release()
    assert buf.resident_bytes() == 0 and float(view.abs().sum()) == 0.0
    buf.tensor[10:20] = 1.0
    assert float(view.sum()) == 10.0


def test_host_pool_reuses_buffers_zeroed():
    pool = HostPool()
    a = pool.take(1000, torch.bfloat16)
    a.fill_(1.0)
    pool.give(a)
    b = pool.take(1000, torch.bfloat16)
    assert b.data_ptr() == a.data_ptr() and float(b.float().abs().sum()) == 0.0
    assert pool.take(1000, torch.bfloat16).data_ptr() != b.data_ptr()


def test_host_pool_keeps_buffers_resident_until_released():
    pool = HostPool()
    a = pool.take(1 << 18, torch.float32)
    a.fill_(2.0)
    assert pool.reuse(1 << 18, torch.float32) is None          # nothing kept yet
    pool.give(a, keep=True)
    b = pool.reuse(1 << 18, torch.float32)
    assert b.data_ptr() == a.data_ptr() and float(b[0]) == 2.0  # the same pages, contents as left
    pool.give(b, keep=True)
    pool.release_kept()
    assert pool.reuse(1 << 18, torch.float32) is None
    c = pool.take(1 << 18, torch.float32)
    assert c.data_ptr() == a.data_ptr() and float(c.abs().sum()) == 0.0


def _trims_per_step(rank, world, stage, trim):
    import bunsan.zero.reduce as red
    import bunsan.zero.stage3 as s3
    calls = []
    s3.trim_heap = red.trim_heap = lambda: calls.append(1)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": optimizer_config("sgd"),
           "zero_optimization": {"stage": stage, "trim_host_memory": trim, "reduce_bucket_size": 20_000}}
    engine = bunsan.initialize(tiny_model(), cfg)
    batch = batches(1, 2 * world, 8)[0]
    engine.train_batch({k: v[2 * rank:2 * rank + 2] for k, v in batch.items()})
    return len(calls), len(engine.strategy.layout.buckets)


def test_heap_is_trimmed_in_stage2_backward_and_around_stage3_units_unless_switched_off(pools):
    """zero_optimization.trim_host_memory: every 4 reduced buckets at stage 2 (not after its step, where it
    cost the next forward page faults without lowering the peak), every 4 released units and after the step
    at stage 3; never at stage 1, whose full gradient buffer stays through backward (trims there only
    returned activation pages the next forward faulted back in)."""
    for calls, buckets in pools.run(2, _trims_per_step, 2, 2, True):
        assert buckets >= 8 and calls == buckets // 4
    for stage in (1, 2):
        assert [c for c, _ in pools.run(2, _trims_per_step, 2, stage, False)] == [0, 0]
    assert [c for c, _ in pools.run(2, _trims_per_step, 2, 1, True)] == [0, 0]
    n = len(tiny_model().layers)
    expected = 1 + (2 * n + 1) // 4          # each block released after forward and backward, the root once
    assert all(c >= expected for c, _ in pools.run(2, _trims_per_step, 2, 3, True))
    assert [c for c, _ in pools.run(2, _trims_per_step, 2, 3, False)] == [0, 0]


def _grad_shard_between_steps(rank, world, stage):
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "optimizer": optimizer_config("adamw")}
    engine = bunsan.initialize(tiny_model(), cfg)
    batch = batches(1, 2 * world, 8)[0]
    engine.train_batch({k: v[2 * rank:2 * rank + 2] for k, v in batch.items()})
    host = engine.strategy.opt._grad_host
    return engine.strategy.opt.grad is None, host.resident_bytes() if host is not None else -1


def test_zero_gradient_shard_is_freed_between_steps(pools):
    """Stages 1-3 hold the fp32 gradient shard only from the first reduce to the step."""
    for stage in (1, 2, 3):
        for dropped, resident in pools.run(2, _grad_shard_between_steps, 2, stage):
            assert dropped and resident == 0


def _child_peak(queue):
    from bunsan.memory.measure import peak_rss_bytes, reset_peak_memory
    reset_peak_memory()
    queue.put(peak_rss_bytes())


def test_a_spawned_workers_peak_is_its_own_not_its_parents():
    """Linux carries ru_maxrss across exec: read by getrusage, every spawned rank's peak started at the
    launching process's (the test suite's 0.6 GiB became the pipeline layout's measured peak)."""
    import multiprocessing as mp
    parent = bytearray(600 * 2 ** 20)
    parent[::4096] = b"\1" * len(parent[::4096])       # resident in the parent
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_peak, args=(queue,))
    child.start()
    peak = queue.get(timeout=120)
    child.join()
    del parent
    assert 0 < peak < 500 * 2 ** 20, f"the child's peak {peak / 2 ** 20:.0f} MiB includes its parent's 600 MiB"
