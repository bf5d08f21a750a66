"""Config files are read bounded: nothing a file holds can hang the loader, fill memory or be kept silently."""

from __future__ import annotations

import os

import pytest

from bunsan.config.errors import ConfigError, show
from bunsan.config.root import Config


def test_yaml_aliases_are_refused_quickly(tmp_path):
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"] + \
        [f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
         f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]" for i in range(9)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\ntrain_batch_size: *j\n")
    # refused at the first alias met (line 2), as it is composed: nothing was expanded
    with pytest.raises(ConfigError, match=r"aliases \(\*name\) are not accepted(.|\n)*line 2, column 8:"):
        Config.load(bomb)


def test_deep_json_is_a_message_not_a_traceback(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match="nested too deeply|could not be read"):
        Config.load(deep)


def test_duplicate_json_keys_are_refused(tmp_path):
    f = tmp_path / "dup.json"
    f.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match="'train_batch_size' appears twice"):
        Config.load(f)


@pytest.mark.parametrize("name, text", [("e.yaml", ""), ("n.json", "null"), ("e.toml", "  \n"), ("n.yaml", "~")])
def test_an_empty_config_file_is_refused(tmp_path, name, text):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ConfigError, match="is empty"):
        Config.load(f)


def test_a_named_pipe_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "c.json"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        Config.load(fifo)


def test_values_are_cut_before_they_are_printed():
    huge = {"k": [list(range(1000))] * 1000}
    assert len(show(huge)) <= 60
    assert len(show("x" * 10 ** 6)) <= 60


def test_settings_that_would_do_nothing_are_said():
    with pytest.raises(ConfigError, match="no validation split"):
        Config.load({"train": {"eval_interval": 10}, "data": {"val_fraction": 0.0}})
    from bunsan.config import deepspeed_keys
    deepspeed_keys._logged.discard("activation_checkpointing")
    with pytest.warns(deepspeed_keys.IgnoredKeyWarning, match="nothing is recomputed"):
        Config.load({"activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False}})


def test_a_damaged_data_position_is_refused():
    import numpy as np
    from bunsan.training.data import TokenBatches
    batches = TokenBatches(np.arange(4096, dtype=np.int32), 16, 2, 0, 1, seed=0)
    state = batches.state_dict()
    for bad in (-3, "7", 1.5, True):
        with pytest.raises(ValueError, match="not a non-negative integer"):
            batches.load_state_dict({**state, "position": bad})


def test_a_bunsan_toml_refuses_unknown_keys_at_every_depth(tmp_path):
    """bunsan's own format: every table is typed, and its free-form mappings list the keys they hold."""
    typed, free = tmp_path / "typed.toml", tmp_path / "free.toml"
    typed.write_text("[train]\nsteps = 10\n\n[zero_optimization]\nstage = 3\n\n[zero_optimization.offload_param]\n"
                     "device = \"none\"\npin_memroy = true\n")
    free.write_text("[data.fields]\npromt = \"question\"\n\n"
                    "[data_efficiency.data_sampling.curriculum_learning.curriculum_metrics.seqlen_truncate]\n"
                    "min_difficulty = 8\nmax_difficulty = 64\nschedule_type = \"fixed_linear\"\n"
                    "schedule_config = {total_curriculum_step = 10, difficulty_step = 8, difficulty_stp = 8}\n")
    metric = "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics.seqlen_truncate.schedule_config"
    for f, wrong in [(typed, [("zero_optimization.offload_param.pin_memroy",
                               "zero_optimization.offload_param.pin_memory")]),
                     (free, [("data.fields.promt", "data.fields.prompt"),
                             (f"{metric}.difficulty_stp", f"{metric}.difficulty_step")])]:
        with pytest.raises(ConfigError) as info:
            Config.load(f)
        msg = str(info.value)
        assert msg.startswith(f"config file '{f}': ")
        for key, meant in wrong:
            assert f"unknown config key '{key}' (did you mean '{meant}'?)" in msg


def test_data_fields_takes_the_roles_records_have():
    from bunsan.config.bunsan_sections import FIELD_ROLES
    from bunsan.training.examples import DEFAULT_FIELDS
    assert set(FIELD_ROLES) == set(DEFAULT_FIELDS)
    assert Config.load({"data": {"fields": {"prompt": "question", "completion": "answer"}}}).data.fields == {
        "prompt": "question", "completion": "answer"}
    with pytest.raises(ConfigError, match=r"^unknown config key 'data.fields.answer'; remove it or use one of: text, "):
        Config.load({"data": {"fields": {"answer": "completion"}}})
