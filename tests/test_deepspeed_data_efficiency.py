"""data_efficiency's curriculum learning, DeepSpeed's meaning: one curriculum step per global batch, each metric's
difficulty along its schedule (the sequences below are what DeepSpeed 0.19.8's CurriculumScheduler gives for the
same configs), handed with every batch to the script's post-process function; what bunsan does not build
(random-LTD, sampling by difficulty from DataAnalyzer files) is refused naming the key."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bunsan
import bunsan.deepspeed as deepspeed
from bunsan.config.data_efficiency import CurriculumMetric
from bunsan.config.root import Config, ConfigError
from bunsan.deepspeed.curriculum import Curriculum

# schedule -> (DeepSpeed's difficulties at curriculum steps 1..12, at step 100, at step 399)
DEEPSPEEDS = [
    (dict(min_difficulty=8, max_difficulty=1024, schedule_type="fixed_linear",
          schedule_config={"total_curriculum_step": 100, "difficulty_step": 8}),
     [16, 24, 32, 48, 56, 64, 72, 88, 96, 104, 112, 128], 1024, 1024),
    (dict(min_difficulty=80, max_difficulty=2048, schedule_type="fixed_root",
          schedule_config={"total_curriculum_step": 300, "difficulty_step": 16, "root_degree": 2}),
     [192, 240, 272, 304, 320, 352, 368, 400, 416, 432, 448, 464], 1216, 2048),
    (dict(min_difficulty=8, max_difficulty=64, schedule_type="fixed_discrete",
          schedule_config={"difficulty": [8, 16, 64], "max_step": [5, 12]}),
     [8, 8, 8, 8, 8, 16, 16, 16, 16, 16, 16, 16], 64, 64),
    (dict(min_difficulty=5, max_difficulty=100, schedule_type="fixed_linear",
          schedule_config={"total_curriculum_step": 37, "difficulty_step": 8}),
     [8, 8, 8, 8, 16, 16, 16, 24, 24, 24, 32, 32], 100, 100),
]


@pytest.mark.parametrize("schedule,first,at100,at399", DEEPSPEEDS, ids=lambda v: str(v)[:30])
def test_schedules_give_deepspeeds_difficulties(schedule, first, at100, at399):
    curriculum = Curriculum({"m": CurriculumMetric(difficulty_type="value", clustering_type="single_cluster",
                                                   **schedule)})
    got = []
    for _ in range(399):
        curriculum.advance()
        got.append(curriculum.current["m"])
    assert got[:12] == first and got[99] == at100 and got[398] == at399


def _config(schedule_type="fixed_linear", **extra):
    metric = {"min_difficulty": 8, "max_difficulty": 32, "schedule_type": schedule_type, "difficulty_type": "value",
              "clustering_type": "single_cluster", "index_to_sample_path": "unused", "index_to_metric_path": "unused",
              "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 8}, **extra}
    return {"train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_print": 100,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "data_efficiency": {"enabled": True, "seed": 1234, "data_sampling": {
                "enabled": True, "num_workers": 0, "curriculum_learning": {
                    "enabled": True, "data_cluster_path": "/tmp/clusters",
                    "curriculum_metrics": {"seqlen_truncate": metric}}}}}


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 50, (16, 32), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)

    def forward(self, input_ids):
        logits = self.head(self.embed(input_ids[:, :-1]))
        return F.cross_entropy(logits.reshape(-1, 50), input_ids[:, 1:].reshape(-1))


def _truncate(batch, state):
    return {"input_ids": batch["input_ids"][:, :state["current_difficulties"]["seqlen_truncate"]]}


def test_the_script_truncates_to_the_difficulty_and_trains_as_a_plain_loop_on_the_cut_batches(tmp_path):
    engine, _, loader, _ = deepspeed.initialize(model=TinyLM(), config=_config(), training_data=Tokens())
    seen = []
    engine.set_data_post_process_func(lambda b, s: seen.append(dict(s)) or _truncate(b, s))
    losses = []
    for i, batch in enumerate(loader):
        loss = engine(batch["input_ids"])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if i == 5:
            break
    steps = [(s["curriculum_step"], s["current_difficulties"]["seqlen_truncate"]) for s in seen]
    assert steps == [(1, 8), (1, 8), (2, 16), (2, 16), (3, 16), (3, 16)]   # 2 micro-batches per global batch
    # the same cut batches through a plain loop (SGD, mean over the step's micro-batches)
    ref, opt = TinyLM(), None
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    order = list(torch.utils.data.DistributedSampler(Tokens(), num_replicas=1, rank=0))
    data = Tokens()
    want = []
    for step in range(3):
        opt.zero_grad()
        for micro in range(2):
            rows = order[(2 * step + micro) * 2:(2 * step + micro + 1) * 2]
            ids = torch.stack([data[r]["input_ids"] for r in rows])[:, :steps[2 * step][1]]
            loss = ref(ids)
            want.append(loss.item())
            (loss / 2).backward()
        opt.step()
    assert losses == pytest.approx(want, rel=1e-5)
    engine.save_checkpoint(tmp_path)
    other, _, other_loader, _ = deepspeed.initialize(model=TinyLM(), config=_config(), training_data=Tokens())
    other.load_checkpoint(tmp_path)
    assert other_loader.curriculum.state_dict() == {"curriculum_step": 3,
                                                    "current_difficulties": {"seqlen_truncate": 16}}


def test_custom_schedule_comes_from_the_script():
    engine, _, loader, _ = deepspeed.initialize(model=TinyLM(), config=_config("custom"), training_data=Tokens())
    with pytest.raises(RuntimeError, match="set_custom_curriculum_learning_schedule"):
        next(iter(loader))
    engine.set_custom_curriculum_learning_schedule({"seqlen_truncate": lambda step: 8 * step})
    states = []
    engine.set_data_post_process_func(lambda b, s: states.append(s["current_difficulties"]["seqlen_truncate"]) or b)
    for _, _ in zip(range(6), loader):
        pass
    assert states[-1] >= 8 and states == sorted(states)


@pytest.mark.parametrize("change,key", [
    ({"clustering_type": "schedule_based"}, "clustering_type"),
    ({"difficulty_type": "percentile"}, "clustering_type"),
    ({"schedule_config": {"total_curriculum_step": 6}}, "schedule_config.difficulty_step"),
    ({"min_difficulty": 64}, "min_difficulty"),
])
def test_what_is_not_built_or_malformed_is_refused_naming_the_key(change, key):
    raw = _config()
    raw["data_efficiency"]["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["seqlen_truncate"] |= change
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Config.load(raw)


def test_random_ltd_and_curricula_without_their_loader_are_refused():
    with pytest.raises(ConfigError, match="random_ltd"):
        Config.load({"data_efficiency": {"enabled": True, "data_routing": {"enabled": True,
                                                                            "random_ltd": {"enabled": True}}}})
    with pytest.raises(ValueError, match="pass training_data"):
        deepspeed.initialize(model=TinyLM(), config=_config())
    with pytest.raises(ValueError, match="no such loader"):
        bunsan.initialize(TinyLM(), _config())
    off = _config()
    off["data_efficiency"]["enabled"] = False
    engine, *_ = deepspeed.initialize(model=TinyLM(), config=off)
    with pytest.raises(RuntimeError, match="no curriculum"):
        engine.set_data_post_process_func(_truncate)
