"""GKD's on-policy fraction (distillation.gkd.lmbda < 1): the step's draw, the batch of the data's
responses, and the settings and rows it refuses."""

import pytest
import torch

from keel.config.load import load_config
from keel.data.prompts import PromptRecord, collate_prompts
from keel.data.responses import data_batch, response_texts
from keel.errors import GKD_OFF_POLICY, RESPONSE_COLUMN, KeelError
from keel.models.tiny import build_tokenizer
from keel.trainer.data_responses import on_policy_step

BASE = {
    "data": {"train_files": ["train.jsonl"]},
    "actor_rollout_ref": {"model": {"path": "model"}},
    "distillation": {"enable": True, "mode": "gkd", "teacher": {"path": "teacher"}},
}


def config(*overrides):
    return load_config(BASE, list(overrides))


@pytest.mark.parametrize("lmbda", [0.25, 0.5, 0.8])
def test_the_draw_is_the_steps_own_and_on_policy_about_lmbda_of_the_time(lmbda):
    cfg = config(f"distillation.gkd.lmbda={lmbda}")
    steps = range(1, 4001)
    draws = [on_policy_step(cfg, step) for step in steps]
    # a resumed run draws each step again: the same answers
    assert draws == [on_policy_step(cfg, step) for step in steps]
    # 4000 draws: the standard error is under 0.008, the bound over six of them
    assert abs(sum(draws) / len(draws) - lmbda) < 0.05
    # another trainer.seed draws otherwise
    other = config(f"distillation.gkd.lmbda={lmbda}", "trainer.seed=7")
    assert draws != [on_policy_step(other, step) for step in steps]


def test_lmbda_1_and_0_are_every_step_and_none():
    assert all(on_policy_step(config(), step) for step in range(1, 200))
    zero = config("distillation.gkd.lmbda=0")
    assert not any(on_policy_step(zero, step) for step in range(1, 200))


def records(tokenizer, prompts: list[str]) -> list[PromptRecord]:
    return [
        PromptRecord(
            index=i,
            prompt_ids=tokenizer(p, add_special_tokens=False)["input_ids"],
            prompt_text=p,
            data_source="digits",
            ground_truth=None,
        )
        for i, p in enumerate(prompts)
    ]


def test_a_data_batch_holds_the_tokenized_responses_after_their_prompts():
    tokenizer = build_tokenizer()
    rows = records(tokenizer, ["Digits please: 12", "Say 3"])
    prompts = collate_prompts(rows, tokenizer.pad_token_id).repeat_interleave(2)
    responses = ["12", "three and some more words than fit"]
    batch = data_batch(prompts, [responses[0]] * 2 + [responses[1]] * 2, tokenizer, 5)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    short = tokenizer(responses[0], add_special_tokens=False)["input_ids"] + [eos]
    long = tokenizer(responses[1], add_special_tokens=False)["input_ids"][:5]
    assert len(short) < 5 < len(tokenizer(responses[1])["input_ids"])
    expected = [short + [pad] * (5 - len(short))] * 2 + [long] * 2
    assert batch.response_ids.tolist() == expected
    assert batch.response_mask.sum(-1).tolist() == [len(short)] * 2 + [5] * 2
    # cut at max_response_length without EOS, as a generated response would be
    assert batch.truncated.tolist() == [False, False, True, True]
    assert batch.response_texts[:2] == ["12", "12"]
    assert torch.equal(batch.prompt_ids, prompts.input_ids)
    assert batch.group_index.tolist() == [0, 0, 1, 1]
    # marked: nothing takes its log-probs for a sampler's
    assert batch.from_data.all() and not batch.sampled
    assert not batch.sampling_log_probs.any()


def test_a_row_without_the_response_column_is_refused_with_the_column_it_has():
    tokenizer = build_tokenizer()
    rows = [{"prompt": "a", "response": "1"}, {"prompt": "b", "completion": "2"}]
    cfg = config("distillation.gkd.lmbda=0.5")
    with pytest.raises(KeelError) as info:
        response_texts(rows, records(tokenizer, ["a", "b"]), cfg)
    error = info.value
    assert error.code == RESPONSE_COLUMN and "row 1" in error.message
    assert "distillation.response_key=completion" in error.fix
    # a response that is no string
    with pytest.raises(KeelError, match="of type list, not a string"):
        response_texts([{"prompt": "a", "response": ["x"]}], records(tokenizer, ["a"]), cfg)
    texts = response_texts(rows, records(tokenizer, ["a", "b"])[:1], cfg)
    assert texts == {0: "1"}


@pytest.mark.parametrize(
    "overrides, fix",
    [
        (["distillation.mode=reverse_kl"], "distillation.mode=gkd"),
        (["trainer.mode=async"], "trainer.mode=sync"),
        (["trainer.mode=async", "trainer.partial_rollout=true"], "trainer.partial_rollout=false"),
        (["algorithm.rollout_correction.bypass_mode=true"], "bypass_mode=false"),
    ],
)
def test_lmbda_below_1_is_refused_where_it_cannot_work(overrides, fix):
    with pytest.raises(KeelError) as info:
        config("distillation.gkd.lmbda=0.5", *overrides)
    assert info.value.code == GKD_OFF_POLICY
    assert fix in info.value.fix and "distillation.gkd.lmbda=1" in info.value.fix
    # lmbda 1 (every step the student's) runs with each of them
    config(*overrides)


def test_the_prompts_are_refused_as_they_are_read_when_a_row_lacks_its_response(tmp_path):
    """Before any model loads (keel check reads them so too)."""
    import json

    from keel.trainer.setup import read_prompts

    rows = [{"prompt": f"Say {i}", "response": str(i)} for i in range(3)] + [{"prompt": "Say 3"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    base = {**BASE, "data": {"train_files": [str(path)]}}
    tokenizer = build_tokenizer()
    cfg = load_config(base, ["distillation.gkd.lmbda=0.5"])
    with pytest.raises(KeelError) as info:
        read_prompts([str(path)], tokenizer, cfg, "train")
    assert info.value.code == RESPONSE_COLUMN and "row 3" in info.value.message
    # every step on the student's samples: the column is not needed
    records, _ = read_prompts([str(path)], tokenizer, load_config(base, []), "train")
    assert len(records) == 4
