"""Distillation on a tiny model: the top-k and gathered log-probs of a response forward against
the model's own full logits, the teacher's scores against the trainer's log-probs, and the actor's
GKD term (one update moves the student towards the teacher; a teacher equal to the student gives
0; the metric is TRL's loss on the full logits)."""

import os

import pytest
import torch

from keel.config.schema import ActorConfig, OptimConfig
from keel.models.load import load_causal_lm
from keel.models.tiny import make_tiny_model
from keel.training import forward
from keel.training.actor import ActorTrainer, GKDLoss
from keel.training.batching import MicroBatching, plan_minibatches
from keel.training.forward import TopK, batched_log_probs, response_log_probs, response_vocab_stats
from keel.training.placement import Placement
from keel.training.teacher import Teacher
from keel.types import TrainBatch, position_ids_from_mask

from tests_helpers import padded_batch

TEMPERATURE = 0.7
ATOL = 1e-5


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Two tiny models of one vocabulary: the student and a teacher of other, larger weights (its
    distributions far from the student's nearly uniform ones)."""
    root = tmp_path_factory.mktemp("distill")
    return {
        "student": make_tiny_model(root / "student", hidden_size=32, num_layers=2, seed=0),
        "teacher": make_tiny_model(
            root / "teacher", hidden_size=32, num_layers=2, seed=1, initializer_range=0.3
        ),
    }


def load(path):
    torch.manual_seed(0)
    return load_causal_lm(path, torch.device("cpu"))


def make_batch(vocab: int, seed: int = 0) -> TrainBatch:
    """Left-padded prompts and right-padded responses of different lengths, random tokens."""
    return padded_batch(vocab, [4, 2, 3, 4, 1], [5, 3, 1, 4, 2], seed)


def full_log_probs(model, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) [N, R, V] at the positions that predict the response tokens, from
    the model's own full-logits forward."""
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=position_ids_from_mask(batch.attention_mask),
        ).logits
    response_len = batch.response_ids.shape[1]
    return torch.log_softmax(logits[:, -response_len - 1 : -1].float() / temperature, -1)


@pytest.fixture(params=["chunked", "logits_to_keep"])
def forward_path(request, monkeypatch):
    """Both ways through response_vocab_stats: lm_head on chunks of 3 positions (so a sample's
    positions span chunks), and the model's own logits."""
    if request.param == "chunked":
        monkeypatch.setattr(
            forward,
            "logits_chunking",
            lambda positions, vocab, device, grad, **_: forward.LogitsChunking(3, grad),
        )
    else:
        monkeypatch.setattr(forward, "PLAIN_LM_HEAD", set())
    return request.param


def test_vocab_extra_k_gives_the_k_largest_log_probs_of_the_full_logits(tiny_models, forward_path):
    model = load(tiny_models["student"])
    batch = make_batch(model.config.vocab_size)
    expected = full_log_probs(model, batch, TEMPERATURE)
    k = 5
    with torch.no_grad():
        log_probs, _, (top_log_probs, top_ids) = response_vocab_stats(
            model, batch, TEMPERATURE, vocab_extra=TopK(k)
        )
        plain, _ = response_log_probs(model, batch, TEMPERATURE)
    top = expected.topk(k, dim=-1)
    assert top_log_probs.shape == top_ids.shape == (*batch.response_ids.shape, k)
    torch.testing.assert_close(top_log_probs, top.values, atol=ATOL, rtol=0)
    assert torch.equal(top_ids, top.indices)
    # the sampled tokens' log-probs: the full logits', and response_log_probs's
    sampled = expected.gather(-1, batch.response_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(log_probs, sampled, atol=ATOL, rtol=0)
    torch.testing.assert_close(log_probs, plain, atol=ATOL, rtol=0)


def test_vocab_extra_ids_gives_the_log_probs_at_those_ids(tiny_models, forward_path):
    model = load(tiny_models["student"])
    batch = make_batch(model.config.vocab_size, seed=1)
    expected = full_log_probs(model, batch, TEMPERATURE)
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(
        0, model.config.vocab_size, (*batch.response_ids.shape, 4), generator=generator
    )
    with torch.no_grad():
        log_probs, _, (gathered,) = response_vocab_stats(model, batch, TEMPERATURE, vocab_extra=ids)
        plain, _ = response_log_probs(model, batch, TEMPERATURE)
    torch.testing.assert_close(gathered, expected.gather(-1, ids), atol=ATOL, rtol=0)
    torch.testing.assert_close(log_probs, plain, atol=ATOL, rtol=0)


def test_vocab_extra_ids_carry_the_gradient_of_the_full_logits(tiny_models, forward_path):
    """The student's side of GKD: the gradient of the gathered log-probs reaches the weights as it
    does through the model's own logits (checkpointed chunks included)."""
    batch = make_batch(load(tiny_models["student"]).config.vocab_size, seed=3)
    ids = batch.response_ids[..., None].repeat(1, 1, 3) // torch.tensor([1, 2, 3])
    grads = []
    for ours in (True, False):
        model = load(tiny_models["student"])
        if ours:
            _, _, (gathered,) = response_vocab_stats(model, batch, TEMPERATURE, vocab_extra=ids)
        else:
            logits = model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=position_ids_from_mask(batch.attention_mask),
            ).logits[:, -batch.response_ids.shape[1] - 1 : -1]
            gathered = torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(-1, ids)
        (gathered * batch.response_mask[..., None]).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=1e-4)


def test_the_compiled_vocabulary_arithmetic_gives_the_same_extras(tiny_models):
    """actor.use_torch_compile's fused path (torch.compile of the per-chunk arithmetic) returns
    the eager top-k and gathered log-probs."""
    model = load(tiny_models["teacher"])
    batch = make_batch(model.config.vocab_size, seed=5)
    ids = batch.response_ids[..., None] // torch.tensor([1, 2, 3])
    with torch.no_grad():
        for extra in (TopK(4), ids):
            _, _, fused = response_vocab_stats(
                model, batch, TEMPERATURE, plan=Placement(fused_vocab=True), vocab_extra=extra
            )
            _, _, eager = response_vocab_stats(model, batch, TEMPERATURE, vocab_extra=extra)
            assert len(fused) == len(eager) == (2 if isinstance(extra, TopK) else 1)
            for got, expected in zip(fused, eager):
                torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


# --- the teacher ----------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [None, 6])
def test_teacher_scores_are_the_trainers_log_probs_masked(tiny_models, top_k):
    model = load(tiny_models["teacher"])
    batch = make_batch(model.config.vocab_size)
    scores = Teacher(model, MicroBatching(8), TEMPERATURE, top_k).score(batch)
    expected = batched_log_probs(model, batch, MicroBatching(8), TEMPERATURE)
    torch.testing.assert_close(scores.log_probs, expected, atol=ATOL, rtol=0)
    padding = ~batch.response_mask.bool()
    assert (scores.log_probs[padding] == 0).all() and (scores.log_probs[~padding] < 0).all()
    if top_k is None:
        assert scores.top_ids is None and scores.top_log_probs is None
        return
    n, width = batch.response_ids.shape
    assert scores.top_ids.shape == scores.top_log_probs.shape == (n, width, top_k)
    assert (scores.top_log_probs[padding] == 0).all()
    full = full_log_probs(model, batch, TEMPERATURE).topk(top_k, dim=-1)
    real = ~padding
    torch.testing.assert_close(scores.top_log_probs[real], full.values[real], atol=ATOL, rtol=0)
    assert torch.equal(scores.top_ids[real], full.indices[real])


@pytest.mark.parametrize(
    "batching", [MicroBatching(1), MicroBatching(2), MicroBatching(8, max_tokens=16)]
)
def test_teacher_scores_do_not_depend_on_micro_batching(tiny_models, batching):
    model = load(tiny_models["teacher"])
    batch = make_batch(model.config.vocab_size)
    whole = Teacher(model, MicroBatching(8), TEMPERATURE, 4).score(batch)
    cut = Teacher(model, batching, TEMPERATURE, 4).score(batch)
    real = batch.response_mask.bool()
    torch.testing.assert_close(cut.log_probs, whole.log_probs, atol=ATOL, rtol=0)
    torch.testing.assert_close(cut.top_log_probs, whole.top_log_probs, atol=ATOL, rtol=0)
    assert torch.equal(cut.top_ids[real], whole.top_ids[real])


def test_teacher_top_ids_past_the_response_do_not_depend_on_micro_batching(tiny_models):
    model = load(tiny_models["teacher"])
    batch = make_batch(model.config.vocab_size)
    whole = Teacher(model, MicroBatching(8), TEMPERATURE, 4).score(batch)
    cut = Teacher(model, MicroBatching(1), TEMPERATURE, 4).score(batch)
    assert torch.equal(cut.top_ids, whole.top_ids)


def test_a_top_k_above_the_vocabulary_keeps_the_whole_vocabulary(tiny_models):
    model = load(tiny_models["teacher"])
    vocab = model.config.vocab_size
    batch = make_batch(vocab)
    scores = Teacher(model, MicroBatching(8), TEMPERATURE, vocab + 10).score(batch)
    assert scores.top_ids.shape[-1] == vocab


# --- the actor's GKD term -------------------------------------------------------------------


def gkd_actor(path, beta: float, micro: int = 2) -> ActorTrainer:
    cfg = ActorConfig(
        ppo_micro_batch_size_per_gpu=micro,
        use_torch_compile=False,
        optim=OptimConfig(lr=1e-3, weight_decay=0.0),
    )
    return ActorTrainer(
        load(path), cfg, TEMPERATURE, 10, MicroBatching(8), 5, gkd=GKDLoss(beta, coef=1.0)
    )


def with_teacher(batch: TrainBatch, teacher_path, top_k: int) -> TrainBatch:
    scores = Teacher(load(teacher_path), MicroBatching(8), TEMPERATURE, top_k).score(batch)
    fields = {f: getattr(batch, f) for f in batch.__dataclass_fields__}
    fields.update(
        teacher_log_probs=scores.log_probs,
        teacher_top_ids=scores.top_ids,
        teacher_top_log_probs=scores.top_log_probs,
    )
    return TrainBatch(**fields)


def one_update(actor: ActorTrainer, batch: TrainBatch) -> dict[str, float]:
    minis = plan_minibatches(batch, len(batch), 1, False, 0, 5)[0]
    return actor.update(minis)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_one_gkd_update_moves_the_student_towards_the_teacher(tiny_models, beta):
    actor = gkd_actor(tiny_models["student"], beta)
    vocab = actor.model.config.vocab_size
    batch = with_teacher(make_batch(vocab), tiny_models["teacher"], top_k=16)
    before = one_update(actor, batch)["distill/gkd_loss"]
    after = one_update(actor, batch)["distill/gkd_loss"]
    assert before > 0.1 and after < 0.95 * before


def test_a_teacher_equal_to_the_student_gives_no_gkd_loss(tiny_models):
    actor = gkd_actor(tiny_models["student"], 0.5)
    vocab = actor.model.config.vocab_size
    batch = with_teacher(make_batch(vocab), tiny_models["student"], top_k=vocab)
    metrics = one_update(actor, batch)
    assert metrics["distill/gkd_loss"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("beta", [0.1, 0.9])
def test_the_gkd_metric_over_the_whole_vocabulary_is_trls_loss(tiny_models, beta):
    """top_k = the vocabulary: the actor's distill/gkd_loss (micro-batches of 2, token-weighted) is
    TRL's generalized_jsd_loss on both models' full logits at the sampling temperature."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    pytest.importorskip("trl", minversion="1.16")
    from trl.experimental.gkd import GKDTrainer

    actor = gkd_actor(tiny_models["student"], beta)
    vocab = actor.model.config.vocab_size
    batch = with_teacher(make_batch(vocab, seed=4), tiny_models["teacher"], top_k=vocab)
    student = full_log_probs(actor.model, batch, 1.0)
    teacher = full_log_probs(load(tiny_models["teacher"]), batch, 1.0)
    labels = torch.where(batch.response_mask.bool(), 1, -100)
    expected = GKDTrainer.generalized_jsd_loss(
        student, teacher, labels=labels, beta=beta, temperature=TEMPERATURE
    )
    metrics = one_update(actor, batch)
    assert metrics["distill/gkd_loss"] == pytest.approx(expected.item(), abs=ATOL)


def test_a_teacher_with_rows_past_the_students_keeps_its_top_k_among_the_students_ids(
    tiny_models,
):
    """Qwen2.5-7B's embedding has 152064 rows, 0.5B's 151936: the ids between are padding rows the
    student cannot score, so the teacher's top k are drawn from the student's ids."""
    model = load(tiny_models["teacher"])
    vocab = model.config.vocab_size
    batch = make_batch(vocab - 8)
    scores = Teacher(model, MicroBatching(8), TEMPERATURE, vocab, student_vocab=vocab - 8).score(
        batch
    )
    assert scores.top_ids.shape[-1] == vocab - 8
    assert int(scores.top_ids.max()) < vocab - 8
    # log-probs over every id: the kept ones hold less than the whole mass
    real = batch.response_mask.bool()
    assert (scores.top_log_probs.exp().sum(-1)[real] <= 1 + 1e-5).all()
