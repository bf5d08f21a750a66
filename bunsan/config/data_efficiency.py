"""DeepSpeed's `data_efficiency` section: its curriculum learning, as far as bunsan builds it.

DeepSpeed's data sampler raises each curriculum metric's difficulty along a schedule, one curriculum step per
global batch, and hands the current difficulties to the script's post-process function with every batch
(`engine.set_data_post_process_func(fn)`; DeepSpeedExamples truncates or reshapes sequences to the
`seqlen_truncate` / `seqlen_reshape` difficulty there). bunsan builds that for metrics of one cluster (every
sample eligible at every step: the sequence-length curricula), with the fixed_linear, fixed_root,
fixed_discrete and custom schedules. Metrics that pick samples by difficulty need DeepSpeed's offline
DataAnalyzer index files, and random layer-token drop (data_routing) changes the model: both are refused,
naming the key.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from bunsan.config.errors import Rule, show
from bunsan.config.sections import Int, Section

SCHEDULES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")


class CurriculumMetric(Section):
    """One metric's curriculum: its difficulty from min to max along a schedule (DeepSpeed's keys)."""
    index_to_sample_path: Optional[str] = Field(None, description="DeepSpeed: DataAnalyzer's index of samples by "
                                                "difficulty; needed by clustering_type schedule_based (not built)")
    index_to_metric_path: Optional[str] = Field(None, description="DeepSpeed: DataAnalyzer's index of difficulty "
                                                "values; needed by clustering_type schedule_based (not built)")
    difficulty_type: Literal["value", "percentile"] = Field("value", description="Difficulties as metric values "
                                                            "(value) or as percentiles of the data (percentile)")
    clustering_type: Literal["single_cluster", "schedule_based"] = Field(
        "single_cluster", description="single_cluster: every sample at every step, the difficulty only reaches "
        "the post-process function (sequence-length curricula)")
    min_difficulty: Int = Field(..., ge=0, description="The difficulty at curriculum step 0")
    max_difficulty: Int = Field(..., ge=0, description="The difficulty the schedule rises to")
    schedule_type: Literal[SCHEDULES] = Field(..., description="fixed_linear, fixed_root (root_degree), "
                                              "fixed_discrete (difficulty, max_step) or custom (set by the script)")
    schedule_config: dict[str, Any] = Field(default_factory=dict, description="total_curriculum_step, "
                                            "difficulty_step, root_degree, or difficulty and max_step lists")

    @model_validator(mode="after")
    def _built(self) -> CurriculumMetric:
        problems, cfg = [], self.schedule_config
        if self.clustering_type != "single_cluster" or self.difficulty_type != "value":
            problems.append(("clustering_type", f"{show(self.clustering_type)} with difficulty_type "
                             f"{show(self.difficulty_type)}: sampling by difficulty needs DeepSpeed's offline "
                             "DataAnalyzer index files, which bunsan does not build; use single_cluster / value "
                             "(the sequence-length curricula)"))
        if self.min_difficulty > self.max_difficulty:
            problems.append(("min_difficulty", f"{self.min_difficulty} is above max_difficulty "
                                               f"{self.max_difficulty}; swap them"))
        need = {"fixed_linear": ("total_curriculum_step", "difficulty_step"),
                "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
                "fixed_discrete": ("difficulty", "max_step"), "custom": ()}[self.schedule_type]
        problems += [(f"schedule_config.{k}", f"missing: schedule_type {self.schedule_type} needs {', '.join(need)}")
                     for k in need if k not in cfg]
        if self.schedule_type == "fixed_discrete" and all(k in cfg for k in need) and \
                len(cfg["max_step"]) != len(cfg["difficulty"]) - 1:
            problems.append(("schedule_config.max_step", f"has {len(cfg['max_step'])} entries; it needs one fewer "
                                                         f"than difficulty ({len(cfg['difficulty'])})"))
        if problems:
            raise Rule(*problems)
        return self


class CurriculumLearning(Section):
    """data_sampling.curriculum_learning: the metrics and their schedules."""
    enabled: bool = Field(False, description="Raise each metric's difficulty per global batch and pass it to "
                                             "the post-process function (DeepSpeed's meaning)")
    data_cluster_path: Optional[str] = Field(None, description="DeepSpeed: where its sampler writes data clusters; "
                                             "accepted and ignored (single-cluster metrics make none)")
    curriculum_metrics: dict[str, CurriculumMetric] = Field(default_factory=dict, description="metric name -> "
                                                            "its curriculum (seqlen_truncate, seqlen_reshape, ...)")


class DataSampling(Section):
    """data_efficiency.data_sampling: DeepSpeed's sampler options."""
    enabled: bool = Field(False, description="Use the curriculum below (DeepSpeed's meaning)")
    num_workers: Int = Field(0, ge=0, description="DataLoader worker processes of the training loader")
    curriculum_learning: CurriculumLearning = Field(default_factory=CurriculumLearning,
                                                    description=CurriculumLearning.__doc__)


class DataEfficiency(Section):
    """DeepSpeed's data efficiency library: curriculum learning (single-cluster metrics) and random-LTD (not built)."""
    enabled: bool = Field(False, description="Turn the library on (DeepSpeed's meaning)")
    seed: Int = Field(1234, description="DeepSpeed: its sampler's seed; bunsan's loader shuffles with the "
                                        "DistributedSampler's seed, as without data_efficiency")
    data_sampling: DataSampling = Field(default_factory=DataSampling, description=DataSampling.__doc__)
    data_routing: dict[str, Any] = Field(default_factory=dict, description="DeepSpeed's random layer-token drop "
                                         "(random_ltd); not built: enabled true is an error")

    @model_validator(mode="after")
    def _built(self) -> DataEfficiency:
        routing = self.data_routing
        if self.enabled and (routing.get("enabled") or routing.get("random_ltd", {}).get("enabled")):
            raise Rule(("data_routing", "random layer-token drop (random_ltd) is not built: it drops tokens "
                                        "inside the model's layers; set data_routing.enabled false"))
        return self

    def curriculum(self) -> dict[str, CurriculumMetric]:
        """The metrics whose curriculum acts (empty unless every enabled switch on the way is on)."""
        sampling = self.data_sampling
        if not (self.enabled and sampling.enabled and sampling.curriculum_learning.enabled):
            return {}
        return dict(sampling.curriculum_learning.curriculum_metrics)
