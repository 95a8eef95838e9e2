"""Shared fixtures: tiny random HF models of each family and their specrl twins (fp32)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ["OMP_NUM_THREADS"] = "1"  # tests run on one thread; run.threads=auto honours it as its ceiling

import pytest  # noqa: E402
import torch  # noqa: E402

from specrl.model.hf_checkpoint import args_from_hf_config, load_state_into  # noqa: E402
from specrl.model.transformer import Transformer  # noqa: E402

torch.set_num_threads(1)

# `make gpu-check` runs tests/test_device_placement.py with SPECRL_TEST_DEVICE=cuda: those tests move the policy
# there themselves. No default device is set anywhere, so a GPU run tests the code as users run it (a default
# device would turn the library's host allocations into device ones and hide them).
TEST_DEVICE = torch.device(os.environ.get("SPECRL_TEST_DEVICE", "cpu"))


def tiny_hf(family: str, seed: int = 0, **extra):
    """A tiny random transformers model of the given family (llama | qwen2 | qwen3 | llama3rope)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False)
    common.update(extra)
    if family == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif family == "llama3rope":
        cfg = tf.LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 64})
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg, cls = tf.Qwen3Config(**common, head_dim=16), tf.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    model = cls(cfg).eval()
    with torch.no_grad():  # random biases/norms too, so every parameter matters
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model


def specrl_twin(hf_model) -> Transformer:
    d = hf_model.config.to_dict()
    d["architectures"] = [type(hf_model).__name__]
    m = Transformer(args_from_hf_config(d)).eval()
    load_state_into(m, hf_model.state_dict(), "test")
    return m


FAMILIES = ["llama", "qwen2", "qwen3", "llama3rope"]


@pytest.fixture(params=FAMILIES)
def family_pair(request):
    hf = tiny_hf(request.param)
    return request.param, hf, specrl_twin(hf)


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray per test module, started as specrl starts its own (4 logical CPUs: the actors and ranks are tiny;
    loopback only; workers at the driver's priority); shut down at the module's end, so no Ray process outlives the
    tests that started it."""
    import ray

    from specrl.cluster.local_ray import start_local_ray

    start_local_ray(4)
    yield
    ray.shutdown()


# `make test` runs the suite in two parts: the tests marked `serial` (they start Ray, or processes that must meet in a
# process group or within short timeouts) alone, and everything else on several xdist workers before them. A test
# that uses `local_ray` must carry the mark (tests/test_serial_marks.py checks the other ways of starting them), and
# a worker never runs one.
@pytest.hookimpl(trylast=True)  # after `-m` has deselected
def pytest_collection_modifyitems(config, items):
    unmarked = [i.nodeid for i in items if "local_ray" in getattr(i, "fixturenames", ())
                and i.get_closest_marker("serial") is None]
    if unmarked:
        raise pytest.UsageError(f"{len(unmarked)} test(s) use the local_ray fixture without @pytest.mark.serial "
                                f"(first: {unmarked[0]}); mark them, or their module with "
                                f"`pytestmark = pytest.mark.serial`")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        serial = [i.nodeid for i in items if i.get_closest_marker("serial") is not None]
        if serial:
            raise pytest.UsageError(f"{len(serial)} test(s) marked serial were given to an xdist worker (first: "
                                    f"{serial[0]}); run `pytest -n N -m 'not serial'`, then `pytest -m serial` "
                                    f"alone (`make test` does both)")
