"""benchmarks/bench_hf_blocks.py, which checks what `bunsan plan` assumes of a Llama-form transformers model (its step
priced as bunsan's Llama of its shape): it builds every model with the same dimensions and times them (its figures
go to RESULTS.md, not here)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
pytest.importorskip("transformers")


@pytest.mark.parametrize("head_dim", [None, 32], ids=["hidden-over-heads", "head-dim-apart"])
def test_the_models_compared_have_the_same_shape(head_dim):
    import bench_hf_blocks
    dims = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, head_dim=head_dim)
    built = {name: build() for name, build in bench_hf_blocks.models(dims).items()}
    assert {"bunsan Llama", "transformers Llama", "transformers Qwen2", "transformers Mistral",
            "transformers Qwen3"} <= set(built)
    llama = dict(built["bunsan Llama"].named_parameters())
    for name, model in built.items():
        from bunsan.estimator.shape import transformers_shape
        if name != "bunsan Llama":     # a Llama-form model, priced as the bunsan Llama built beside it
            assert transformers_shape(model).timed_as(128) is not None, name
        shapes = sorted(tuple(p.shape) for n, p in model.named_parameters()     # (Qwen2's q/k/v biases, Qwen3's
                        if not n.endswith((".bias", "q_norm.weight", "k_norm.weight")))  # q/k norms aside)
        tied = name == "transformers Gemma"           # (Gemma's head is its embedding)
        want = [tuple(p.shape) for n, p in llama.items() if not (tied and n == "lm_head.weight")]
        assert shapes == sorted(want), name


def test_the_benchmark_times_each_model_against_bunsans_llama(capsys):
    import bench_hf_blocks
    assert bench_hf_blocks.main(["--hidden", "64", "--layers", "1", "--heads", "4", "--vocab", "256", "--rows", "2",
                                 "--seq", "16", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "| bunsan Llama | " in out and " | 1.000 |" in out
    for name in ("transformers Llama", "transformers Qwen2", "transformers Mistral"):
        assert f"| {name} | " in out
