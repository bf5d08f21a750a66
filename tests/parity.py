"""Parity: a distributed run against the plain single-process PyTorch loop, from the same weights and data.

Every parity test uses this module:

- inputs: `tiny_model`, `batches` (the global batch of each step), `rank_slice` (one rank's rows of it);
- optimizers: `optimizer_config` (bunsan's config section) and `make_optimizer` (the same torch optimizer);
  `sgd_no_clip(cfg)` turns a layout's config into plain SGD without clipping. Clipping to 1 makes the update
  g/|g| and Adam divides by |g| too, so a uniform gradient-scale error (gradients 2x too big: a mean over the
  wrong count of ranks, micro-batches or stages) cancels; SGD's update is linear in the gradient and shows it;
- the plain loop: `reference_model` (the initial weights a layout starts from: seeded by name when built on
  meta, the same LoRA adapters), `reference_train` (whole global batch per step, mean token loss, optional
  clipping) and `reference_for(cfg, setup)`: that loop with the config's optimizer, clipping and adapters,
  minus its parallelism;
- the worker: `train(rank, world, cfg, setup)` builds, initializes and trains one layout on every rank of a
  tests/dist_harness.py pool and returns a `Run`;
- the comparison: `assert_parity(runs, ref)`: losses and final weights at rtol 1e-5 (fp32), naming the rank,
  the first step whose loss differs and the first parameter that differs (with `init`: how large its update
  is against the plain loop's, 2.0 for gradients twice too big).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from bunsan.models import Llama, get_preset

VOCAB = 256
RTOL, ATOL = 1e-5, 1e-6     # fp32; atol: Adam amplifies reduction-order noise on near-zero gradients
TRAIN_SEED = 1234           # bunsan's train.seed default: what a model built on meta draws, by name
ADAM_EPS = 1e-5             # see make_optimizer
SGD_LR = 0.05


# -- inputs ----------------------------------------------------------------------------------------
def tiny_model(seed: int = 0, **overrides) -> Llama:
    torch.manual_seed(seed)
    return Llama(get_preset("tiny").replace(**overrides))


def batches(steps: int, rows: int, seq: int = 32, seed: int = 1, ignore_frac: float = 0.0) -> list[dict]:
    """Random token batches (global batch of `rows` rows per step); some labels -100 when ignore_frac > 0."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
        labels = ids[:, 1:].clone()
        if ignore_frac:
            labels[torch.rand(labels.shape, generator=g) < ignore_frac] = -100
        out.append({"input_ids": ids[:, :-1].contiguous(), "labels": labels})
    return out


def rank_slice(batch, rank: int, world: int):
    """This rank's rows of a dict batch, or of an (x, ..., y) tuple."""
    if isinstance(batch, tuple):
        n = batch[0].shape[0] // world
        return tuple(t[rank * n:(rank + 1) * n] for t in batch)
    n = batch["input_ids"].shape[0] // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def to_numpy(state: dict) -> dict:
    return {k: v.float().numpy() for k, v in state.items()}


# -- optimizers ------------------------------------------------------------------------------------
def make_optimizer(name: str, params, **kw):
    if name == "adamw":
        # eps (ADAM_EPS) 1e-5 rather than 1e-8: Adam divides each gradient element by its own magnitude, so elements
        # whose gradient sits at the fp32 noise floor (|g| ~ 1e-10, reduction-order noise ~ 1e-9) would
        # turn that noise into lr-sized weight differences whatever the layout. 1e-6 still lets single elements
        # drift where the CPU's kernels round differently. SGD cases test scale exactly.
        return torch.optim.AdamW(params, lr=kw.get("lr", 1e-3), weight_decay=kw.get("weight_decay", 0.01),
                                 eps=ADAM_EPS)
    if name == "sgd":
        return torch.optim.SGD(params, lr=kw.get("lr", SGD_LR), momentum=kw.get("momentum", 0.9))
    raise ValueError(name)


def optimizer_config(name: str, **params) -> dict:
    """bunsan's `optimizer` section for make_optimizer(name): AdamW, or SGD (momentum 0.9 unless given)."""
    if name == "adamw":
        return {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "eps": ADAM_EPS, **params}}
    if name == "sgd":
        return {"type": "SGD", "params": {"lr": SGD_LR, "momentum": 0.9, **params}}
    raise ValueError(name)


def sgd_no_clip(cfg: dict, momentum: float = 0.0, lr: float = SGD_LR) -> dict:
    """`cfg` (any layout) with plain SGD and gradient_clipping 0: a uniform gradient-scale error shows."""
    return {**cfg, "optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": momentum}},
            "gradient_clipping": 0.0}


_TORCH_OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW, "adam": torch.optim.Adam,
                     "adafactor": getattr(torch.optim, "Adafactor", None)}


def _optimizer_factory(opt):
    """A name (make_optimizer), a bunsan `optimizer` section, or a callable params -> optimizer."""
    if callable(opt):
        return opt
    if isinstance(opt, str):
        return lambda params: make_optimizer(opt, params)
    cls = _TORCH_OPTIMIZERS[opt["type"].lower()]
    return lambda params: cls(params, **opt.get("params", {}))


# -- the plain loop --------------------------------------------------------------------------------
@dataclass
class Setup:
    """What a layout is built and trained from, on every rank and in the plain loop: the model (the tiny preset
    with `overrides`; `build`: plain, meta (torch.device('meta'), materialised by name and train.seed), zero_init
    (bunsan.zero.Init) or seeded (built plainly, then init_weights(train.seed): what meta draws)) and the data
    (`steps` global batches of `rows` x `seq` tokens). `local`: also return each rank's own module state."""
    overrides: dict = field(default_factory=dict)
    build: str = "plain"
    steps: int = 3
    rows: int = 8
    seq: int = 32
    ignore_frac: float = 0.0
    local: bool = False

    def data(self) -> list[dict]:
        return batches(self.steps, self.rows, self.seq, ignore_frac=self.ignore_frac)

    def replace(self, **kw) -> Setup:
        return dataclasses.replace(self, **kw)


def reference_model(setup: Setup | None = None, lora: dict | None = None, seed: int = TRAIN_SEED) -> Llama:
    """The weights a layout built from `setup` starts from, with the adapters bunsan adds for `lora` (enabled)."""
    setup = setup or Setup()
    model = tiny_model(**setup.overrides)
    if setup.build != "plain":
        model.init_weights(seed=seed)      # what a model built on meta (or seeded) draws: weights by name
    if lora and lora.get("enabled"):
        from bunsan.config.root import Config
        from bunsan.transforms.lora import apply_lora
        apply_lora(model, Config.load({"lora": lora}).lora, seed=seed)
    return model


def reference_train(model, data: list, opt="sgd", clip: float = 0.0, loss_fn=None, micro: int = 1,
                    grad_scale: float = 1.0):
    """The plain loop: per step the whole global batch, mean token loss (or `loss_fn`'s mean over `micro`
    equal micro-batches of an (x, ..., y) tuple), optional global-norm clipping, one optimizer step.
    `opt`: a name for make_optimizer, a bunsan `optimizer` section, or params -> optimizer. `grad_scale`
    multiplies every gradient (not the losses reported): what a layout off by that factor would give.
    Returns (losses, final state)."""
    optimizer = _optimizer_factory(opt)(model.parameters())
    losses = []
    for batch in data:
        if loss_fn is None:
            logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch["labels"].reshape(-1),
                                   ignore_index=-100)
        else:
            chunks = zip(*(t.chunk(micro) for t in batch))
            loss = sum(loss_fn(model(*c[:-1]), c[-1]) for c in chunks) / micro
        (loss * grad_scale if grad_scale != 1.0 else loss).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_for(cfg: dict, setup: Setup | None = None, grad_scale: float = 1.0):
    """The plain loop for a layout's config (same initial weights, same data): its optimizer, clipping and
    LoRA adapters, no parallelism. Returns (losses, final state)."""
    setup = setup or Setup()
    model = reference_model(setup, cfg.get("lora"), cfg.get("train", {}).get("seed", TRAIN_SEED))
    return reference_train(model, setup.data(), cfg["optimizer"], cfg.get("gradient_clipping", 0.0),
                           grad_scale=grad_scale)


def bf16_replay(make_optimizer, data: list, world: int, clip: float = 0.0):
    """The casts of a bf16 run by hand: a bf16 model (bunsan's masters are its values in fp32), bf16 gradients
    of each rank's slice summed over the ranks, `make_optimizer(fp32 model)` stepping the masters, global-norm
    clipping to `clip` (over the parameters in the engine's flat order, reversed: the same rounding of the
    norm), the masters cast back. One thread, as the workers: bf16 kernels round by how the work is split.
    Returns (losses, final state)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_model().to(torch.bfloat16)
        params = list(model.parameters())
        fp32 = tiny_model().to(torch.bfloat16).float()
        master = list(fp32.parameters())
        opt = make_optimizer(fp32)
        losses = []
        for b in data:
            n = (b["labels"] != -100).sum().item()
            grads, total = None, 0.0
            for r in range(world):
                mb = rank_slice(b, r, world)
                logits = model(mb["input_ids"])
                loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), mb["labels"].reshape(-1),
                                       reduction="sum")
                g = torch.autograd.grad(loss / n, params)
                grads = list(g) if grads is None else [a + c for a, c in zip(grads, g)]
                total += loss.item()
            g32 = [g.float() for g in grads]
            norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in reversed(g32)])).item() if clip else 0.0
            for m, g in zip(master, g32):
                m.grad = g * (clip / (norm + 1e-6)) if clip and norm > clip else g
            opt.step()
            with torch.no_grad():
                for p, m in zip(params, master):
                    p.copy_(m)
            losses.append(total / n)
        return losses, to_numpy(model.state_dict())
    finally:
        torch.set_num_threads(threads)


# -- the worker ------------------------------------------------------------------------------------
@dataclass
class Run:
    """One rank's run: the step losses, the consolidated fp32 weights (numpy), what the rank held."""
    losses: list
    state: dict
    memory: dict
    comm: dict
    dp_rank: int
    tp_rank: int
    pp_rank: int
    held: int            # parameter elements this rank's module holds
    trainable: int       # of them, trainable
    local: dict | None   # this rank's own module state (Setup.local)


def build_model(setup: Setup, cfg: dict):
    if setup.build == "meta":
        with torch.device("meta"):
            return tiny_model(**setup.overrides)
    if setup.build == "zero_init":      # nothing allocated: ZeRO-3 materialises each rank's shard by name and seed
        import bunsan
        with bunsan.zero.Init():
            return tiny_model(**setup.overrides)
    model = tiny_model(**setup.overrides)
    if setup.build == "seeded":         # the same per-name seeded initialisation, done on the whole model
        model.init_weights(seed=cfg.get("train", {}).get("seed", TRAIN_SEED))
    return model


def train(rank: int, world: int, cfg: dict, setup: Setup | None = None) -> Run:
    """Worker (tests/dist_harness.py): build the model, bunsan.initialize it with `cfg`, train setup.steps
    global batches (each data-parallel rank its rows), return this rank's Run."""
    import bunsan
    setup = setup or Setup()
    engine = bunsan.initialize(build_model(setup, cfg), cfg)
    assert engine.dp_size * engine.cp_size * engine.tp_size * engine.pp_size == world
    if engine.dp_size == world:
        assert engine.dp_rank == rank
    losses = [engine.train_batch(rank_slice(b, engine.dp_rank, engine.dp_size)) for b in setup.data()]
    held = sum(p.numel() for p in engine.module.parameters())
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    memory = engine.memory_report()        # before the consolidation below gathers anything
    local = to_numpy(engine.module.state_dict()) if setup.local else None
    return Run(losses, to_numpy(engine.consolidated_state_dict()), memory, engine.comm_stats(), engine.dp_rank,
               engine.tp_rank, engine.pp_rank, held, trainable, local)


# -- the comparison --------------------------------------------------------------------------------
def _as_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy()
    return np.asarray(x)


def _pair(run):
    if isinstance(run, Run):
        return run.losses, run.state
    return run[0], run[1]


def compare_losses(got, want, rtol: float = RTOL, what: str = "") -> str | None:
    """None, or what differs: the first step whose loss is off by more than rtol."""
    got, want = [float(x) for x in got], [float(x) for x in want]
    if len(got) != len(want):
        return f"{what}{len(got)} losses for {len(want)} steps of the plain loop"
    for i, (a, b) in enumerate(zip(got, want)):
        if not abs(a - b) <= rtol * abs(b):
            return (f"{what}loss differs first at step {i + 1} of {len(want)}: {a!r} vs the plain loop's {b!r} "
                    f"(relative {abs(a - b) / max(abs(b), 1e-30):.2e} > rtol {rtol:g}); all: {got} vs {want}")
    return None


def compare_states(got: dict, want: dict, rtol: float = RTOL, atol: float = ATOL, init: dict | None = None,
                   what: str = "") -> str | None:
    """None, or what differs: parameters whose elements break |got - want| <= atol + rtol |want|, the first
    (in state-dict order) described: how many elements, the largest difference; with `init` (the weights both
    started from), the ratio of the updates, median over its differing elements (2.0: gradients twice too big)."""
    if got.keys() != want.keys():
        missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
        return f"{what}state keys differ: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, " \
               f"extra {extra[:5]}{'...' if len(extra) > 5 else ''}"
    bad, first = [], None
    for k in want:
        a, b = _as_numpy(got[k]), _as_numpy(want[k])
        if a.shape != b.shape:
            bad.append(k)
            first = first or f"{k}: shape {a.shape} vs the plain loop's {b.shape}"
            continue
        off = ~(np.abs(a - b) <= atol + rtol * np.abs(b))
        if not off.any():
            continue
        bad.append(k)
        if first is None:
            d = np.abs(a - b)
            i = np.unravel_index(np.argmax(np.where(off, d, -1)), d.shape)
            first = (f"{k} {tuple(b.shape)}: {int(off.sum())} of {b.size} elements, largest difference "
                     f"{d[i]:.3e} at {tuple(int(j) for j in i)} ({a[i]!r} vs {b[i]!r})")
            if init is not None and k in init:
                w0 = _as_numpy(init[k])
                moved = off & (np.abs(b - w0) > 0)
                if moved.any():
                    ratio = np.median((a - w0)[moved] / (b - w0)[moved])
                    first += f"; its update is {ratio:.4g}x the plain loop's (median)"
    if bad:
        return f"{what}{len(bad)} of {len(want)} parameters differ (rtol {rtol:g}, atol {atol:g}); first {first}"
    return None


def assert_parity(runs, ref, rtol: float = RTOL, atol: float = ATOL, loss_rtol: float | None = None,
                  init: dict | None = None, what: str = "") -> None:
    """Every rank's losses and final weights match the plain loop's `ref` = (losses, state) (losses None: the
    weights only). `runs`: Run or (losses, state, ...) per rank. Fails naming the rank, the first differing step
    and the first differing parameter."""
    ref_losses, ref_state = _pair(ref)
    ref_state = {k: _as_numpy(v) for k, v in ref_state.items()}
    problems = []
    for r, run in enumerate(runs):
        losses, state = _pair(run)
        where = f"{what + ': ' if what else ''}rank {r}: "
        for p in (None if ref_losses is None else
                  compare_losses(losses, ref_losses, rtol if loss_rtol is None else loss_rtol, where),
                  compare_states(state, ref_state, rtol, atol, init, where)):
            if p:
                problems.append(p)
        if problems:          # the first rank that differs says enough
            break
    assert not problems, "\n".join(problems)


def assert_same_on_every_rank(runs) -> None:
    """Every rank reports the very same losses."""
    first = _pair(runs[0])[0]
    for r, run in enumerate(runs[1:], 1):
        assert _pair(run)[0] == first, f"rank {r} losses {_pair(run)[0]} vs rank 0's {first}"


def check_runs(results, ref_losses, ref_state) -> None:
    """(losses, state dict, anything) per rank against the plain loop's: losses within 1e-5 relative, every
    reference tensor within rtol 1e-5 (torch tensors, as the engine's consolidated_state_dict gives)."""
    for losses, state, _ in results:
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= 1e-5 * abs(b), f"step {i}: {a} vs {b}"
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)
