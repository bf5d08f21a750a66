"""Device discipline of the training step, checked on the CPU.

On a GPU everything the step touches must live on the engine's device: NCCL rejects host tensors, an in-place op
with a host output and a device input raises, and every read of a device value on the host (`.item()`,
`.tolist()`, `float(t)`) stalls the host until the GPU catches up. None of that shows on a CPU, where host and
device are one. So the modules on the step's path are read as source:

- a tensor factory (`torch.zeros`, `torch.tensor`, ...) must say where it builds (`device=`), and
  `torch.tensor(data, device=...)` is marked: it copies host data to the device synchronously;
- a host read (`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `float(...)`/`int(...)`/`bool(...)` of a tensor
  expression) must be marked `# host: <why>` on its line: the step has one such point, at the optimizer
  boundary, and everything else that reads the host is set-up, a checkpoint, or a host-only transport;
- a model's own parameters and buffers, made where its constructor runs, are marked `# default device:`.

The host-only transports (comm/shm.py, comm/mailbox.py, comm/exchange.py, zero/host_buffer.py, zero/swap.py) are left out: they run
only on CPU tensors by construction (comm/collectives.py hands them host copies).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "bunsan"

STEP_MODULES = [
    "engine/engine.py", "comm/collectives.py", "comm/work.py", "zero/strategy.py", "zero/stage0.py",
    "zero/buckets.py", "engine/precision.py", "transforms/checkpointing.py", "models/loss.py", "optim/lrs.py",
    "comm/onebit.py",
    "pipeline/runtime.py", "pipeline/forward_backward.py", "engine/batch.py",
    "zero/stage12.py", "zero/stage3.py", "zero/reduce.py", "zero/optimizer.py", "zero/frozen.py",
    "zero/unit_buffer.py", "zero/units.py", "zero/offload.py", "zero/adafactor.py",
    "tensor_parallel/ops.py", "tensor_parallel/layers.py", "tensor_parallel/loss.py",
    "models/llama.py", "models/saving.py", "transforms/selective.py", "transforms/offload.py",
    "pipeline/partition.py", "deepspeed/engine.py", "comm/along.py", "context_parallel/attention.py",
    "context_parallel/shard.py", "zero/schedule_grads.py", "zero/stage3_pipeline.py", "models/packing.py",
    "engine/preference.py", "engine/media.py", "engine/ds_loop.py",
    "models/moe.py", "models/moe_router.py", "models/moe_dispatch.py", "models/moe_experts.py",
    "expert_parallel/dispatch.py", "expert_parallel/__init__.py", "engine/moe_step.py", "zero/experts.py",
    "expert_parallel/sliced.py", "expert_parallel/hf_experts.py", "tensor_parallel/hf_moe.py",
]

FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
             "linspace", "eye"}
HOST_METHODS = {"item", "tolist", "cpu", "numpy"}
HOST_CASTS = {"float", "int", "bool"}
MARKS = ("# host:", "# default device:")   # a host read or host tensor on purpose; a module built where its
                                          # caller builds it (model construction under torch.device(...))


def _is_torch_factory(call: ast.Call) -> bool:
    f = call.func
    return isinstance(f, ast.Attribute) and f.attr in FACTORIES and isinstance(f.value, ast.Name) \
        and f.value.id == "torch"


def _tensor_expression(node: ast.AST) -> bool:
    """Something a cast could read off a device: an expression with a method call or a subscript in it
    (`t.sum()`, `x[0]`, `norm(g) ** 2`), not a name or a literal (`float(x)` of a Python number is fine)."""
    def tensorish(n) -> bool:
        if isinstance(n, ast.Subscript):      # x[0] may be a tensor; cfg["lr"] (a string key) is a mapping's
            return not (isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str))
        return isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    return any(tensorish(n) for n in ast.walk(node))


def violations(path: Path) -> list[str]:
    source = path.read_text()
    lines = source.splitlines()
    out = []

    def marked(node) -> bool:
        span = range(node.lineno, getattr(node, "end_lineno", node.lineno) + 1)
        return any(m in lines[i - 1] for m in MARKS for i in span)

    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or marked(node):
            continue
        if _is_torch_factory(node) and not any(k.arg == "device" for k in node.keywords):
            out.append((node.lineno, f"torch.{node.func.attr}(...) without device="))
        elif _is_torch_factory(node) and node.func.attr in ("tensor", "as_tensor"):
            out.append((node.lineno, f"torch.{node.func.attr}(..., device=) copies host data to the device, "
                                     "and waits for the stream to do it"))
        elif isinstance(node.func, ast.Attribute) and node.func.attr in HOST_METHODS and not node.args:
            out.append((node.lineno, f".{node.func.attr}() reads a tensor on the host"))
        elif isinstance(node.func, ast.Name) and node.func.id in HOST_CASTS and len(node.args) == 1 \
                and _tensor_expression(node.args[0]):
            out.append((node.lineno, f"{node.func.id}(...) of a tensor expression reads it on the host"))
    where = path.relative_to(ROOT.parent)
    return [f"{where}:{line}: {what}" for line, what in sorted(out)]


@pytest.mark.parametrize("module", STEP_MODULES)
def test_the_step_builds_on_the_device_and_reads_the_host_only_where_marked(module):
    path = ROOT / module
    if not path.exists():
        pytest.skip(f"{module} does not exist")
    found = violations(path)
    assert not found, ("tensors built without a device, or host reads not marked '# host: why' (see this "
                       "test's docstring):\n" + "\n".join(found))


def test_the_lint_catches_what_it_is_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n"
                   "total = torch.zeros((), dtype=torch.float64)\n"       # a factory without device=
                   "n = int((labels != -100).sum())\n"                     # a sync per micro-batch
                   "v = loss.item()\n"
                   "ok = torch.zeros(3, device=dev)\n"
                   "fine = loss.item()  # host: the one read at the optimizer boundary\n"
                   "x = float(3)\n")
    found = [v.split(": ", 1)[1] for v in violations_under(bad, tmp_path)]
    assert found == ["torch.zeros(...) without device=", "int(...) of a tensor expression reads it on the host",
                     ".item() reads a tensor on the host"]


def violations_under(path: Path, root: Path) -> list[str]:
    global ROOT
    old, ROOT = ROOT, root / "pkg"
    try:
        return violations(path)
    finally:
        ROOT = old


# -- host reads per step, counted on the CPU ---------------------------------------------------------------

def _host_reads_per_step(rank, layers: int, stage: int) -> int:
    """Reads of tensor values by the host during one optimizer step (after a first, warm-up step): item(),
    float(), bool() of a tensor (aten._local_scalar_dense) and tolist(). torch's optimizers read their step
    counters, which live on the host whatever the device (not counted)."""
    import traceback

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import bunsan
    from parity import batches, tiny_model

    class Count(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default and not any(
                    "/torch/optim/" in f.filename for f in traceback.extract_stack()):
                Count.reads += 1
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist

    def counted_tolist(t):
        Count.reads += 1
        return tolist(t)

    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000,
                                 "stage3_param_persistence_threshold": 0}}
    engine = bunsan.initialize(tiny_model(num_hidden_layers=layers), cfg)
    first, second = batches(2, 8)
    engine.train_batch(first)
    torch.Tensor.tolist = counted_tolist
    try:
        with Count():
            engine.train_batch(second)
    finally:
        torch.Tensor.tolist = tolist
    return Count.reads


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_host_reads_per_step_do_not_grow_with_layers_or_buckets(pools, stage):
    """One read at the optimizer boundary (norm, loss and token count together), plus on the CPU the loss's
    label check per micro-batch (bunsan/models/loss.py: free on the host, skipped on a GPU): nothing per layer,
    bucket or unit. On a GPU, scripts/gpu-check counts the real synchronisations."""
    (shallow,), (deep,) = pools.run(1, _host_reads_per_step, 2, stage), pools.run(1, _host_reads_per_step, 8, stage)
    assert shallow == deep == 1 + 2
