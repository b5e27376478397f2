"""--strategy fsdp|hsdp (ray_job/model/sharding.py) and the memory plan (ray_job/model/memory.py):
the units of several torchvision families and a user's MLP; the mesh and its refusals; activation
checkpointing (same gradients, fewer saved activations, BatchNorm statistics updated once); and, in
two gloo processes, real FSDP2 training whose per-rank bytes equal the plan exactly, and whose
step equals one process training on the whole batch."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

from ranks import run_ranks
from ray_job.config import TrainConfig
from ray_job.core.errors import UsageError
from ray_job.model import memory, sharding, zoo
from ray_job.model.optim import build_optimizer

pytestmark = pytest.mark.unit
MiB = 2**20


def odd_mlp() -> nn.Module:
    """Every weight's dim 0 odd (9, 3, 7): FSDP2's chunks differ between 2 ranks."""
    return nn.Sequential(nn.Linear(8, 9), nn.ReLU(), nn.Linear(9, 3), nn.ReLU(), nn.Linear(3, 7))


def resnet18_cifar() -> nn.Module:
    return zoo.build(TrainConfig(model="resnet18", stem="cifar"), 10)


def _on_meta(name: str) -> nn.Module:
    with torch.device("meta"):
        return odd_mlp() if name == "mlp" else zoo.build(TrainConfig(model=name), 10, 224)


@pytest.mark.parametrize("name, block, count", [
    ("resnet18", "BasicBlock", 8), ("resnet50", "Bottleneck", 16), ("vit_b_16", "EncoderBlock", 12),
    ("convnext_tiny", "CNBlock", 18), ("efficientnet_b0", "MBConv", 15), ("densenet121", "_DenseLayer", 58),
    ("mlp", "Linear", 3)])
def test_units_are_the_repeated_blocks_and_hold_every_parameter_at_most_once(name, block, count):
    model = _on_meta(name)
    units = sharding.shard_units(model)
    assert sum(type(u).__name__ == block for u in units) == count
    owned = [id(p) for u in units for p in u.parameters()]
    assert len(owned) == len(set(owned))  # no parameter in two units: units never nest
    order = {id(m): i for i, m in enumerate(model.modules())}
    assert [order[id(u)] for u in units] == sorted(order[id(u)] for u in units)  # forward order
    total = sum(p.numel() for p in model.parameters())
    in_units = sum(p.numel() for u in units for p in u.parameters())
    assert in_units >= 0.97 * total  # the root keeps only the stem, the head and such


def test_a_model_without_repeated_blocks_falls_back_to_its_children():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten())
            self.head = nn.Linear(8 * 30 * 30, 10)

    model = Net()
    assert sharding.shard_units(model) == [model.body, model.head]


def test_device_mesh_refuses_what_cannot_be_sharded_that_way():
    assert sharding.device_mesh("ddp", 4, 2, "cpu") is None
    with pytest.raises(UsageError, match="not two or more whole nodes; use --strategy fsdp"):
        sharding.device_mesh("hsdp", 2, 2, "cpu")  # one node: nothing to replicate across
    with pytest.raises(UsageError, match="3 workers at 2 per node"):
        sharding.device_mesh("hsdp", 3, 2, "cpu")
    with pytest.raises(UsageError, match="unknown"):
        sharding.device_mesh("zero3", 2, 2, "cpu")


def test_cpu_offload_is_refused_without_gpus():
    with pytest.raises(UsageError, match="no GPUs: leave --cpu-offload out"):
        sharding.shard(odd_mlp(), types.SimpleNamespace(device_type="cpu"), bf16=False, cpu_offload=True)


def _saved_bytes_and_grads(model: nn.Module, x: torch.Tensor):
    """Bytes autograd keeps for the backward pass outside checkpointed units, and the gradients."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        loss = model(x).logsumexp(1).sum()
    loss.backward()
    return sum(saved), [p.grad for p in model.parameters()]


def test_activation_checkpointing_keeps_the_gradients_and_fewer_activations():
    torch.manual_seed(0)
    plain = resnet18_cifar()
    checkpointed = copy.deepcopy(plain)
    assert sharding.checkpoint_activations(checkpointed) == 8
    x = torch.randn(4, 3, 32, 32)
    kept, grads = _saved_bytes_and_grads(plain, x)
    kept_ac, grads_ac = _saved_bytes_and_grads(checkpointed, x)
    assert kept_ac < kept / 4  # only the stem's and the head's activations stay
    for g, g_ac in zip(grads, grads_ac):
        torch.testing.assert_close(g_ac, g, rtol=0, atol=0)
    # the recomputation left BatchNorm's running statistics as one forward pass made them
    for m, m_ac in zip(plain.modules(), checkpointed.modules()):
        if isinstance(m, nn.BatchNorm2d):
            assert torch.equal(m.running_mean, m_ac.running_mean) and m.num_batches_tracked == m_ac.num_batches_tracked


def test_the_ddp_plan_is_the_unsharded_models_bytes():
    for optimizer in ("sgd", "adamw"):
        model = resnet18_cifar()
        opt = build_optimizer(model, TrainConfig(optimizer=optimizer), 1, torch.device("cpu"))
        model(torch.randn(2, 3, 32, 32)).sum().backward()
        opt.step()
        planned = memory.plan(model, optimizer, "ddp", 2, 2)
        assert sharding.local_state_bytes(model, opt) == dict(params=planned.params, grads=planned.grads,
                                                              optimizer=planned.optimizer)


# --- two gloo processes ---------------------------------------------------------------------------

def _trained_bytes(rank: int, world: int, build, optimizer: str, x: torch.Tensor, strategy: str = "fsdp",
                   per_node: int = 0) -> dict:
    """One FSDP2 step of `build()` with `optimizer`; this rank's bytes and the plan (from a meta copy)."""
    torch.manual_seed(0)
    model, per_node = build(), per_node or world
    with torch.device("meta"):
        planned = memory.plan(build(), optimizer, strategy, world, per_node)
    mesh = sharding.device_mesh(strategy, world, per_node, "cpu")
    sharding.shard(model, mesh, bf16=False, cpu_offload=False)
    opt = build_optimizer(model, TrainConfig(optimizer=optimizer), world, torch.device("cpu"))
    model(x.chunk(world)[rank]).sum().backward()
    opt.step()
    return dict(local=sharding.local_state_bytes(model, opt), plan=planned.to_dict(),
                sharded=sharding.is_sharded(model), mesh=list(mesh.mesh_dim_names))


def _same_step_as_one_process(rank: int, world: int) -> float:
    """Largest difference between the weights after one sharded SGD step on each rank's half of the
    batch and after one unsharded step on the whole batch."""
    torch.manual_seed(0)
    model, x, y = odd_mlp(), torch.randn(8, 8), torch.randint(0, 7, (8,))
    whole = copy.deepcopy(model)
    sharding.checkpoint_activations(model)
    sharding.shard(model, sharding.device_mesh("fsdp", world, world, "cpu"), bf16=False, cpu_offload=False)
    for m, xs, ys in ((model, x.chunk(world)[rank], y.chunk(world)[rank]), (whole, x, y)):
        opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
        nn.functional.cross_entropy(m(xs), ys).backward()
        opt.step()
    return max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), whole.parameters()))


def _batchnorm_stats(rank: int, world: int) -> dict:
    """Each rank trains one step on data of its own, then sync_buffers: the running statistics
    before and after, as lists."""
    torch.manual_seed(0)
    model = resnet18_cifar()
    sharding.shard(model, sharding.device_mesh("fsdp", world, world, "cpu"), bf16=False, cpu_offload=False)
    model(torch.randn(4, 3, 32, 32) + rank).sum().backward()  # each rank's own batch
    def stats():
        return [b.tolist() for name, b in model.named_buffers() if name.endswith(("running_mean", "running_var"))]
    before = stats()
    sharding.sync_buffers(model)
    return dict(before=before, after=stats())


def _fsdp_rank(rank: int, world: int) -> dict:
    images, rows = torch.randn(4, 3, 32, 32), torch.randn(4, 8)
    return dict(resnet_sgd=_trained_bytes(rank, world, resnet18_cifar, "sgd", images),
                resnet_adamw=_trained_bytes(rank, world, resnet18_cifar, "adamw", images),
                odd_sgd=_trained_bytes(rank, world, odd_mlp, "sgd", rows),
                odd_adamw=_trained_bytes(rank, world, odd_mlp, "adamw", rows),
                # two "nodes" of one worker: replicated across them, a shard group of one
                hsdp=_trained_bytes(rank, world, odd_mlp, "adamw", rows, "hsdp", 1),
                step_diff=_same_step_as_one_process(rank, world),
                batchnorm=_batchnorm_stats(rank, world))


@pytest.fixture(scope="module")
def fsdp_ranks():
    return run_ranks(_fsdp_rank, world=2, timeout=240)


@pytest.mark.parametrize("case", ["resnet_sgd", "resnet_adamw", "odd_sgd", "odd_adamw"])
def test_the_fsdp_plan_is_the_largest_ranks_bytes_exactly(fsdp_ranks, case):
    ranks = [r[case] for r in fsdp_ranks]
    assert all(r["sharded"] for r in ranks)
    largest = max((r["local"] for r in ranks), key=lambda b: sum(b.values()))
    plan = ranks[0]["plan"]
    assert largest == dict(params=plan["params"], grads=plan["grads"], optimizer=plan["optimizer"])
    if case.startswith("odd"):  # chunks of ceil(d0 / 2): rank 0 holds more than rank 1
        assert sum(ranks[0]["local"].values()) > sum(ranks[1]["local"].values())
    else:  # resnet18 under fsdp over 2: about half of its 42.6 MiB of parameters
        assert 21 * MiB < plan["params"] < 21.6 * MiB


def test_a_sharded_checkpointed_step_equals_one_process_on_the_whole_batch(fsdp_ranks):
    assert max(r["step_diff"] for r in fsdp_ranks) < 1e-6


def test_hsdp_replicates_across_nodes_and_shards_within_one(fsdp_ranks):
    ranks = [r["hsdp"] for r in fsdp_ranks]
    assert ranks[0]["mesh"] == ["replicate", "shard"] and all(r["sharded"] for r in ranks)
    plan = ranks[0]["plan"]
    for r in ranks:  # a shard group of one worker holds everything, like ddp
        assert r["local"] == dict(params=plan["params"], grads=plan["grads"], optimizer=plan["optimizer"])
    with torch.device("meta"):
        assert plan["total"] == memory.plan(odd_mlp(), "adamw", "ddp", 2, 1).total


def test_every_rank_evaluates_and_saves_rank_0s_batchnorm_statistics(fsdp_ranks):
    """Sharded, each rank's running statistics follow its own batches (DDP would broadcast rank 0's);
    sync_buffers gives every rank rank 0's, as the worker does before evaluating and checkpointing."""
    zero, one = (r["batchnorm"] for r in fsdp_ranks)
    assert zero["before"] != one["before"]
    assert zero["after"] == one["after"] == zero["before"]


# --- the plan's words ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def resnet18_meta():
    with torch.device("meta"):
        return resnet18_cifar()  # 11.2M parameters: 42.6 MiB; with SGD's momentum 128 MiB of states


@pytest.mark.parametrize("strategy, workers, per_node, available, says", [
    ("ddp", 2, 2, 100 * MiB, "--strategy ddp needs 128 MiB of model states per worker (parameters, gradients, "
     "optimizer state), more than the 100 MiB a worker has; --strategy fsdp over 2 workers needs 63.9 MiB per "
     "worker (or give --memory-per-worker-gb)"),
    ("ddp", 2, 2, 40 * MiB, "; --strategy fsdp over 4 workers needs 32.0 MiB per worker"),
    ("ddp", 4, 2, 70 * MiB, "; --strategy hsdp over 2 nodes of 2 needs 63.9 MiB per worker"),
    ("fsdp", 2, 2, 40 * MiB, "--strategy fsdp needs 63.9 MiB of model states per worker"),
    ("ddp", 2, 2, MiB, "; even --strategy fsdp over 64 workers needs 2.0 MiB per worker: give workers more "
     "memory (--memory-per-worker-gb) or choose a smaller --model"),
])
def test_a_run_whose_states_cannot_fit_is_refused_in_one_line_naming_what_would(
        resnet18_meta, strategy, workers, per_node, available, says):
    said = memory.refusal(resnet18_meta, "sgd", strategy, workers, per_node, available)
    assert says in said and "\n" not in said


def test_a_run_that_fits_is_not_refused_and_its_plan_is_one_line(resnet18_meta):
    assert memory.refusal(resnet18_meta, "sgd", "ddp", 2, 2, 128 * MiB) is None
    line = memory.plan(resnet18_meta, "sgd", "fsdp", 2, 2).line(11 * 2**30 + 200 * MiB)
    assert line == ("memory plan (fsdp, 2 workers): 21.3 MiB parameters + 21.3 MiB gradients + 21.3 MiB "
                    "optimizer state = 63.9 MiB per worker, of 11.2 GiB available; activations are measured "
                    "on the first step")
    adamw = memory.plan(resnet18_meta, "adamw", "ddp", 1, 1)
    assert adamw.optimizer == 2 * adamw.params + 4 * 62  # exp_avg, exp_avg_sq, a float32 step per tensor


def test_worker_memory_is_the_flag_else_the_gpu_else_a_share_of_the_node():
    assert memory.worker_memory(1.5, 80 * 2**30, 64 * 2**30, 4) == 1.5 * 2**30
    assert memory.worker_memory(0, 80 * 2**30, 64 * 2**30, 4) == 80 * 2**30
    assert memory.worker_memory(0, None, 64 * 2**30, 4) == 16 * 2**30
    assert memory.worker_memory(0, 0, 10, 0) == 10
