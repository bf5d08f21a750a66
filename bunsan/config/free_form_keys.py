"""The typed tree's mappings whose keys pydantic leaves unchecked (its dict fields), with the keys each may hold.
A typo in one would otherwise pass without a word: data.fields {promt: ...} would train on the default field."""

from __future__ import annotations

from typing import Any

from bunsan.config import deepspeed_shapes as shapes
from bunsan.config.bunsan_sections import FIELD_ROLES
from bunsan.config.key_shapes import Shape, found_at, keys, unknown_keys

# dotted key (a * part: any name) -> the keys its mapping may hold; optimizer.params and scheduler.params are
# checked against the optimizer's and the schedule's own parameters where they are read
FREE_FORM: dict[str, Shape] = {
    "data.fields": keys(*FIELD_ROLES),
    "data_efficiency.data_routing": shapes.DATA_ROUTING,
    "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics.*.schedule_config": shapes.SCHEDULE_CONFIG,
}


def unknown_in_free_form(data: Any) -> list[tuple[str, str]]:
    """(dotted key, message) for each key of the mappings above that they do not hold, at any depth."""
    return [p for pattern, shape in FREE_FORM.items() for path, value in found_at(data, pattern)
            for p in unknown_keys(path, value, shape)]
