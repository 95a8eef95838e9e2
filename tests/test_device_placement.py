"""The learner creates every tensor where its policy lives: no host allocation beside device tensors.

On a GPU, a `torch.zeros(b)` in the learner is a host tensor mixed with CUDA ones, and the step crashes. This CPU
has no second device, so `tests.device_guard.HostAllocationGuard` marks what a CUDA machine would put on the host
(factories without `device=`) and refuses any op that mixes it with the policy's tensors. The learner's step (shared
prompts, several updates and mini-batches, the online drafter's batch, a KL reference), the weight probe before a
checkpoint and the sharded learner's probe and all-reduce run under it with no default device set, as users run.
With SPECRL_TEST_DEVICE=cuda (`make gpu-check`) the policy is moved to that device, so the same tests run for real.
"""

import socket

import pytest
import torch

from specrl.algorithms.rollouts import Rollouts
from specrl.model.loader import load_model
from tests.conftest import TEST_DEVICE
from tests.device_guard import HostAllocationError, HostAllocationGuard
from tests.test_learner_group import SECONDS, dp_cfg

# the policy's device as the guard sees it: its cpu:0 marker on this CPU, the real device under `make gpu-check`
GUARD_DEVICE = None if TEST_DEVICE.type == "cpu" else TEST_DEVICE


def test_the_guard_refuses_the_bug_class_and_allows_placed_code():
    x = torch.ones(4, device=TEST_DEVICE)  # a device tensor
    with HostAllocationGuard(place=[x], device=GUARD_DEVICE):
        with pytest.raises(HostAllocationError, match="where"):
            torch.where(x > 0, torch.zeros(4), x)  # today's response_span
        with pytest.raises(HostAllocationError, match="mixes"):
            (torch.arange(4) * 3) + x  # host-born stays host-born through arithmetic
        host = torch.zeros(4)
        with pytest.raises(HostAllocationError, match="writes device values"):
            host[:2] = x[:2]  # today's draft_batch
        assert float((torch.zeros(4, device=x.device) + x).sum()) == 4
        assert float((torch.zeros(4).to(x.device) + x).sum()) == 4
        assert float(x[torch.arange(2)].sum()) == 2  # host indices into a device tensor: CUDA allows it
        assert float((x * torch.tensor(2.0)).sum()) == 8  # a 0-dim host scalar: CUDA allows it


def group_rollouts(n=8, group=4, seed=3) -> Rollouts:
    """GRPO groups that share their prompts (so the shared-prefix forward runs), rewards varying within groups."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 128, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n // group)]
    responses = [torch.randint(3, 128, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n)]
    return Rollouts(problem_indices=[i // group for i in range(n)], prompts=[prompts[i // group] for i in range(n)],
                    responses=responses, gen_logprobs=[[-2.0] * len(x) for x in responses],
                    finish_reasons=["stop"] * n, rewards=torch.rand(n, generator=g), correct=[False] * n,
                    formatted=[None] * n, policy_versions=[0] * n, request_ids=list(range(n)))


@pytest.mark.parametrize("over", [
    {"grpo__num_iterations": 2, "grpo__mini_batches": 2},
    {"grpo__kl_coef": 0.05},
    {"drafter__online": True, "speculative__drafter": "eagle:x"},
], ids=["updates", "kl", "online-drafter"])
def test_a_learner_step_allocates_nothing_on_the_host(tmp_path, over):
    from specrl.drafters import EagleDrafter
    from specrl.trainer.learner import Learner
    from tests.tiny import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    policy = load_model(str(tiny), dtype=torch.float32)[0].to(TEST_DEVICE)
    drafter = EagleDrafter(policy).to(TEST_DEVICE) if over.get("drafter__online") else None
    with HostAllocationGuard(place=[policy, drafter], device=GUARD_DEVICE):  # the learner is built on the device
        learner = Learner(dp_cfg(tiny, world_size=1, **over), policy, drafter)
        rec = learner.learn(group_rollouts(), dict(SECONDS))
        learner.check_weights(1)
    assert rec.loss == rec.loss


def test_the_weight_probe_allocates_nothing_on_the_host(tmp_path):
    from specrl.trainer.weight_check import check_weights
    from tests.tiny import make_tiny_checkpoint

    policy = load_model(str(make_tiny_checkpoint(tmp_path / "ckpt", seed=0)), dtype=torch.float32)[0].to(TEST_DEVICE)
    with HostAllocationGuard(place=[policy], device=GUARD_DEVICE):
        check_weights({"policy": policy.state_dict()}, policy, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_sharded_learners_step_and_probe_allocate_nothing_on_the_host(tmp_path):
    import torch.distributed as dist

    from specrl.parallel.data_parallel import ShardedLearner
    from tests.tiny import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    if TEST_DEVICE.type != "cpu":
        pytest.skip("the sharded learner's placement is checked on CPU (gloo); a GPU run checks the one-rank learner")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        policy, _ = load_model(str(tiny), dtype=torch.float32)
        calls = []
        real = dist.all_reduce

        def all_reduce(t, *a, **k):  # an NCCL group reduces device tensors only
            calls.append(guard.is_host(t))
            return real(t, *a, **k)

        with HostAllocationGuard(place=[policy], device=GUARD_DEVICE) as guard:
            learner = ShardedLearner(dp_cfg(tiny, world_size=1), policy)  # built on the device
            dist.all_reduce = all_reduce
            try:
                learner.learn(group_rollouts(), dict(SECONDS))
                learner.check_weights(1)
            finally:
                dist.all_reduce = real
        assert calls and not any(calls), calls
    finally:
        dist.destroy_process_group()


def test_the_losslessness_probe_allocates_nothing_on_the_host():
    """The probe's sampling tensors (temperature / top-p / top-k) and its PIT uniforms live on the reference's
    device; the uniforms come from a CPU generator, drawn on the CPU and moved (the same draws as before)."""
    from specrl.backends.probe import pit_values
    from specrl.model.transformer import tiny_model
    from specrl.rollout.sampling import SamplingParams

    reference = tiny_model("llama", vocab_size=64, seed=3).to(TEST_DEVICE)
    prompts, samples = [[1, 2, 3], [4, 5]], [[7, 8, 9], [10, 11, 12], [13, 14, 15]]
    params = SamplingParams(temperature=0.8)  # top-p / top-k tensors are built whatever their values
    with HostAllocationGuard(place=[reference], device=GUARD_DEVICE):
        u, lp, exp = pit_values(reference, prompts, samples, [0, 1, 0], params, 3, torch.Generator().manual_seed(0))
    assert u.shape == (9,) and u.device == next(reference.parameters()).device
    assert bool(((u >= 0) & (u < 1)).all()) and bool((lp <= 0).all()) and bool((exp <= 0).all())


def test_the_guard_sees_the_host_named_explicitly_numpy_and_earlier_tensors():
    """The guard's gaps, closed: `device="cpu"` / `torch.device("cpu")` / `.cpu()` / a CPU generator inside device
    code, `torch.from_numpy`, tensors made before the guard, and writes into host buffers; placed code passes."""
    import numpy as np

    if GUARD_DEVICE is not None:
        pytest.skip("the cpu:0 marker is the CPU's stand-in for a device; on CUDA the device is real")
    x = torch.ones(4)
    buffer = torch.zeros(4)  # a host buffer made before the guard (say, at start-up)
    real_from_numpy = torch.from_numpy
    with HostAllocationGuard(place=[x]) as guard:
        assert x.device == guard.device and torch.zeros(1).device == torch.device("cpu")
        for make in (lambda: torch.zeros(4, device="cpu"), lambda: torch.zeros(4, device=torch.device("cpu")),
                     lambda: torch.from_numpy(np.ones(4, dtype=np.float32)), lambda: (x * 2).cpu(),
                     lambda: (x * 2).to("cpu"), lambda: torch.zeros(4, device=torch.Generator().device),
                     lambda: torch.zeros_like(x, device="cpu"), lambda: buffer):
            with pytest.raises(HostAllocationError, match="mixes host-born"):
                make() + x
        with pytest.raises(HostAllocationError, match="writes device values"):
            buffer.copy_(x)
        with pytest.raises(HostAllocationError, match="writes device values"):
            buffer[torch.arange(2)] = x[:2]
        with pytest.raises(HostAllocationError, match="device indices"):
            buffer[torch.arange(2, device=x.device)] = 1.0
        with pytest.raises(HostAllocationError, match="mixes host-born"):
            torch.add(x, x, out=buffer)
        with pytest.raises(HostAllocationError, match="mixes host-born"):
            buffer.add_(x)
        with pytest.raises(HostAllocationError, match="mixes host-born"):
            torch.nn.Linear(4, 4)(x)  # a module made in device code without device=: its weights are on the host
        with pytest.raises(HostAllocationError, match="CPU generator"):
            torch.rand(4, generator=torch.Generator(), device=x.device)
        # placed code passes: the policy's device named, moved there, followed from a placed tensor
        g = torch.Generator()
        ok = (torch.zeros(4, device=x.device) + torch.full((4,), 2.0, device=guard.device)
              + torch.from_numpy(np.ones(4, dtype=np.float32)).to(x.device) + buffer.to(x.device)
              + torch.rand(4, generator=g, device=g.device).to(x.device) + torch.zeros_like(x) + x.new_zeros(4))
        ok = ok + torch.nn.Linear(4, 4, device=x.device)(x) + torch.nn.Linear(4, 4).to(x.device)(x)
        buffer[:] = 0.0  # host values into a host buffer
        buffer.copy_(torch.ones(4))
        assert ok.shape == (4,) and not guard.is_host(ok)
    assert torch.from_numpy is real_from_numpy  # restored on exit


def test_the_guard_records_every_site_when_asked():
    """record=True lets each op run and lists every violation and its first specrl (or test) frame."""
    x = torch.ones(3)
    with HostAllocationGuard(place=[x], device=GUARD_DEVICE, record=True) as guard:
        y = torch.arange(3) + x
        z = torch.zeros(3) * x
    assert len(guard.violations) == 2 and len(guard.sites) == 2
    assert all("test_device_placement.py:" in s for s in guard.sites) and y.shape == z.shape == (3,)
