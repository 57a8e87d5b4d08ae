"""The run's seeds (keel.trainer.seeds): no two ranks, generation batches or steps of a run sample
with the same seed, and the actor's and the critic's mini-batch orders differ."""

from types import SimpleNamespace

from keel.trainer.seeds import actor_order_seed, batch_seed, critic_order_seed, rank_seed, step_seed


def test_every_rank_batch_and_step_of_a_run_samples_with_a_seed_of_its_own():
    for trainer_seed in (0, 1, 42):
        cfg = SimpleNamespace(trainer=SimpleNamespace(seed=trainer_seed))
        seeds = [
            rank_seed(batch_seed(step_seed(cfg, step), call), rank)
            for step in range(1, 2001)
            for call in range(4)
            for rank in range(8)
        ]
        assert len(set(seeds)) == len(seeds)


def test_the_actor_and_the_critic_take_their_mini_batches_in_orders_of_their_own():
    cfg = SimpleNamespace(trainer=SimpleNamespace(seed=0))
    orders = [
        f(step_seed(cfg, step))
        for step in range(1, 2001)
        for f in (actor_order_seed, critic_order_seed)
    ]
    assert len(set(orders)) == len(orders)
