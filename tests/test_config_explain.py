"""Every config key acts, is a listed DeepSpeed key bunsan ignores (said once, with the reason), or is an
error; every key has a one-line description that `bunsan config --explain KEY` prints (`bunsan config` started
as a process: tests/test_cli.py's test_config_launches, formerly test_the_command_line_runs_it here)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

import bunsan
from bunsan.cli.main import main
from bunsan.config import deepspeed_keys
from bunsan.config.deepspeed_keys import ALIASES, IGNORED, IgnoredKeyWarning
from bunsan.config.deepspeed_only import TABLE
from bunsan.config.errors import unwrap
from bunsan.config.explain import entries, walk
from bunsan.config.root import UNIMPLEMENTED, Config, ConfigError
from bunsan.config.sections import Section
from parity import tiny_model

SRC = Path(bunsan.__file__).parent
MAX_DESCRIPTION = 130   # one line of `bunsan config --list` next to the longest key

# Keys no module outside bunsan/config/ reads by attribute, because they are consumed in a way the name
# search below cannot see. Each with the reason and the source text that does the consuming (checked).
CONSUMED = {
    # Config.batch_sizes() (root.py) derives the DeepSpeed triple; the engine reads its BatchSizes
    "train_batch_size": ("engine/engine.py", "cfg.batch_sizes(mesh.dp)"),
    "train_micro_batch_size_per_gpu": ("engine/engine.py", "cfg.batch_sizes(mesh.dp)"),
    "gradient_accumulation_steps": ("engine/engine.py", "cfg.batch_sizes(mesh.dp)"),
    # the whole model section goes to build_config as keyword overrides, field by field
    **{f"model.{name}": ("training/loop.py", "cfg.model.model_dump()") for name in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
        "head_dim")},
}
# A leaf name an ignored key shares with a key that acts: every read must name that other section.
SHARED_LEAF = {"zero_optimization.offload_optimizer.buffer_count": "off_p.buffer_count",
               "hybrid_engine.max_out_tokens": "SPEED_ONLY"}   # (init_inference's own keyword of that name)
# (config that sets a not-built key, the key): one per UNIMPLEMENTED row
NOT_BUILT = [
    ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing.partition_activations"),
    ({"activation_checkpointing": {"cpu_checkpointing": True}}, "activation_checkpointing.cpu_checkpointing"),
]


def _source() -> dict[str, str]:
    return {str(p.relative_to(SRC)): p.read_text() for p in SRC.rglob("*.py") if p.parent.name != "config"}


def _reads(leaf: str, sources: dict[str, str]) -> list[str]:
    """Lines outside bunsan/config/ that read a key by attribute (x.leaf) or by name ("leaf", getattr)."""
    pat = re.compile(rf"\.{leaf}\b|[\"']{leaf}[\"']")
    return [line for text in sources.values() for line in text.splitlines() if pat.search(line)]


def _models() -> set[type]:
    """Every section class: those reachable from Config and every Section subclass (wired in or not)."""
    out, todo = {Config}, [Section]
    while todo:
        cls = todo.pop()
        out.add(cls)
        todo += cls.__subclasses__()
    out |= {sub for _, _, sub in walk() if sub is not None}
    return out


def _description_problems(cls: type) -> list[str]:
    out = []
    for name, f in cls.model_fields.items():
        d = f.description or ""
        if not d.strip() or "\n" in d or len(d) > MAX_DESCRIPTION:
            out.append(f"{cls.__name__}.{name}: {d!r}")
    return out


def test_every_field_has_a_one_line_description():
    problems = [p for cls in _models() for p in _description_problems(cls)]
    assert not problems, "fields need Field(description=...) of one line:\n" + "\n".join(problems)
    assert len(_models()) >= 15


def test_the_description_check_can_fail():
    class Bad(BaseModel):
        described: int = Field(1, description="Fine")
        bare: int = 2
        long: int = Field(3, description="two\nlines")
    assert _description_problems(Bad) == ["Bad.bare: ''", "Bad.long: 'two\\nlines'"]


def test_every_key_acts_is_ignored_with_a_reason_or_is_an_error():
    sources, not_built = _source(), {key for key, _, _ in UNIMPLEMENTED}
    silent = []
    for key, _, sub in walk():
        if sub is not None or key in IGNORED:
            continue   # a section acts through its keys; ignored keys are checked below
        if key in CONSUMED:
            where, text = CONSUMED[key]
            assert text in sources[where], f"{key}: {where} no longer has {text!r}; update CONSUMED"
        elif not _reads(key.rsplit(".", 1)[-1], sources) and key not in not_built:
            silent.append(key)
    assert not silent, ("keys nothing outside bunsan/config/ reads: make them act, add them to "
                        "deepspeed_keys.IGNORED with the reason, or to root.UNIMPLEMENTED: " + ", ".join(silent))


def test_tables_name_real_keys():
    table = entries()
    for key in [*IGNORED, *(k for k, _, _ in UNIMPLEMENTED), *CONSUMED]:
        assert key in table, key
    for key in ALIASES.values():   # a field, or a DeepSpeed key bunsan has no field for
        assert key in table or key in TABLE, key
    for alias in ALIASES:
        assert alias not in table, alias
    assert all(reason.strip() and "\n" not in reason for reason in IGNORED.values())


@pytest.mark.parametrize("key", sorted(IGNORED))
def test_ignored_keys_are_not_read(key):
    *_, leaf = key.split(".")
    reads = _reads(leaf, _source())
    other = SHARED_LEAF.get(key)
    assert all(other and other in line for line in reads), f"{key} is read, so it is not ignored: {reads}"


@pytest.fixture
def fresh_log(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(deepspeed_keys, "_logged", set())


def _setting(key: str) -> dict:
    """A config setting `key` to a value other than its default (inside whatever it needs to be valid)."""
    *parents, leaf = key.split(".")
    cls, cfg = Config, {"zero_optimization": {"stage": 1}}   # stage 1: offload_optimizer is valid
    node = cfg
    for part in parents:
        cls = unwrap(cls.model_fields[part].annotation)
        node = node.setdefault(part, {"device": "cpu"} if part.startswith("offload_") else {})
    default = cls.model_fields[leaf].get_default(call_default_factory=True)
    if unwrap(cls.model_fields[leaf].annotation) is str:
        node[leaf] = "set"
    else:
        node[leaf] = (not default) if isinstance(default, bool) else (default or 0) + 1
    return cfg


@pytest.mark.parametrize("key", sorted(IGNORED))
def test_ignored_key_is_accepted_and_said_once_with_its_reason(key, fresh_log):
    cfg = _setting(key)
    with pytest.warns(IgnoredKeyWarning) as said:
        Config.load(cfg)
    [w] = [w for w in said if key in str(w.message)]
    assert IGNORED[key] in str(w.message) and "accepted and ignored" in str(w.message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Config.load(cfg)                    # once per process
        Config.load(cfg).override({"train.steps": 3})


def test_defaults_and_other_ranks_say_nothing(fresh_log, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Config.load()
        Config.load({"wall_clock_breakdown": False, "zero_optimization": {"stage3_max_reuse_distance": 1e9}})
        monkeypatch.setenv("RANK", "1")
        Config.load({"wall_clock_breakdown": True})


def test_deepspeed_spellings_load_as_bunsan_keys(fresh_log):
    cfg = Config.load({"bfloat16": {"enabled": True},
                       "zero_optimization": {"stage": 3, "max_live_parameters": 1e8, "prefetch_bucket_size": 0}})
    assert cfg.bf16.enabled and cfg.zero_optimization.stage3_max_live_parameters == 100_000_000
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 0
    assert Config.load().override({"bfloat16.enabled": "true"}).bf16.enabled
    with pytest.warns(IgnoredKeyWarning, match="stage3_gather_16bit_weights_on_model_save=true"):
        Config.load({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}})
    with pytest.raises(ConfigError, match="both bfloat16 .* and bf16 are set; keep only bf16"):
        Config.load({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    with pytest.raises(ConfigError, match="unknown config key 'zero_optimization.offload_param.fast_init'"):
        Config.load({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "fast_init": True}}})


@pytest.mark.parametrize("cfg,key", NOT_BUILT, ids=[k for _, k in NOT_BUILT])
def test_not_built_key_is_an_error_naming_it(cfg, key):
    msgs = Config.load(cfg).unimplemented()
    assert len(msgs) == 1 and key in msgs[0] and "set " in msgs[0]
    with pytest.raises(ConfigError, match=re.escape(key)):
        bunsan.initialize(tiny_model(), cfg)


def test_every_not_built_row_is_tested():
    assert sorted(k for _, k in NOT_BUILT) == sorted(k for k, _, _ in UNIMPLEMENTED)


def _explain(capsys, *args) -> tuple[int, str, str]:
    rc = main(["config", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_explain_a_nested_key(capsys):
    rc, out, _ = _explain(capsys, "--explain", "zero_optimization.offload_param.buffer_count")
    assert rc == 0
    assert out.splitlines()[0] == "zero_optimization.offload_param.buffer_count"
    assert "type: integer >= 1" in out and "default: 4" in out and "pinned buffers" in out


def test_explain_an_alias_and_an_ignored_key(capsys):
    rc, out, _ = _explain(capsys, "--explain", "zero_optimization.max_reuse_distance")
    assert rc == 0 and out.startswith("zero_optimization.stage3_max_reuse_distance\n")
    assert "DeepSpeed's other spelling" in out and IGNORED["zero_optimization.stage3_max_reuse_distance"] in out
    rc, out, _ = _explain(capsys, "--explain", "bfloat16")
    assert rc == 0 and out.startswith("bf16 (section)") and "bf16.enabled" in out


def test_explain_a_section_lists_its_keys(capsys):
    rc, out, _ = _explain(capsys, "--explain", "fp16")
    assert rc == 0 and out.startswith("fp16 (section)")
    for key in Config.model_fields["fp16"].annotation.model_fields:
        assert re.search(rf"^    fp16\.{key} +\S", out, re.M), key
    assert "not built" not in out.split("keys:")[0]


def test_explain_a_not_built_key(capsys):
    rc, out, _ = _explain(capsys, "--explain", "activation_checkpointing.partition_activations")
    assert rc == 0 and "not built, an error when set" in out and "set partition_activations to false" in out


def test_explain_a_typo_is_exit_2_with_a_suggestion(capsys):
    rc, _, err = _explain(capsys, "--explain", "zero_optimization.stag")
    assert rc == 2 and "did you mean 'zero_optimization.stage'?" in err
    rc, _, err = _explain(capsys, "--explain", "reduce_bucket_sise")
    assert rc == 2 and "did you mean 'zero_optimization.reduce_bucket_size'?" in err
    rc, _, err = _explain(capsys, "--explain", "enabled")
    assert rc == 2 and "ambiguous" in err and "fp16.enabled" in err


def test_list_has_every_key_once(capsys):
    rc, out, _ = _explain(capsys, "--list")
    keys = [line.split()[0] for line in out.splitlines()]
    assert rc == 0 and keys == list(entries()) and len(keys) == len(set(keys))


def test_config_file_is_printed_resolved(tmp_path, capsys, fresh_log):
    import json
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 16, "bfloat16": {"enabled": True}}))
    rc, out, _ = _explain(capsys, str(tmp_path / "ds.json"))
    assert rc == 0 and json.loads(out) == Config.load({"train_batch_size": 16, "bf16": {"enabled": True}}).to_dict()
    (tmp_path / "part.json").write_text(json.dumps({"activation_checkpointing": {"partition_activations": True}}))
    rc, _, err = _explain(capsys, str(tmp_path / "part.json"))
    assert rc == 2 and "activation_checkpointing.partition_activations" in err

