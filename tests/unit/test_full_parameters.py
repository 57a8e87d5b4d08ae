"""Gathering a sharded model's parameters for the rollout copy, a bucket per collective: every
parameter comes back exactly as FSDP2's own full_tensor() gives it, including row counts that do
not divide the ranks (3 gloo processes on CPU)."""

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, results):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        _compare(rank, world, results)
        # gloo aborts the process ("terminate called without an active exception") when a peer
        # tears its group down while another still holds a connection: leave together
        dist.barrier()
        # past every collective: what gloo does at exit is not keel's
        results.put({"_done": rank})
    # the test reads it at once instead of waiting for a result
    except Exception as error:
        results.put({"_error": repr(error)})
        raise
    finally:
        dist.destroy_process_group()


def _compare(rank: int, world: int, results):
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, Qwen2Config

    from keel.distributed.fsdp import full_parameters
    from keel.distributed.parallelize import make_mesh, shard_model

    # rows of 301 (vocabulary) and 64 do not split evenly over 3 ranks
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=301,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config)
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    fsdp = SimpleNamespace(reshard_after_forward=True, param_offload=False, fsdp_size=-1)
    model = shard_model(model, make_mesh("cpu", world, -1), torch.float32, fsdp)
    # several buckets
    gathered = dict(full_parameters(model, torch.device("cpu"), bucket_bytes=20_000))
    if rank == 0:
        results.put(
            {name: bool(torch.equal(gathered[name], whole)) for name, whole in expected.items()}
            | {"_names": sorted(gathered) == sorted(expected)}
        )


def test_bucketed_gather_equals_the_unsharded_model():
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    procs = [context.Process(target=_rank, args=(r, 3, port, results)) for r in range(3)]
    for p in procs:
        p.start()
    # rank 0's comparison, then each rank's "done"; an error at once
    messages = []
    while len(messages) < 4:
        # long limits: a loaded machine is slow, not wrong
        messages.append(results.get(timeout=600))
        assert "_error" not in messages[-1], messages[-1]
    # every rank finished its work
    assert sorted(m["_done"] for m in messages if "_done" in m) == [0, 1, 2]
    for p in procs:
        p.join(timeout=600)
    outcome = next(m for m in messages if "_names" in m)
    assert outcome.pop("_names") and outcome and all(outcome.values()), [
        k for k, ok in outcome.items() if not ok
    ]
