"""The planner's hardware table and analytic step-time model, checked against hand arithmetic."""

import math

import pytest

from bunsan.models.llama import LlamaConfig
from bunsan.planner import collectives, compute, constants, cost
from bunsan.planner.cost import step_time, train_time
from bunsan.estimator import hardware
from bunsan.estimator.hardware import GPU, Interconnect, gpu_spec, interconnect, parse_bytes
from bunsan.estimator.layout import Layout

# Small, hand-countable model: h=256, I=688, L=4, 8 heads (MHA), V=1000, untied.
MODEL = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=8)
H, I, L, V = 256, 688, 4, 1000
# Per layer: q,k,v,o (4h^2) + gate/up/down (3hI) + two norms (2h); then final norm + LM head.
N_NO_EMB = L * (4 * H * H + 3 * H * I + 2 * H) + H + V * H
N_ALL = N_NO_EMB + V * H
FAST = Interconnect("fast", 100e9, 0.0)   # zero latency, so volumes divide exactly
SLOW = Interconnect("slow", 1e9, 0.0)
GPU_X = GPU("x", 2 ** 30, {"bf16": 1e12, "fp16": 1e12, "fp32": 0.25e12}, 1e12)


def price(layout, gpus_per_node=8, intra=FAST, inter=SLOW, gpu=GPU_X, **kw):
    return step_time(MODEL, layout, gpu, intra, inter, gpus_per_node, **kw)


def rel(a, b):
    return abs(a - b) / abs(b)


# ---------------------------------------------------------------- compute

WIDE = GPU("wide", 2 ** 30, {"bf16": 1e12, "fp16": 1e12, "fp32": 0.25e12}, 1e18)   # HBM never the bound


def test_compute_bound_gemms_follow_the_6n_plus_attention_rule():
    """With HBM out of the way every GEMM runs at the GEMM efficiency, and the GEMMs are 6N + 12·L·h·s."""
    assert MODEL.num_params(include_embedding=False) == N_NO_EMB
    lay = Layout(dp=2, micro_batch=3, grad_accum=2, seq_len=128)
    st = price(lay, efficiency=0.5, gpu=WIDE)
    tokens = 2 * 3 * 2 * 128
    norms = L * 2 * H + H                       # in N but not matmuls
    flops = (6 * (N_NO_EMB - norms) + 12 * L * H * 128) * tokens
    assert rel(st.compute, flops / 2 / (1e12 * 0.5)) < 1e-6
    assert st.tokens_per_step == tokens


def test_heads_set_apart_from_hidden_are_priced_by_their_own_widths():
    """head_dim apart from hidden / heads (Mistral Nemo's, Qwen3 0.6B's): the GEMMs are the FLOPs of the weights
    the Llama built from the config holds (counted on the meta device, not from the config's formulas), and
    attention's 12·L·h·s counts the query heads' width (8 x 48 = 384 here, not hidden 256)."""
    import torch
    from bunsan.models.llama import Llama
    model = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=48)
    with torch.device("meta"):
        built = Llama(model)
    linear = sum(m.weight.numel() for m in built.modules() if isinstance(m, torch.nn.Linear))
    assert model.num_params(include_embedding=False) == linear + L * 2 * H + H
    assert built.layers[0].self_attn.o_proj.weight.shape == (H, 384)
    lay = Layout(dp=2, micro_batch=3, grad_accum=2, seq_len=128)
    st = step_time(model, lay, WIDE, FAST, SLOW, 8, efficiency=0.5)
    tokens = 2 * 3 * 2 * 128
    assert rel(st.compute, (6 * linear + 12 * L * 384 * 128) * tokens / 2 / (1e12 * 0.5)) < 1e-6
    assert st.flops_per_token == 6 * model.num_params(include_embedding=False) + 12 * L * 384 * 128


def test_a_skinny_gemm_is_priced_by_its_bytes():
    """The roofline: one token through a 4096 x 4096 weight reads the weight; its FLOPs are nothing."""
    x = GPU("x", 2 ** 30, {"bf16": 1e15}, 1e12)
    seconds = compute.gemm(1, 4096, 4096, x, "bf16", 2, 0.8)
    assert rel(seconds, (4096 * 4096 + 2 * 4096) * 2 / (1e12 * constants.HBM_EFFICIENCY)) < 1e-12
    big = compute.gemm(8192, 4096, 4096, x, "bf16", 2, 0.8)
    assert rel(big, 2 * 8192 * 4096 * 4096 / (1e15 * 0.8)) < 1e-12


def test_tensor_parallel_without_sp_replicates_the_elementwise_work():
    lay = Layout(tp=4, seq_len=128)
    plain = compute.block_time(MODEL, lay, GPU_X, 0.8)
    sp = compute.block_time(MODEL, lay.replace(sequence_parallel=True), GPU_X, 0.8)
    assert sp.forward < plain.forward
    one = compute.block_time(MODEL, lay.replace(tp=1), GPU_X, 0.8)
    assert plain.forward > one.forward / 4          # GEMMs split four ways, norms and residuals not


def test_fp32_uses_the_fp32_peak():
    bf16, fp32 = price(Layout(precision="bf16"), gpu=WIDE), price(Layout(precision="fp32"), gpu=WIDE)
    assert rel(fp32.compute, 4 * bf16.compute) < 1e-6     # the element-wise bytes (tiny here) do not scale


def test_checkpointing_reruns_the_blocks_forward():
    plain, ckpt = price(Layout()), price(Layout(checkpointing=True))
    blk = compute.block_time(MODEL, Layout(), GPU_X, cost.EFFICIENCY)
    assert plain.recompute == 0
    assert rel(ckpt.recompute, L * blk.forward) < 1e-12
    assert ckpt.compute == plain.compute
    sel = price(Layout(checkpointing="selective"))
    assert 0 < sel.recompute < ckpt.recompute


def test_single_gpu_is_compute_and_the_optimizer_step():
    st = price(Layout(seq_len=64), efficiency=0.3)
    assert rel(st.total, st.compute + st.optimizer) < 1e-12
    assert rel(st.tokens_per_s, 64 / st.total) < 1e-12


def test_mfu_stays_below_the_gemm_efficiency():
    layouts = [Layout(dp=2, tp=2, pp=2, grad_accum=4, zero=3, checkpointing=True),
               Layout(dp=4, zero=1, offload_optimizer="cpu"), Layout(tp=4, sequence_parallel=True)]
    for lay in layouts:
        st = price(lay, efficiency=0.4)
        assert 0 < st.mfu < 0.4


# ---------------------------------------------------------------- tensor parallel

def test_tp_comm_zero_without_tp_and_matches_megatron_volume():
    assert price(Layout(tp=1)).tp_comm == 0
    lay = Layout(tp=4, micro_batch=2, grad_accum=3, seq_len=64)
    per_all_reduce = 2 * 3 / 4 * (2 * 64 * H * 2) / FAST.bytes_per_s
    assert rel(price(lay).tp_comm, 3 * L * 4 * per_all_reduce) < 1e-12


def test_tp_comm_grows_with_micro_batch_and_recompute():
    one = price(Layout(tp=2, micro_batch=1)).tp_comm
    assert rel(price(Layout(tp=2, micro_batch=2)).tp_comm, 2 * one) < 1e-12
    assert rel(price(Layout(tp=2, checkpointing=True)).tp_comm, 1.5 * one) < 1e-12
    # the same points as other collectives, and the saved input slices gathered again in backward
    assert rel(price(Layout(tp=2, sequence_parallel=True)).tp_comm, 1.25 * one) < 1e-12


def test_tp_beyond_a_node_uses_the_inter_node_link():
    lay = Layout(tp=8, seq_len=64)
    assert price(lay, gpus_per_node=4).tp_comm > price(lay, gpus_per_node=8).tp_comm


# ---------------------------------------------------------------- data parallel

def test_zero3_moves_one_and_a_half_times_zero1():
    z1, z2, z3 = (price(Layout(dp=4, zero=z)).dp_comm_total for z in (1, 2, 3))
    assert rel(z1, 2 * 3 / 4 * N_ALL * 2 / FAST.bytes_per_s) < 1e-12
    assert rel(z2, z1) < 1e-12
    assert rel(z3, 1.5 * z1) < 1e-12


def test_stage2_and_3_traffic_grows_with_micro_steps_stage1_does_not():
    def total(zero, m):
        return price(Layout(dp=4, zero=zero, grad_accum=m)).dp_comm_total
    assert rel(total(1, 4), total(1, 1)) < 1e-12
    assert rel(total(2, 4), total(2, 1) * 5 / 2) < 1e-12   # 4 reduce-scatters + 1 all-gather vs 1 + 1
    assert rel(total(3, 4), 4 * total(3, 1)) < 1e-12


def test_overlap_hides_dp_traffic_up_to_the_window():
    fast = price(Layout(dp=4, zero=0, seq_len=512))
    assert fast.dp_comm_total > 0
    assert rel(fast.dp_comm, fast.dp_comm_total / L) < 1e-12   # hidden behind backward but the last bucket
    slow = price(Layout(dp=4, zero=0, seq_len=512), intra=Interconnect("trickle", 1e8, 0.0))
    backward = L * compute.block_time(MODEL, Layout(seq_len=512), GPU_X, cost.EFFICIENCY).backward
    assert slow.dp_comm_total > backward      # too much traffic to hide
    assert rel(slow.dp_comm, slow.dp_comm_total - backward) < 1e-9
    assert price(Layout(dp=1, zero=1)).dp_comm_total == 0


def test_another_frameworks_overlaps_hide_only_their_own_traffic():
    """`overlap` (cost.OVERLAPS, Megatron-Core's flags): the TP collectives hide behind the compute, the
    post-step ZeRO-1 gather behind a forward, the reduce under pipeline stages behind the last micro-batch's
    backward, each to one block's share; every other term is unchanged, the assumptions say what was hidden,
    and a name not in OVERLAPS is refused."""
    gather_only = Layout(dp=4, zero=1, seq_len=512)
    plain, hidden = price(gather_only), price(gather_only, overlap=("param_gather",))
    gather = 3 / 4 * N_ALL * 2 / 100e9
    assert rel(plain.dp_comm - hidden.dp_comm, gather - gather / L) < 1e-9
    assert (hidden.compute, hidden.tp_comm, hidden.dp_comm_total) == (plain.compute, plain.tp_comm,
                                                                      plain.dp_comm_total)
    tp = Layout(dp=1, tp=2, seq_len=512)
    plain, hidden = price(tp), price(tp, overlap=("tp",))
    assert plain.tp_comm > 0 and rel(hidden.tp_comm, plain.tp_comm / L) < 1e-9      # one block's share left
    tp_note = next(a for a in hidden.assumptions if a.startswith("tp:"))
    assert "overlap 'tp'" in tp_note and "never overlapped" not in tp_note
    assert "never overlapped" in next(a for a in plain.assumptions if a.startswith("tp:"))
    staged = Layout(dp=2, pp=2, zero=0, micro_batch=1, grad_accum=4, seq_len=512)
    plain, hidden = price(staged), price(staged, overlap=("grad_reduce",))
    assert hidden.dp_comm < plain.dp_comm and hidden.dp_comm_total == plain.dp_comm_total
    dp_note = next(a for a in hidden.assumptions if a.startswith("dp:"))
    assert "the reduce after the schedule hidden" in dp_note and "all-gather (stages 1-2) exposed" in dp_note
    with pytest.raises(ValueError, match=r"overlap \['nccl'\]: not one of tp, grad_reduce, param_gather"):
        price(tp, overlap=("nccl",))


def test_zero3_gathers_hide_only_behind_the_block_before():
    """A gather longer than one block's compute is exposed, however long the whole pass is."""
    lay = Layout(dp=4, zero=3, seq_len=64)
    st = price(lay, intra=Interconnect("trickle", 2e8, 0.0))
    blk = compute.block_time(MODEL, lay, GPU_X, cost.EFFICIENCY)
    gather = 3 / 4 * N_ALL * 2 / L / 2e8
    reduce = gather
    assert gather > blk.forward
    fwd = gather + (L - 1) * (gather - blk.forward)
    bwd = gather + (L - 1) * max(0.0, gather + reduce - blk.backward) + reduce
    assert rel(st.dp_comm, fwd + bwd) < 1e-9


def test_inter_node_data_parallel_is_slower_than_intra():
    lay = Layout(dp=16, zero=1)
    across, within = price(lay, gpus_per_node=8), price(lay, gpus_per_node=16)
    assert across.dp_comm_total > within.dp_comm_total
    assert across.total > within.total


# ---------------------------------------------------------------- pipeline

def test_1f1b_bubble_is_p_minus_1_over_m_of_ideal():
    st = price(Layout(pp=4, grad_accum=8))
    assert rel(st.bubble / (st.compute + st.recompute + st.tp_comm), 3 / 8) < 1e-12
    gpipe = price(Layout(pp=4, grad_accum=8, schedule="gpipe"))
    assert rel(gpipe.bubble, st.bubble) < 1e-12


def test_interleaving_halves_the_bubble():
    plain = price(Layout(pp=2, grad_accum=8))
    inter = price(Layout(pp=2, grad_accum=8, schedule="interleaved", virtual_stages=2))
    assert rel(inter.bubble, plain.bubble / 2) < 1e-12
    assert rel(inter.pp_comm, 2 * plain.pp_comm) < 1e-12   # twice the chunk boundaries


def test_pp_comm_matches_two_sends_per_micro_batch():
    assert price(Layout()).pp_comm == 0 and price(Layout()).bubble == 0
    lay = Layout(pp=2, grad_accum=4, micro_batch=2, seq_len=64)
    assert rel(price(lay).pp_comm, 2 * 4 * (2 * 64 * H * 2) / FAST.bytes_per_s) < 1e-12
    sp = price(lay.replace(tp=2, sequence_parallel=True)).pp_comm
    assert rel(sp, price(lay).pp_comm / 2) < 1e-12


# ---------------------------------------------------------------- offload and totals

def test_offload_adds_time_nvme_more_than_cpu():
    base = price(Layout(dp=2, zero=2))
    cpu = price(Layout(dp=2, zero=2, offload_optimizer="cpu"))
    nvme = price(Layout(dp=2, zero=2, offload_optimizer="nvme"))
    assert base.offload == 0 < cpu.offload < nvme.offload
    shard = N_ALL / 2
    expected_cpu = shard * (4 + 2) / cost.HOST_LINK_BYTES_PER_S + shard / cost.CPU_ADAM_PARAMS_PER_S
    assert rel(cpu.offload, expected_cpu) < 1e-12
    p_cpu = price(Layout(dp=2, zero=3, offload_param="cpu")).offload
    p_nvme = price(Layout(dp=2, zero=3, offload_param="nvme")).offload
    assert 0 < p_cpu < p_nvme


def test_total_is_the_sum_and_train_time_counts_whole_steps():
    lay = Layout(dp=2, tp=2, pp=2, grad_accum=4, zero=1, checkpointing=True, offload_optimizer="cpu")
    st = price(lay)
    parts = [st.compute, st.recompute, st.tp_comm, st.dp_comm, st.pp_comm, st.bubble, st.offload, st.optimizer]
    assert rel(st.total, sum(parts)) < 1e-12
    per_step = lay.global_batch * lay.seq_len
    assert train_time(st, lay, 5 * per_step // 2) == 3 * st.total
    with pytest.raises(ValueError, match="tokens per step"):
        train_time(st, lay.replace(micro_batch=2), per_step)
    with pytest.raises(ValueError, match="positive int"):
        train_time(st, lay, 0)


def test_explain_lists_components_and_assumptions():
    text = price(Layout(dp=2, tp=2, zero=3)).explain()
    for word in cost.COMPONENTS + ("MFU", "tokens/s", "assumptions", "6N", "ZeRO-3", "80%"):
        assert word in text


def test_real_gpus_price_a_real_model():
    llama8b = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8)
    lay = Layout(dp=8, zero=1, micro_batch=2, grad_accum=8, seq_len=4096)
    h100 = step_time(llama8b, lay, gpu_spec("h100"), interconnect("nvlink"), interconnect("ib"), 8)
    a100 = step_time(llama8b, lay, gpu_spec("a100"), interconnect("nvlink"), interconnect("ib"), 8)
    # compute-bound GEMMs go with the peak (989 / 312), the element-wise rest with HBM (3.35 / 2.039)
    assert 3.35 / 2.039 < a100.compute / h100.compute < 989 / 312
    assert 0.3 < h100.mfu <= cost.EFFICIENCY


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("layout, gpn, words", [
    (Layout(tp=3), 8, ["tensor_parallel.size 3", "num_attention_heads"]),
    (Layout(pp=4, grad_accum=2), 8, ["m=2 < pp p=4", "raise grad_accum to 4"]),
    (Layout(pp=2, grad_accum=3, schedule="interleaved", virtual_stages=2), 8, ["multiple of pp", "to 4"]),
    (Layout(pp=2, grad_accum=2, virtual_stages=2), 8, ["interleaved"]),
    (Layout(pp=8, grad_accum=8), 8, ["8 model chunks", "4 layers"]),
    (Layout(dp=2, zero=2, offload_param="cpu"), 8, ["ZeRO stage 3", "set zero to 3"]),
    (Layout(dp=2, offload_optimizer="cpu"), 8, ["ZeRO stage 1-3"]),
    (Layout(dp=12), 8, ["12 GPUs", "multiple of 8"]),
    (Layout(virtual_stages=2), 8, ["needs pipeline parallelism"]),
    (Layout(tp=2, sequence_parallel=True, seq_len=63), 8, ["seq_len 63", "multiple of 2"]),
])
def test_invalid_layouts_name_the_rule_and_the_fix(layout, gpn, words):
    with pytest.raises(ValueError) as err:
        price(layout, gpus_per_node=gpn)
    for word in words:
        assert word in str(err.value)


def test_bf16_on_v100_suggests_fp16():
    v100 = gpu_spec("v100")
    with pytest.raises(ValueError, match=r"'v100' has no bf16.*'fp16'"):
        price(Layout(precision="bf16"), gpu=v100)
    assert price(Layout(precision="fp16"), gpu=v100).peak_flops == 125e12


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, True])
def test_efficiency_must_be_a_fraction(bad):
    with pytest.raises(ValueError, match="efficiency"):
        price(Layout(), efficiency=bad)


# ---------------------------------------------------------------- hardware table

def test_gpu_table_figures_and_aliases():
    h100, h200 = gpu_spec("H100-SXM"), gpu_spec("h200")
    assert h100.flops("bf16") == 989e12 and h100.memory_bytes == 80 * 2 ** 30
    assert h200.peak_flops == h100.peak_flops and h200.memory_bytes > h100.memory_bytes
    assert gpu_spec("a100-80gb") is gpu_spec("A100")
    assert gpu_spec("NVIDIA A100-SXM4-40GB").name == "a100-40gb"   # torch.cuda.get_device_name() form
    assert gpu_spec("a100").flops("bf16") == 312e12
    assert gpu_spec("cpu").flops("fp32") == 1e11 and gpu_spec("cpu").memory_bytes == 24 * 2 ** 30
    for name in ("l40s", "a10", "rtx4090"):
        g = gpu_spec(name)
        assert g.flops("fp32") < g.flops("bf16") == g.flops("fp16")


def test_unknown_names_list_known_ones_and_a_close_match():
    with pytest.raises(ValueError, match=r"unknown GPU 'h1000'.*known: .*a100.*did you mean 'h100'"):
        gpu_spec("h1000")
    with pytest.raises(ValueError, match=r"unknown interconnect 'infinband'.*did you mean 'infiniband'"):
        interconnect("infinband")


def test_interconnects():
    assert interconnect("IB") is interconnect("infiniband")
    assert interconnect("nvlink").bytes_per_s > interconnect("infiniband").bytes_per_s \
        > interconnect("ethernet").bytes_per_s > interconnect("loopback").bytes_per_s
    assert interconnect("gloo").name == "loopback"


@pytest.mark.parametrize("text, expected", [
    ("80GB", 80 * 10 ** 9), ("80GiB", 80 * 2 ** 30), ("24G", 24 * 2 ** 30), ("80gb", 80 * 10 ** 9),
    ("512 MiB", 512 * 2 ** 20), ("1.5GB", 1_500_000_000), ("1048576", 1048576), ("4096B", 4096),
    ("2T", 2 * 2 ** 40), ("1e3", 1000), (123, 123),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["80XB", "", "-1", "GB", "1.5B", "eighty", None, 1.5, True])
def test_parse_bytes_rejects_with_accepted_forms(bad):
    with pytest.raises(ValueError, match=r"80GiB") as err:
        parse_bytes(bad)
    assert repr(bad) in str(err.value)


def test_nothing_is_nan():
    st = price(Layout(dp=2, tp=2, pp=2, grad_accum=2, zero=3, offload_optimizer="nvme", offload_param="nvme"))
    assert all(math.isfinite(getattr(st, name)) and getattr(st, name) >= 0 for name in cost.COMPONENTS)


def test_pipeline_zero3_traffic_follows_the_gather_policy():
    """Under pipeline stages a stage reduces once after the schedule; ZeRO-3 gathers per micro-batch (forward
    and backward) or once per schedule."""
    def dp_total(zero, gather="micro_batch", m=4):
        return price(Layout(dp=2, pp=2, zero=zero, grad_accum=m, pipeline_gather=gather)).dp_comm_total
    assert rel(dp_total(2), dp_total(1)) < 1e-12                      # one reduce-scatter + the post-step gather
    assert rel(dp_total(3, "schedule"), dp_total(1)) < 1e-12          # one gather + one reduce-scatter
    assert rel(dp_total(3), dp_total(1) * (2 * 4 + 1) / 2) < 1e-12    # 2 gathers per micro-batch + 1 reduce
    assert rel(dp_total(3, m=8), dp_total(1) * (2 * 8 + 1) / 2) < 1e-12


# ---------------------------------------------------------------- collectives and overrides

NVL = Interconnect("nvl", 200e9, 3e-6, 8e-6)
NET = Interconnect("net", 20e9, 10e-6, 8e-6)
TOPO = collectives.Topology(8, NVL, NET)


def test_collectives_are_latency_plus_bytes_over_the_slowest_hop():
    inside = collectives.collective("all_gather", 1e9, 8, 1, TOPO)
    assert rel(inside, 8e-6 + 7 * 3e-6 + 7 / 8 * 1e9 / 200e9) < 1e-12
    across = collectives.collective("all_gather", 1e9, 16, 1, TOPO)      # two nodes: the network bounds it
    assert rel(across, 8e-6 + 14 * 3e-6 + 1 * 10e-6 + 15 / 16 * 1e9 / 20e9) < 1e-12
    assert collectives.collective("all_reduce", 1e9, 8, 1, TOPO) > 2 * inside - 8e-6 - 1e-9


def test_small_all_reduces_across_many_nodes_take_the_tree():
    ring_steps = 2 * 255 * 3e-6   # a lower bound on the ring's latency alone over 256 ranks
    small = collectives.collective("all_reduce", 1e3, 256, 8, TOPO)      # one rank per node: 256 nodes
    assert small < ring_steps
    assert collectives.collective("all_gather", 1e3, 256, 8, TOPO) > 255 * 10e-6   # rings only


def test_group_span_follows_the_mesh_order():
    assert TOPO.span(8, 1) == (8, 1)        # tp 8 inside a node
    assert TOPO.span(4, 8) == (1, 4)        # dp 4 across tp 8: one per node
    assert TOPO.span(4, 2) == (4, 1) and TOPO.span(8, 2) == (4, 2)


def test_measured_links_and_gpus_override_the_table():
    slow = hardware.with_link(interconnect("hdr"), bandwidth="6.25GB/s", latency=2e-5)
    assert slow.bytes_per_s == 6.25e9 and slow.latency_s == 2e-5
    gpu = hardware.parse_gpu_spec("a100,bf16=250T,hbm=1.5TB")
    assert gpu.flops("bf16") == 250e12 and gpu.hbm_bytes_per_s == 1.5e12 and gpu.memory_bytes == 80 * 2 ** 30
    assert hardware.intra_link(gpu).name == "nvlink3"
    with pytest.raises(ValueError, match="custom GPU needs all three"):
        hardware.parse_gpu_spec("custom,bf16=1T")
    with pytest.raises(ValueError, match="6.25GB/s"):
        hardware.parse_rate("-3")


@pytest.mark.parametrize("layers, pp, v", [(4, 2, 1), (6, 4, 1), (6, 2, 2), (7, 2, 2), (9, 2, 4), (80, 16, 2)])
def test_stage_blocks_is_the_engines_busiest_rank(layers, pp, v):
    """The cost model's busiest pipeline rank holds what the engine's uniform partition gives rank 0."""
    from bunsan.pipeline.partition import Layer, partition
    net = [Layer(("embed",), 1, 0, False)] + [Layer((f"b{i}",), 1, 1, True) for i in range(layers)] + \
        [Layer(("head",), 1, 1, False)]
    chunks = partition(net, pp * v)
    held = [sum(net[i].repeated for c in range(v) for i in chunks[c * pp + r]) for r in range(pp)]
    model = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                        num_attention_heads=8)
    lay = Layout(pp=pp, grad_accum=2 * pp, schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v)
    assert cost.stage_blocks(model, lay) == max(held)


def test_context_parallel_queries_attend_to_the_whole_row():
    """A cp rank's s/cp queries attend to all s keys: its attention core costs 1/cp of the whole row's
    (flash: FLOPs), not 1/cp^2 as attention over its own tokens alone would."""
    s, cp = 4096, 4
    for attention in ("materialized", "flash"):
        whole = compute.block_time(MODEL, Layout(seq_len=s), WIDE, 0.8, attention).attention_forward
        rank = compute.block_time(MODEL, Layout(seq_len=s // cp), WIDE, 0.8, attention, keys=s).attention_forward
        alone = compute.block_time(MODEL, Layout(seq_len=s // cp), WIDE, 0.8, attention).attention_forward
        # a flash kernel runs the rank's s/cp query rows per call at its curve's speed for that length, against
        # the whole row's (a GPU without a measured flash figure: the GEMM efficiency holds a row's own length)
        slower = compute.flash_at(s) / compute.flash_at(s // cp) if attention == "flash" else 1.0
        assert rank == pytest.approx(whole / cp * slower)
        assert alone == pytest.approx(whole / cp ** 2)
    assert step_time(MODEL, Layout(dp=1, cp=cp, seq_len=s), WIDE, FAST, SLOW, 8).compute > \
        step_time(MODEL, Layout(dp=cp, seq_len=s // cp, micro_batch=1), WIDE, FAST, SLOW, 8).compute
