"""A learned drafter runs in its target's dtype unless told otherwise; its file keeps the dtype it was saved in.

The shipped heads are stored in bf16. Beside an fp32 target (what `auto` picks on a CPU without bf16 units) they
used to stay bf16, so every draft forward ran bf16 matmuls the CPU emulates. These tests load the shipped heads
through every path the trainer, the rollout backends and the CLI use (a shipped name, a drafter directory) and check
the dtype of every floating tensor, that an explicit dtype wins, that the file-level loader keeps the stored dtype,
and that the upcast weights are exactly the stored ones.
"""

import pytest
import torch

from specrl.drafters import make_drafter
from specrl.drafters.storage import shipped
from specrl.drafters.storage.default import resolve_drafter
from specrl.drafters.storage.io import load_drafter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def targets():
    from specrl import load_model

    return {dt: load_model("smollm2-135m", dtype=dt)[0] for dt in ("float32", "bfloat16")}


def float_dtypes(drafter) -> set[torch.dtype]:
    return {t.dtype for t in drafter.state_dict().values() if t.is_floating_point()}


@pytest.mark.parametrize("spec", ["eagle:think", "parallel:think-parallel-markov"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_shipped_head_runs_in_its_targets_dtype(targets, spec, dtype):
    target = targets[str(dtype).removeprefix("torch.")]
    assert float_dtypes(resolve_drafter(spec, target)) == {dtype}


def test_a_drafter_directory_runs_in_its_targets_dtype(targets):
    d = shipped.shipped_dir("think")
    assert float_dtypes(make_drafter(f"eagle:{d}", targets["float32"])) == {torch.float32}


def test_an_explicit_dtype_wins_over_the_targets(targets):
    assert float_dtypes(resolve_drafter("eagle:think", targets["float32"], torch.bfloat16)) == {torch.bfloat16}


def test_the_file_loader_keeps_the_stored_dtype(targets):
    stored = getattr(torch, shipped.SHIPPED_DTYPE)
    assert float_dtypes(load_drafter(shipped.shipped_dir("think"), targets["float32"])) == {stored}


def test_the_upcast_weights_are_the_stored_ones(targets):
    as_stored = load_drafter(shipped.shipped_dir("think"), targets["float32"]).state_dict()
    upcast = resolve_drafter("eagle:think", targets["float32"]).state_dict()
    assert as_stored.keys() == upcast.keys()
    for name, t in as_stored.items():
        assert torch.equal(upcast[name], t.to(upcast[name].dtype)), name
