"""Partial rollouts on CPU (trainer.partial_rollout, keel's native engine): a step's round ends when
its batch is complete and the samples still generating go on under the next policy; their earlier
tokens and log-probs stay as sampled; no trained token is more than max_off_policy_steps versions
old; a resumed run neither loses nor repeats a prompt."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from keel.api import train
from keel.config.load import load_config, load_run
from keel.data.prompts import build_prompt_dataset
from keel.data.sampler import ResumableSampler
from keel.distributed.rollout_worker import continue_samples
from keel.errors import INCOMPATIBLE_OPTIONS, KeelError
from keel.models.load import load_causal_lm, load_tokenizer
from keel.rollout.hf import HFRolloutEngine
from keel.rollout.native import NativeRolloutEngine
from keel.trainer import ahead, partial, rl
from keel.trainer.versions import policy_version
from keel.types import PartialSample, RoundEnd, SamplingParams

RESPONSE = 64


def run_config(
    tiny_config, tmp_path: Path, name: str, model: Path, steps: int = 4, **trainer
) -> dict:
    settings = {
        "total_training_steps": steps,
        "save_freq": steps,
        "test_freq": -1,
        "val_before_train": False,
    }
    settings.update({"mode": "async", "partial_rollout": True, **trainer})
    config = dict(
        tiny_config,
        trainer={**tiny_config["trainer"], **settings, "default_local_dir": str(tmp_path / name)},
        data={**tiny_config["data"], "max_response_length": RESPONSE},
    )
    config["actor_rollout_ref"] = {
        **tiny_config["actor_rollout_ref"],
        # lengths stay as they start
        "actor": {**tiny_config["actor_rollout_ref"]["actor"], "optim": {"lr": 1e-5}},
        "model": {"path": str(model)},
        "rollout": {**tiny_config["actor_rollout_ref"]["rollout"], "name": "native"},
    }
    return config


def metrics_of(run_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"step": 0' not in line
    ]


@pytest.fixture
def trained(monkeypatch):
    """Per step trained: (the step, the batch, its prompts' dataset rows in order)."""
    seen = []
    for kind in (partial.RolloutPartial, ahead.RolloutWithin):

        def recording(self, timer, step, real=kind.__call__):
            samples = real(self, timer, step)
            batch = samples.batch
            seen.append((step, batch, list(dict.fromkeys(r.index for r in batch.records))))
            return samples

        monkeypatch.setattr(kind, "__call__", recording)
    return seen


def token_staleness(cfg_steps_version, batch) -> torch.Tensor:
    """[N, R] how many versions each trained token is older than the policy its update starts
    from."""
    return (cfg_steps_version - batch.token_versions)[batch.response_mask.bool()]


@pytest.mark.parametrize("bound", [1, 2])
def test_cut_samples_go_on_and_no_trained_token_passes_the_bound(
    tiny_config, tmp_path, ending_model, trained, bound
):
    config = run_config(
        tiny_config, tmp_path, f"k{bound}", ending_model, steps=8, max_off_policy_steps=bound
    )
    run_dir = train(config).run_dir
    cfg = load_config(config)
    for step, batch, _ in trained:
        assert int(token_staleness(policy_version(cfg, step - 1), batch).max()) <= bound
        # whole groups
        assert len(set(batch.group_index.tolist())) == config["data"]["train_batch_size"]
    metrics = metrics_of(run_dir)
    assert max(m["async/staleness/max"] for m in metrics) <= bound
    # (with more batches under way, the younger ones rarely outlast the oldest on so few samples)
    if bound == 1:
        # samples whose tokens came from two policies trained
        assert any(m["async/partial"] > 0 for m in metrics)
        newest = [
            b.token_versions.masked_fill(~b.response_mask.bool(), -1).amax(-1)
            for _, b, _ in trained
        ]
        assert any((last > b.policy_version).any() for last, (_, b, _) in zip(newest, trained))
    assert sum(m["async/dropped"] for m in metrics) == 0
    # wait: a step trains the oldest batch drawn, so each step's prompts are the synchronous run's
    partial_prompts = [rows for _, _, rows in trained]
    trained.clear()
    sync = {
        **config["trainer"],
        "mode": "sync",
        "partial_rollout": False,
        "default_local_dir": str(tmp_path / "sync"),
    }
    train(dict(config, trainer=sync))
    assert partial_prompts == [rows for _, _, rows in trained]


def test_wait_trains_the_oldest_batch_however_slow_and_drops_nothing(tiny_config):
    """Bound 2, a batch of one group: groups 0 and 1 (version 0) are still generating while group 2
    (version 1) has finished. wait's round waits for the oldest (group 0) and the step trains it."""
    tiny_config["trainer"].update(
        {"mode": "async", "partial_rollout": True, "max_off_policy_steps": 2}
    )
    rollout = object.__new__(partial.RolloutPartial)
    rollout.cfg, rollout.bound, rollout.groups_per_batch, rollout.dropped = (
        load_config(tiny_config),
        2,
        1,
        0,
    )
    rollout.drop, rollout.row_of, rollout.sampler = (
        False,
        {0: 7, 1: 8, 2: 9},
        ResumableSampler(16, 4, seed=0),
    )
    rollout.scoring = {}
    record = object()
    rollout.pool = [
        PartialSample(0, record, [1], [-1.0], [0]),
        PartialSample(1, record, [1], [-1.0], [0]),
        PartialSample(2, record, [1], [-1.0], [1], finished=True),
    ]
    oldest = frozenset([0])
    # the round goes on until group 0 has finished
    assert not rollout._reached(RoundEnd(groups=oldest))
    rollout.pool[0].finished = True
    taken, dropped = rollout._take(oldest, set(), 1)
    assert (
        [s.group for s in taken] == [0]
        and dropped == 0
        and [s.group for s in rollout.pool] == [1, 2]
    )
    # the sampler's rows of the groups under way
    assert rollout.resume_state()[1]["pool_prompts"] == [8, 9]


def test_drop_trains_whole_batches_within_the_bound_and_accounts_for_every_sample(
    tiny_config, tmp_path, ending_model, trained, monkeypatch
):
    drawn = []
    real_next = ResumableSampler.next_batch
    monkeypatch.setattr(ResumableSampler, "next_batch", lambda self: _draw(self, real_next, drawn))
    config = run_config(
        tiny_config, tmp_path, "drop", ending_model, steps=6, off_policy_strategy="drop"
    )
    run_dir = train(config).run_dir
    cfg = load_config(config)
    n, batch_size = config["actor_rollout_ref"]["rollout"]["n"], config["data"]["train_batch_size"]
    for step, batch, _ in trained:
        assert int(token_staleness(policy_version(cfg, step - 1), batch).max()) <= 1
        assert len(batch) == batch_size * n
    metrics = metrics_of(run_dir)
    # whole groups
    assert all(m["async/dropped"] % n == 0 for m in metrics)
    # every sample drawn was trained, dropped, or is still under way
    accounted = (
        sum(len(b) for _, b, _ in trained)
        + sum(m["async/dropped"] for m in metrics)
        + metrics[-1]["async/in_flight"]
    )
    assert accounted == len(drawn) * n


def _draw(sampler, real_next, drawn: list) -> list[int]:
    rows = real_next(sampler)
    drawn.extend(rows)
    return rows


def test_a_step_trains_the_due_groups_first_and_drop_drops_the_due_ones_unfinished(tiny_config):
    """Step 2, bound 1: the next step's update starts from version 2, so groups sampled from version
    0 are due. Group 1 (version 1, finished) is older in the pool than group 2 (version 0,
    finished), but group 2 is due: it trains first. Group 3 (version 0, unfinished) is due too:
    dropped. Group 0 (version 1) waits."""
    tiny_config["trainer"].update(
        {"mode": "async", "partial_rollout": True, "off_policy_strategy": "drop"}
    )
    rollout = object.__new__(partial.RolloutPartial)
    rollout.cfg, rollout.bound, rollout.groups_per_batch, rollout.dropped = (
        load_config(tiny_config),
        1,
        1,
        0,
    )
    rollout.drop, rollout.row_of, rollout.scoring = True, {}, {}
    rollout.rollout = SimpleNamespace(
        components=SimpleNamespace(workers=SimpleNamespace(policy_version=1))
    )
    record = object()
    rollout.pool = [
        PartialSample(0, record, [1], [-1.0], [1]),
        PartialSample(1, record, [1], [-1.0], [1], finished=True),
        PartialSample(2, record, [1], [-1.0], [0], finished=True),
        PartialSample(3, record, [1], [-1.0], [0]),
    ]
    # step 2 updates the policy to version 2
    due = rollout._due(updates=1)
    assert due == {2, 3}
    taken, dropped = rollout._take(frozenset(), due, 1)
    assert (
        [s.group for s in taken] == [2]
        and dropped == 1
        and [s.group for s in rollout.pool] == [0, 1]
    )


def test_a_partial_rollouts_tokens_and_log_probs_are_unchanged_by_the_update_it_spans(ending_model):
    """One round cut a group part-way; the weights change; the next round continues it: the tokens
    and log-probs of the first round are kept as sampled (version 0), the rest are the new policy's
    (version 1), and each token's log-prob is the one its own policy gives it."""
    tokenizer = load_tokenizer(ending_model)
    model = load_causal_lm(ending_model, torch.device("cpu"))
    engine = NativeRolloutEngine(model, tokenizer, 64, torch.float32)
    records, _ = build_prompt_dataset(
        [{"prompt": "Digits please: 1"}, {"prompt": "x y"}], tokenizer, max_prompt_length=64
    )
    sampling = SamplingParams(max_new_tokens=40)
    # group 0 needs one more token; group 1 starts: the round ends once group 0 has finished (1
    # token)
    almost = PartialSample(0, records[0], ids=[5] * 39, log_probs=[-1.0] * 39, versions=[0] * 39)
    fresh = [PartialSample(1, records[1]) for _ in range(3)]
    first, _ = continue_samples(
        engine, [almost, *fresh], sampling, seed=1, version=0, end=RoundEnd(count=1)
    )
    assert first[0].finished and len(first[0].ids) == 40
    cut = [s for s in first[1:] if not s.finished]
    assert cut and all(s.ids and set(s.versions) == {0} for s in cut)

    old_model = load_causal_lm(ending_model, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.sync_weights(model)
    second, _ = continue_samples(
        engine, cut, sampling, seed=2, version=1, end=RoundEnd(groups=frozenset({1}))
    )
    for before, after in zip(cut, second):
        assert after.finished
        k = len(before.ids)
        # kept as sampled
        assert after.ids[:k] == before.ids and after.log_probs[:k] == before.log_probs
        assert after.versions == [0] * k + [1] * (len(after.ids) - k)
        context = torch.tensor([before.record.prompt_ids + after.ids])
        p = len(before.record.prompt_ids)
        for policy, part in ((old_model, slice(0, k)), (model, slice(k, None))):
            with torch.no_grad():
                logits = policy(context).logits[0, p - 1 : -1].float()
            expected = logits.log_softmax(-1).gather(-1, torch.tensor(after.ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(after.log_probs)[part], expected[part], atol=1e-4)


def test_an_engine_that_cannot_cut_is_refused_with_a_code(ending_model):
    tokenizer = load_tokenizer(ending_model)
    engine = HFRolloutEngine(load_causal_lm(ending_model, torch.device("cpu")), tokenizer, 8)
    records, _ = build_prompt_dataset([{"prompt": "x"}], tokenizer, max_prompt_length=64)
    with pytest.raises(KeelError) as refused:
        continue_samples(
            engine, [PartialSample(0, records[0])], SamplingParams(), 0, 0, RoundEnd(count=1)
        )
    assert (
        refused.value.code == INCOMPATIBLE_OPTIONS and "partial_rollout=false" in refused.value.fix
    )


@pytest.mark.parametrize("filtered", [False, True])
def test_a_resumed_partial_run_neither_loses_nor_repeats_a_prompt(
    tiny_config, tmp_path, ending_model, trained, monkeypatch, filtered
):
    """Stopped during step 3 after a checkpoint at step 2, then resumed: the same prompts each step
    as a run that never stopped. `filtered`: overlong prompts dropped first, so the sampler's rows
    are not the data's (the checkpoint keeps the sampler's)."""
    if filtered:
        rows = [
            json.loads(line)
            for line in Path(tiny_config["data"]["train_files"][0]).read_text().splitlines()
        ]
        long = [dict(rows[0], prompt="x " * 80) for _ in range(3)]
        data = tmp_path / "with_long.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in long + rows))
        tiny_config["data"].update({"train_files": [str(data)], "filter_overlong_prompts": True})
    settings = {"save_freq": 2}
    train(run_config(tiny_config, tmp_path, "straight", ending_model, **settings))
    straight = [rows for _, _, rows in trained]
    trained.clear()
    real_step = rl.RLTrainer.train_step

    def stop_at_step_3(self, logger):
        if self.step == 3:
            raise KeyboardInterrupt
        return real_step(self, logger)

    stopped = run_config(tiny_config, tmp_path, "stopped", ending_model, **settings)
    monkeypatch.setattr(rl.RLTrainer, "train_step", stop_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        train(stopped)
    monkeypatch.setattr(rl.RLTrainer, "train_step", real_step)
    state = torch.load(
        tmp_path / "stopped" / "global_step_2" / "trainer_state.pt", weights_only=False
    )
    n, batch = (
        tiny_config["actor_rollout_ref"]["rollout"]["n"],
        tiny_config["data"]["train_batch_size"],
    )
    # batch 3's, under way
    assert len(state["pool_prompts"]) == batch and state["in_flight_dropped"] == batch * n
    train(stopped)
    assert [s for s, _, _ in trained] == [1, 2, 3, 4]
    # each prompt once, in the same order
    assert [rows for _, _, rows in trained] == straight


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"trainer": {"partial_rollout": True}}, "trainer.mode=sync"),
        (
            {"trainer": {"mode": "async", "partial_rollout": True, "max_off_policy_steps": 0}},
            "max_off_policy_steps=0",
        ),
        (
            {"trainer": {"mode": "async", "off_policy_strategy": "drop"}},
            "without trainer.partial_rollout",
        ),
        (
            {"trainer": {"mode": "async", "partial_rollout": True}, "rollout": {"name": "hf"}},
            "rollout.name=hf",
        ),
        (
            {
                "trainer": {"mode": "async", "partial_rollout": True},
                "rollout": {"multi_turn": {"enable": True}},
            },
            "multi-turn or agent",
        ),
    ],
)
def test_partial_rollouts_refuse_what_they_cannot_do_with_the_fix(tiny_config, settings, named):
    tiny_config["trainer"].update(settings["trainer"])
    tiny_config["actor_rollout_ref"]["rollout"].update(settings.get("rollout", {}))
    with pytest.raises(KeelError) as refused:
        load_config(tiny_config)
    assert refused.value.code == INCOMPATIBLE_OPTIONS and named in refused.value.message
    assert refused.value.fix.startswith("set `")


def test_keel_check_explains_partial_rollouts(tiny_config):
    from keel.check.preflight import run_checks

    tiny_config["trainer"].update(
        {"mode": "async", "partial_rollout": True, "off_policy_strategy": "drop"}
    )
    report = run_checks(*load_run(tiny_config))
    assert "async with partial rollouts: 2 batches of 16 samples are under way" in report.plan_text
    assert (
        "no token more than 1 policy version old (drop: a group that would pass it is dropped"
        in report.plan_text
    )


HALF_WITH_SIGNAL = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Prompts with an even ground truth score 0 for every response: no signal, which DAPO drops."""
    return float(int(ground_truth) % 2 and len(solution_str) % 2)
'''


def test_dynamic_sampling_in_async_mode_refills_from_more_rounds(
    tiny_config, tmp_path, ending_model, trained, monkeypatch
):
    """DAPO with partial rollouts: half the prompts carry no signal, so a step runs rounds (with the
    same policy, the pool refilled) until a batch of groups with one has finished, each round a
    whole batch."""
    wanted, real_round = [], partial.RolloutPartial._round

    def round_wanting(self, timer, seed, updates, count):
        wanted.append(count)
        return real_round(self, timer, seed, updates, count)

    monkeypatch.setattr(partial.RolloutPartial, "_round", round_wanting)
    reward = tmp_path / "half.py"
    reward.write_text(HALF_WITH_SIGNAL)
    config = run_config(tiny_config, tmp_path, "dapo", ending_model, steps=4)
    config["custom_reward_function"] = {"path": str(reward)}
    config["algorithm"] = {**config["algorithm"], "filter_groups": {"enable": True}}
    run_dir = train(config).run_dir
    cfg = load_config(config)
    for step, batch, rows in trained:
        # odd: a signal
        assert len(rows) == config["data"]["train_batch_size"] and all(row % 2 for row in rows)
        assert int(token_staleness(step - 1, batch).max()) <= cfg.trainer.max_off_policy_steps
    metrics = metrics_of(run_dir)
    assert any(m["dynamic_sampling/gen_batches"] > 1 for m in metrics)
    assert all(
        m["dynamic_sampling/kept_prompt_ratio"] < 1
        for m in metrics
        if m["dynamic_sampling/gen_batches"] > 1
    )
    per_batch = config["data"]["train_batch_size"]
    # DAPO's rounds each a whole batch, as its sync steps generate
    assert set(wanted) == {per_batch}


def test_verls_fully_async_recipe_keys_map_to_keels_or_are_refused_by_name(tiny_config):
    """verl's fully_async_ppo_trainer.yaml: partial_rollout and use_rollout_log_probs are keel's own
    keys under other names; its staleness threshold (a share of a batch) is refused, pointing at
    keel's bound."""
    tiny_config["trainer"]["mode"] = "async"
    tiny_config["async_training"] = {
        "partial_rollout": True,
        "use_rollout_log_probs": True,
        "require_batches": 1,
    }
    cfg = load_config(tiny_config)
    assert cfg.trainer.partial_rollout and cfg.algorithm.rollout_correction.bypass_mode
    # said under verl's name: keel leaves it off
    tiny_config["async_training"]["use_rollout_log_probs"] = False
    assert not load_config(tiny_config).algorithm.rollout_correction.bypass_mode
    tiny_config["async_training"]["use_rollout_log_probs"] = True
    tiny_config["async_training"]["staleness_threshold"] = 0.1
    with pytest.raises(KeelError) as refused:
        load_config(tiny_config)
    assert "async_training.staleness_threshold" in refused.value.message
    assert "trainer.max_off_policy_steps" in refused.value.message
