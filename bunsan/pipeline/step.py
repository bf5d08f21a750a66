"""The pipelined part of an optimizer step: the schedule, then the gradient reductions (the engine steps).

The engine's data-parallel strategy (ZeRO 0 or 1) is told to accumulate through
the whole schedule and reduce once after it: a pipeline's backward comes in
pieces (one per micro-batch and chunk), so bucket hooks cannot tell when a
gradient is final. Before that reduction, weights tied across stages (a Llama's
embedding and head) sum their gradients over the stages that hold them.
"""

from __future__ import annotations

import torch


def _inputs(engine, lm: bool, div: float):
    """(first-stage input, loss and reported loss, sequence length) for dict LM batches or (x..., y) tuples."""
    scale = engine.scaler.scale if engine.scaler else 1.0

    if lm:
        def loss_of(out, mb):
            total = engine._lm_loss_sum(out, mb["labels"])
            return (total / div) * scale, total
        return (lambda mb: mb["input_ids"]), loss_of, (lambda mb: mb["input_ids"].shape[1])

    def loss_of_fn(out, mb):
        loss = engine.loss_fn(out, mb[-1])
        return (loss / div) * scale, loss
    return (lambda mb: mb[0]), loss_of_fn, (lambda mb: 0)


def run_schedule(engine, micro: list, lm: bool, div) -> torch.Tensor:
    """Run the schedule over `micro` and reduce the gradients; this data-parallel rank's summed loss, a device
    tensor on every stage (the engine then steps)."""
    pipe, mesh, comm = engine.pipe, engine.mesh, engine.comm
    first_input, loss_of, seq_len = _inputs(engine, lm, div)
    if engine.loss_fn is None and not lm:
        raise ValueError("pass loss_fn to bunsan.initialize for batches that are not language-model dicts")
    # The stages start together: the timeline's clocks align here, and under NCCL this collective is what the
    # group's first batched send/receive needs before it.
    comm.barrier(mesh.pp_group)
    pipe.recorder.begin()
    engine.dp.begin_backward(sync=False)
    engine.phase = f"pipeline schedule ({pipe.schedule}, {len(micro)} micro-batches)"   # for the doctor
    total = pipe.runner.train(micro, first_input, loss_of, seq_len)
    engine.phase = "gradient reduction after the pipeline schedule"
    with pipe.recorder.record("sync", -1, 0):
        for name, group in pipe.tied:
            grad = engine.module.get_parameter(name).grad
            if grad is not None and group is not None:
                comm.all_reduce(grad, group)
        engine.dp.begin_backward(sync=True)     # every bucket reduced now, in order
        engine.dp.end_backward(sync=True)
    # The loss lives on the last stage: hand it to every stage (the data-parallel sum is the engine's).
    comm.broadcast(total, pipe.p - 1, mesh.pp_group)
    return total


@torch.no_grad()
def eval_batch(engine, batch) -> float:
    """Mean loss of a per-rank batch run forward through the stages, cut into up to grad_accum micro-batches."""
    pipe, mesh, comm = engine.pipe, engine.mesh, engine.comm
    lm = isinstance(batch, dict) and engine.loss_fn is None
    tensors = {k: v.to(engine.device) for k, v in batch.items()} if isinstance(batch, dict) \
        else tuple(t.to(engine.device) for t in batch)
    rows = next(iter(tensors.values() if isinstance(tensors, dict) else tensors)).shape[0]
    pieces = max(1, min(rows, engine.grad_accum))
    if isinstance(tensors, dict):
        chunks = {k: v.chunk(pieces) for k, v in tensors.items()}
        micro = [{k: c[i] for k, c in chunks.items()} for i in range(len(next(iter(chunks.values()))))]
    else:
        chunks = [t.chunk(pieces) for t in tensors]
        micro = [tuple(c[i] for c in chunks) for i in range(len(chunks[0]))]
    first_input, loss_of, seq_len = _inputs(engine, lm, 1.0)
    if lm:
        count = (tensors["labels"] != -100).sum().double()
    else:   # loss_fn gives a mean per micro-batch: weight it by its rows
        count, mean_of = torch.full((), float(rows), dtype=torch.float64, device=engine.device), loss_of
        loss_of = lambda out, mb: (None, mean_of(out, mb)[1] * mb[0].shape[0])   # noqa: E731
    total = pipe.runner.evaluate(micro, first_input, loss_of, seq_len)
    comm.broadcast(total, pipe.p - 1, mesh.pp_group)
    sums = torch.cat([total, count.reshape(1)])
    comm.all_reduce(sums, mesh.dp_group)
    s, n = sums.tolist()   # host: evaluation returns a number
    return s / n
