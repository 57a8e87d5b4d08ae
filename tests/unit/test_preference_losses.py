"""keel's preference losses against TRL 1.16's own code on the same seeded log-probs:
`DPOTrainer._compute_loss` (sigmoid, ipo, hinge, robust, and sigmoid with the sft term),
`CPOTrainer.cpo_loss` (simpo) and `RewardTrainer.compute_loss` (Bradley-Terry). TRL's methods run
for real, on a stand-in trainer that holds only the attributes they read."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from keel.algorithms.preference import (
    LOSS_TYPES,
    PairLogProbs,
    bradley_terry_loss,
    chosen_nll,
    dpo_loss,
)

trl = pytest.importorskip("trl", minversion="1.16")
from trl import DPOTrainer, RewardTrainer  # noqa: E402
from trl.experimental.cpo.cpo_trainer import CPOTrainer  # noqa: E402

PAIRS = 16
PROMPT = 4
LONGEST = 12
# Each loss with a beta at which its pairs fall on both sides of the loss's bends (the hinge's
# kink at beta * delta = 1), and a label smoothing both sides are given, used or not.
CASES = {
    "sigmoid": dict(beta=0.1, label_smoothing=0.1),
    "ipo": dict(beta=0.1, label_smoothing=0.0),
    "hinge": dict(beta=0.5, label_smoothing=0.0),
    "robust": dict(beta=0.1, label_smoothing=0.2),
    "simpo": dict(beta=2.0, label_smoothing=0.1, simpo_gamma=0.5),
}


class Accelerator:
    """What TRL's loss code asks of accelerate on one process; keeps what `gather` was given, where
    TRL passes its per-pair rewards."""

    device = torch.device("cpu")

    def __init__(self):
        self.gathered = []

    def gather(self, tensor):
        self.gathered.append(tensor)
        return tensor

    def gather_for_metrics(self, tensor):
        return tensor


def stand_in(trainer_class, **attributes):
    """A TRL trainer not built (no model, no dataset) with the attributes its loss method reads."""
    trainer = trainer_class.__new__(trainer_class)
    common = dict(
        accelerator=Accelerator(),
        model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    for name, value in {**common, **attributes}.items():
        setattr(trainer, name, value)
    return trainer


def seeded_batch(seed=0):
    """A padded batch as TRL's collator lays it out (chosen rows, then rejected rows), with the
    policy's and the reference's per-token log-probs on the completion tokens."""
    torch.manual_seed(seed)
    lengths = torch.randint(3, LONGEST + 1, (2 * PAIRS,))
    positions = torch.arange(PROMPT + LONGEST)
    completion_mask = ((positions >= PROMPT) & (positions < PROMPT + lengths[:, None])).long()
    attention_mask = (positions < PROMPT + lengths[:, None]).long()
    # per-token log-probs of each next token, as a causal LM's labels shifted by one give them
    shift_mask = completion_mask[:, 1:]
    reference = -3 * torch.rand(2 * PAIRS, PROMPT + LONGEST - 1) * shift_mask
    policy = (reference + torch.randn_like(reference)).clamp(max=0) * shift_mask
    return SimpleNamespace(
        input_ids=torch.randint(0, 300, (2 * PAIRS, PROMPT + LONGEST)),
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        policy_per_token=policy,
        reference_per_token=reference,
    )


def pair_sums(per_token, completion_mask):
    """keel's PairLogProbs from the same per-token log-probs: sums and completion lengths."""
    sums, tokens = per_token.sum(1), completion_mask.sum(1)
    return PairLogProbs(*sums.chunk(2), *tokens.chunk(2))


def trl_dpo(batch, loss_types, loss_weights, beta, label_smoothing):
    """TRL's loss, and the per-pair rewards it hands to `accelerator.gather`, with the reference
    log-probs precomputed (given in the inputs) and a model that returns the policy's."""
    trainer = stand_in(
        DPOTrainer,
        beta=beta,
        loss_types=loss_types,
        loss_weights=loss_weights,
        label_smoothing=label_smoothing,
        f_divergence_type="reverse_kl",
        ld_alpha=None,
        use_weighting=False,
        precompute_ref_logps=True,
        aux_loss_enabled=False,
    )
    zeros = torch.zeros_like(batch.policy_per_token)
    outputs = SimpleNamespace(
        log_probs=batch.policy_per_token,
        entropy=zeros,
        mean_logits=zeros,
        is_top1=zeros.bool(),
    )
    ref_chosen, ref_rejected = batch.reference_per_token.sum(1).chunk(2)
    inputs = dict(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        completion_mask=batch.completion_mask,
        ref_chosen_logps=ref_chosen,
        ref_rejected_logps=ref_rejected,
    )
    loss = trainer._compute_loss(lambda **_: outputs, inputs, return_outputs=False)
    # TRL gathers the chosen rewards, then the rejected, before its accuracies and margins
    chosen_rewards, rejected_rewards = trainer.accelerator.gathered[:2]
    return loss, chosen_rewards, rejected_rewards, trainer._metrics["train"]


def trl_simpo(policy, beta, label_smoothing, simpo_gamma):
    """CPOTrainer's SimPO takes mean log-probs (its average_log_prob=True): sums over lengths."""
    trainer = stand_in(
        CPOTrainer,
        loss_type="simpo",
        beta=beta,
        label_smoothing=label_smoothing,
        simpo_gamma=simpo_gamma,
        alpha=0.0,
    )
    return trainer.cpo_loss(
        policy.chosen / policy.chosen_tokens, policy.rejected / policy.rejected_tokens
    )


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_dpo_losses_equal_trls(loss_type):
    batch = seeded_batch()
    policy = pair_sums(batch.policy_per_token, batch.completion_mask)
    reference = pair_sums(batch.reference_per_token, batch.completion_mask)
    case = CASES[loss_type]
    keel = dpo_loss(policy, reference, loss_type, **case)
    if loss_type == "simpo":
        losses, chosen_rewards, rejected_rewards = trl_simpo(policy, **case)
        assert torch.allclose(keel.losses, losses)
    else:
        loss, chosen_rewards, rejected_rewards, metrics = trl_dpo(
            batch, [loss_type], [1.0], case["beta"], case["label_smoothing"]
        )
        assert torch.allclose(keel.losses.mean(), loss)
        assert metrics["rewards/chosen"] == [pytest.approx(keel.chosen_rewards.mean().item())]
        assert metrics["rewards/rejected"] == [pytest.approx(keel.rejected_rewards.mean().item())]
    assert torch.allclose(keel.chosen_rewards, chosen_rewards)
    assert torch.allclose(keel.rejected_rewards, rejected_rewards)
    # the seeded pairs reach both sides of each loss's bends, so the comparison covers them
    assert (keel.chosen_rewards > keel.rejected_rewards).any()
    assert (keel.chosen_rewards < keel.rejected_rewards).any()
    if loss_type == "hinge":
        assert (keel.losses == 0).any() and (keel.losses > 0).any()


@pytest.mark.parametrize("sft_weight", [0.5, 2.0])
def test_sigmoid_with_sft_equals_trls(sft_weight):
    batch = seeded_batch(seed=1)
    policy = pair_sums(batch.policy_per_token, batch.completion_mask)
    reference = pair_sums(batch.reference_per_token, batch.completion_mask)
    keel = dpo_loss(policy, reference, "sigmoid", beta=0.1).losses.mean()
    keel = keel + sft_weight * chosen_nll(policy)
    loss, *_ = trl_dpo(batch, ["sigmoid", "sft"], [1.0, sft_weight], beta=0.1, label_smoothing=0.0)
    assert torch.allclose(keel, loss)


@pytest.mark.parametrize("with_margin", [False, True])
@pytest.mark.parametrize("center_coefficient", [None, 0.01])
def test_bradley_terry_equals_trls_reward_trainer(with_margin, center_coefficient):
    torch.manual_seed(2)
    # [2B, 1]: a reward model's scores, chosen rows then rejected rows
    scores = 2 * torch.randn(2 * PAIRS, 1)
    inputs = dict(
        input_ids=torch.randint(0, 300, (2 * PAIRS, 8)),
        attention_mask=torch.ones(2 * PAIRS, 8, dtype=torch.long),
    )
    margin = torch.rand(PAIRS) if with_margin else None
    if with_margin:
        inputs["margin"] = margin
    trainer = stand_in(
        RewardTrainer, args=SimpleNamespace(center_rewards_coefficient=center_coefficient)
    )
    loss = trainer.compute_loss(lambda **_: SimpleNamespace(logits=scores), inputs)
    chosen, rejected = scores.squeeze(-1).chunk(2)
    keel = bradley_terry_loss(chosen, rejected, margin, center_coefficient or 0.0)
    assert torch.allclose(keel.mean(), loss)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_raises_chosen_and_lowers_rejected(loss_type):
    # delta = 0: the policy equals the reference (SimPO: both completions' mean log-probs equal)
    tokens = torch.full((PAIRS,), 8.0)
    chosen = torch.full((PAIRS,), -16.0, requires_grad=True)
    rejected = torch.full((PAIRS,), -16.0, requires_grad=True)
    policy = PairLogProbs(chosen, rejected, tokens, tokens)
    reference = PairLogProbs(chosen.detach(), rejected.detach(), tokens, tokens)
    dpo_loss(policy, reference, loss_type, **CASES[loss_type]).losses.mean().backward()
    assert (chosen.grad < 0).all()
    assert (rejected.grad > 0).all()
