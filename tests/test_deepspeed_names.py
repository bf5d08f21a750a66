"""The DeepSpeed names DeepSpeed-Chat and DeepSpeedExamples import, each in the form the scripts write it;
what bunsan lacks imports and fails where used; `install()` makes `import deepspeed` bunsan's for code you do
not edit; DeepSpeed's ZeRO-3 parameter attributes, init_inference and the engine's smaller members."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn as nn

import bunsan.deepspeed as deepspeed
from bunsan.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

# the import lines of DeepSpeed-Chat (every file) and of DeepSpeedExamples' most-run scripts
IMPORTS = """
import deepspeed
import deepspeed.comm as dist
from deepspeed import get_accelerator
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from deepspeed.runtime.zero import GatheredParameters
from deepspeed.compression.helper import recursive_getattr, recursive_setattr, convert_conv1d_to_linear
from deepspeed.utils.logging import logger
from deepspeed.utils import RepeatingLoader, log_dist
from deepspeed.runtime.utils import see_memory_usage
from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
from deepspeed.pipe import PipelineModule
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd, save_without_random_ltd
from deepspeed.ops.sparse_attention import FixedSparsityConfig, SparseAttentionUtils
from deepspeed.ops.op_builder import AsyncIOBuilder
from deepspeed.compression.compress import init_compression, redundancy_clean
from deepspeed import DeepSpeedTransformerLayer, DeepSpeedTransformerConfig, DeepSpeedConfig
from deepspeed.runtime.domino.transformer import DominoTransformer
import deepspeed.module_inject as module_inject
"""


def _as_bunsan(lines: str) -> str:
    return (lines.replace("from deepspeed", "from bunsan.deepspeed")
            .replace("import deepspeed.", "import bunsan.deepspeed.")
            .replace("import deepspeed\n", "import bunsan.deepspeed as deepspeed\n"))


def test_every_import_line_of_the_scripts_works_under_bunsans_name():
    namespace: dict = {}
    exec(_as_bunsan(IMPORTS), namespace)
    assert namespace["get_accelerator"]().device_name() in ("cpu", "cuda")
    assert namespace["ZeroParamStatus"].NOT_AVAILABLE.value == 2
    assert namespace["OffloadDeviceEnum"].cpu == "cpu" and "WarmupLR" in namespace["VALID_LR_SCHEDULES"]


@pytest.mark.parametrize("name", ["convert_to_random_ltd", "FixedSparsityConfig", "AsyncIOBuilder",
                                  "init_compression", "DeepSpeedTransformerLayer", "DeepSpeedConfig",
                                  "DominoTransformer"])
def test_what_bunsan_lacks_imports_and_fails_where_used_naming_it(name):
    namespace: dict = {}
    exec(_as_bunsan(IMPORTS), namespace)
    with pytest.raises(NotImplementedError, match=f"{name} is DeepSpeed's .*bunsan does not have it"):
        namespace[name]()
    with pytest.raises(NotImplementedError, match=name):
        class Mine(namespace[name]):    # subclassing is a use too
            pass


def _install_rank(rank) -> str:
    """The start of a program whose DeepSpeed imports are not its own, on a rank (a process of its own, where
    nothing imported DeepSpeed's name): install(), the scripts' import lines as written, then what transformers
    and the package metadata see."""
    import importlib.metadata
    import sys

    import bunsan.deepspeed
    bunsan.deepspeed.install()
    namespace: dict = {}
    exec(IMPORTS, namespace)
    assert namespace["deepspeed"] is bunsan.deepspeed and namespace["dist"] is bunsan.deepspeed.comm
    assert sys.modules["deepspeed.runtime.zero.partition_parameters"] is \
        bunsan.deepspeed.runtime.zero.partition_parameters
    assert bunsan.deepspeed.comm.__spec__.name == "bunsan.deepspeed.comm"   # still bunsan's own module
    assert importlib.metadata.version("deepspeed") == "0.19.8"
    from transformers.integrations.deepspeed import is_deepspeed_available
    assert is_deepspeed_available()
    return "ok"


def test_install_makes_import_deepspeed_bunsans_for_code_not_yours(pools):
    try:
        assert pools.run(1, _install_rank) == ["ok"]
    finally:
        pools.discard(1)         # the rank keeps the alias: other tests' ranks must not


def test_install_after_deepspeed_itself_was_imported_is_refused(monkeypatch):
    from bunsan.deepspeed import alias
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, alias._Alias)])
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))   # DeepSpeed itself, first
    with pytest.raises(RuntimeError) as refused:
        deepspeed.install()
    assert "was imported already" in str(refused.value) and "call install() first" in str(refused.value)
    assert not alias.installed()


def test_compression_helper():
    from transformers.pytorch_utils import Conv1D
    from bunsan.deepspeed.compression.helper import convert_conv1d_to_linear, recursive_getattr, recursive_setattr
    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(Conv1D(6, 4)), nn.ReLU())
    x = torch.randn(3, 4)
    before = net(x)
    assert recursive_getattr(net, "0.0") is net[0][0]
    convert_conv1d_to_linear(net, Conv1D)
    assert isinstance(net[0][0], nn.Linear)
    torch.testing.assert_close(net(x), before)
    recursive_setattr(net, "1", nn.Identity())
    assert isinstance(net[1], nn.Identity)


def test_tput_timer_offload_states_and_boundaries():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    engine, *_ = deepspeed.initialize(model=net, config={
        "train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_print": float("inf"),
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    for _ in range(8):
        loss = engine(torch.randn(2, 4)).square().mean()
        engine.backward(loss)
        engine.step()
    engine.tput_timer.update_epoch_count()
    assert engine.tput_timer.epoch_count == 1 and engine.tput_timer.global_step_count == 4
    assert engine.tput_timer.avg_samples_per_sec() > 0
    from bunsan.deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    engine.offload_states(device=OffloadDeviceEnum.cpu)   # on the CPU the states are in host memory already
    engine.reload_states()
    with pytest.raises(ValueError, match="offloads to 'cpu' only"):
        engine.offload_states(device="nvme")
    engine.set_gradient_accumulation_boundary(True)       # as accelerate: this micro-batch ends the step
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    assert engine.global_steps == 5
    with pytest.raises(RuntimeError, match="no backward since the last step"):
        engine.step()
    assert engine.gradient_accumulation_steps() == 2
    assert engine[0] is net[0] if hasattr(engine, "__getitem__") else engine.module[0] is net[0]


def test_engine_reaches_the_models_attributes_as_deepspeeds_does():
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    ds_config = {"train_batch_size": 2, "steps_per_print": 100, "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    assert engine.config == ds_config                      # DeepSpeed's engine.config: the config (transformers reads it)
    assert engine.model is model.model                     # what the engine lacks comes from the model
    assert engine.module.config is model.config
    engine.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    with pytest.raises(AttributeError):
        engine.no_such_attribute


# -- ZeRO-3 in DeepSpeed-Chat's form (2 ranks) -----------------------------------------------------------------
def _zero3_rank(rank):
    import bunsan.deepspeed as ds
    from bunsan.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus as Status
    torch.manual_seed(0)
    with ds.zero.Init():
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    meta = net[0].weight
    meta._is_hf_initialized = True                         # transformers marks loaded weights this way
    # transformers passes a set made into a list: each rank's own order
    params = list({p for p in net.parameters()}) if rank == 0 else list(net.parameters())
    with ds.zero.GatheredParameters(params, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                net[2].bias.fill_(0.5)
    assert net[0].weight is meta and meta._is_hf_initialized   # the same object, its marks kept
    engine, *_ = ds.initialize(model=net, config={"train_batch_size": 4, "steps_per_print": 100,
                                                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                                  "zero_optimization": {"stage": 3}})
    fetch = [p for p in engine.module.parameters() if hasattr(p, "ds_id") and p.ds_status == Status.NOT_AVAILABLE]
    shapes = [p.ds_shape for p in engine.module.parameters()]
    with ds.zero.GatheredParameters(fetch[:1]):            # DeepSpeed-Chat's save_zero_three_model
        inside = [p.ds_status for p in engine.module.parameters()]
        whole = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    after = {p.ds_status for p in engine.module.parameters()}
    return len(fetch), shapes, inside, after, whole


def test_zero3_parameters_carry_deepspeeds_attributes(pools):
    results = pools.run(2, _zero3_rank)
    for count, shapes, inside, after, whole in results:
        assert count == 4 and shapes == [(8, 4), (8,), (2, 8), (2,)]
        assert set(inside) == {ZeroParamStatus.AVAILABLE} and after == {ZeroParamStatus.NOT_AVAILABLE}
        assert torch.equal(whole["2.bias"], torch.full((2,), 0.5))
        assert whole["0.weight"].shape == (8, 4)
    torch.testing.assert_close(results[0][4]["0.weight"], results[1][4]["0.weight"])


# -- init_inference ------------------------------------------------------------------------------------------
def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _generate_rank(rank, tp):
    import bunsan.deepspeed as ds
    model = _tiny_llama()
    engine = ds.init_inference(model, tensor_parallel={"tp_size": tp}, dtype=torch.float32,
                               replace_with_kernel_inject=True)
    ids = torch.tensor([[1, 5, 9, 3]])
    return engine.generate(ids, max_new_tokens=6, do_sample=False).tolist(), engine(ids).logits.shape


def test_init_inference_tp_generates_as_the_whole_model(pools):
    want = _tiny_llama().eval().generate(torch.tensor([[1, 5, 9, 3]]), max_new_tokens=6, do_sample=False).tolist()
    for tokens, shape in pools.run(2, _generate_rank, 2):
        assert tokens == want and shape == (1, 4, 64)      # every rank: the whole vocabulary, the same tokens


def test_init_inference_refuses_what_changes_results():
    with pytest.raises(ValueError, match="int8"):
        deepspeed.init_inference(_tiny_llama(), dtype=torch.int8)
    with pytest.raises(ValueError, match="checkpoint"):
        deepspeed.init_inference(_tiny_llama(), checkpoint="ckpt.json")
    with pytest.raises(TypeError, match="no_such_option"):
        deepspeed.init_inference(_tiny_llama(), no_such_option=1)
    engine = deepspeed.init_inference(_tiny_llama(), mp_size=1, dtype=torch.bfloat16)
    assert next(engine.module.parameters()).dtype == torch.bfloat16 and not engine.module.training
