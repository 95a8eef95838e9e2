"""specrl's rollouts inside TRL's GRPOTrainer (`specrl.integrations.trl`), with the real TRL.

Bad input is refused before any training step, each with what would be right. Two GRPO steps on a tiny model
(and a PEFT/LoRA one) show the engine follows the trainer: its policy version is the trainer's global step, and
the weights it generated with are the trainer's (by digest; a LoRA policy's merged). On the embedded model the
returned log-probs agree with TRL's own recomputation of the same tokens (fp32, temperature only), the figures
reach TRL's logs and the certificate runs at the end of training.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl = pytest.importorskip("trl")

from specrl.errors import SpecRLError  # noqa: E402
from specrl.integrations.trl import rollout_func  # noqa: E402
from specrl.integrations.trl.checks import TRL_MIN, check_prompts, check_trainer, check_trl  # noqa: E402


# ---------------------------------------------------------------- bad input, no trainer needed
@pytest.mark.parametrize("kwargs, match", [
    ({"drafter": "eagle:think", "num_draft_tokens": 9}, "num_draft_tokens"),
    ({"drafter": "eagle:think", "num_draft_tokens": True}, "num_draft_tokens"),
    ({"drafter": "eagle:think", "verify": "greedy"}, "verify"),
    ({"drafter": "eagle:think", "backend": "sglang"}, "backend"),
    ({"drafter": "eagle:think", "rollout_dtype": "fp8"}, "rollout_dtype"),
    ({"drafter": 3}, "drafter spec"),
    ({"drafter": "medusa:x"}, "medusa"),
    ({"drafter": "ngram", "max_seq_len": 0}, "max_seq_len"),
    ({"drafter": "ngram", "certificate_target_w": 0.0}, "certificate_target_w"),
])
def test_bad_options_are_refused_by_name(kwargs, match):
    with pytest.raises(SpecRLError, match=match):
        rollout_func(**kwargs)


def test_a_trl_without_rollout_func_is_refused(monkeypatch):
    fake = types.ModuleType("trl")
    fake.__version__ = "0.19.0"

    class GRPOTrainer:
        def __init__(self, model, reward_funcs, args=None):
            pass

    fake.GRPOTrainer = GRPOTrainer
    monkeypatch.setitem(sys.modules, "trl", fake)
    with pytest.raises(SpecRLError, match=rf"0\.19\.0.*rollout_func.*>= {TRL_MIN}"):
        check_trl()


def test_prompts_not_in_groups_multimodal_or_malformed_are_refused():
    chat = [{"role": "user", "content": "2 + 2?"}]
    check_prompts([chat, chat, "x", "x"], 2)
    with pytest.raises(SpecRLError, match=r"whole groups.*num_generations=4"):
        check_prompts([chat] * 6, 4)
    with pytest.raises(SpecRLError, match="not one prompt repeated"):
        check_prompts(["a", "b"], 2)
    image = [{"role": "user", "content": [{"type": "image", "image": None}, {"type": "text", "text": "what?"}]}]
    with pytest.raises(SpecRLError, match=r"multimodal.*\['image'\]"):
        check_prompts([image, image], 2)
    with pytest.raises(SpecRLError, match=r"prompt.*string.*chat messages"):
        check_prompts([3, 3], 2)
    with pytest.raises(SpecRLError, match="no prompts"):
        check_prompts([], 2)


@pytest.mark.parametrize("setting, match", [
    ({"min_p": 0.1}, "min_p=0.1"),
    ({"repetition_penalty": 1.1}, "repetition_penalty=1.1"),
    ({"tools": [print]}, "tools"),
    ({"environment_factories": {"x": object}}, "environment_factory"),
    ({"args": types.SimpleNamespace(generation_kwargs={"do_sample": False})}, "generation_kwargs"),
    ({"_is_vlm": True}, "vision-language"),
])
def test_trainer_settings_the_engine_would_drop_are_refused(setting, match):
    trainer = types.SimpleNamespace(min_p=None, repetition_penalty=1.0, tools=None, environment_factories=None,
                                    args=types.SimpleNamespace(generation_kwargs=None), _is_vlm=False)
    check_trainer(trainer)
    for k, v in setting.items():
        setattr(trainer, k, v)
    with pytest.raises(SpecRLError, match=match):
        check_trainer(trainer)


def test_an_architecture_the_native_engine_does_not_load_names_what_it_loads_and_vllm():
    from specrl.integrations.trl.weights import check_architecture

    cfg = types.SimpleNamespace(to_dict=lambda: {"architectures": ["GPT2LMHeadModel"]})
    model = types.SimpleNamespace(config=cfg)
    with pytest.raises(SpecRLError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*backend='vllm'"):
        check_architecture(model)


# ---------------------------------------------------------------- a real GRPOTrainer
def _trainer(model_dir, out, rf, steps=2, peft_config=None, batch=4, group=4, length=12):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [{"prompt": [{"role": "user", "content": f"{a} + {a + 1} = ?"}]} for a in range(16)]

    def reward(completions, **kw):
        return [float(len(c[-1]["content"]) % 3) for c in completions]

    args = GRPOConfig(output_dir=str(out), max_steps=steps, per_device_train_batch_size=batch, num_generations=group,
                      max_completion_length=length, temperature=1.0, learning_rate=1e-3, logging_steps=1,
                      save_strategy="no", report_to=[], use_cpu=True, seed=0, gradient_checkpointing=False)
    return GRPOTrainer(model=model, processing_class=tok, reward_funcs=[reward], args=args,
                       train_dataset=Dataset.from_list(rows), rollout_func=rf, peft_config=peft_config)


def _digest_of_trainer(rf):
    from specrl.integrations.trl.weights import policy_tensors
    from specrl.rollout.digest import weights_digest

    with policy_tensors(rf.model) as named:
        return weights_digest(named)


@pytest.fixture
def tiny_dir(tmp_path):
    from tests.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path / "tiny", seed=0)


def test_two_grpo_steps_follow_the_trainers_weights(tiny_dir, tmp_path):
    rf = rollout_func(drafter="ngram", num_draft_tokens=2, certificate_samples=16, certificate_target_w=0.5)
    trainer = _trainer(tiny_dir, tmp_path / "out", rf)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert [h["step"] for h in rf.history] == [0, 1]  # the engine held step 0's, then step 1's weights
    assert rf.version == 2  # the certificate synced the final weights
    held = {k: v for k, v in rf.engine.weights_digest("policy").items() if k in rf.synced_digest}
    assert held == _digest_of_trainer(rf) == rf.synced_digest
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())  # it trained
    logged = [row for row in trainer.state.log_history if "specrl/acceptance_length" in row]
    assert len(logged) == 2 and all(row["specrl/generated_tokens"] > 0 for row in logged)
    assert rf.certificate is not None and rf.certificate["num_tokens"] > 0
    assert (tmp_path / "out" / "specrl_certificate.json").exists()
    assert any("specrl/certificate_p_value" in row for row in trainer.state.log_history)


def test_a_lora_policy_generates_with_its_adapters_merged(tiny_dir, tmp_path):
    peft = pytest.importorskip("peft")
    from specrl.model.hf_checkpoint import hf_named_tensors
    from specrl.rollout.digest import tensor_digest

    rf = rollout_func(drafter="none", certificate=False)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = _trainer(tiny_dir, tmp_path / "out", rf, steps=1, peft_config=cfg)
    q = trainer.model.get_base_model().model.layers[0].self_attn.q_proj
    base0 = q.base_layer.weight.detach().clone()
    merged0 = (base0 + q.get_delta_weight("default")).detach()
    assert not torch.allclose(base0, merged0)
    trainer.train()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert rf.history[-1]["step"] == 0
    # step 0's rollouts came from base + LoRA delta as they were at step 0, not from the bare base weights
    assert rf.synced_digest[name] == tensor_digest(merged0) != tensor_digest(base0)
    rf.version = None
    rf.sync(trainer)  # the trained adapters, merged
    held = hf_named_tensors(rf.engine.model)[name]
    assert torch.allclose(held, q.base_layer.weight + q.get_delta_weight("default"), atol=1e-6)
    assert torch.equal(q.base_layer.weight, base0)  # LoRA trains the adapters only, and they were never merged


def test_the_embedded_model_drafter_for_another_target_is_refused(tiny_dir, tmp_path):
    rf = rollout_func(drafter="eagle:think", certificate=False)
    trainer = _trainer(tiny_dir, tmp_path / "out", rf, steps=1)
    with pytest.raises(SpecRLError, match=r"eagle:think.*embedded.*different"):
        trainer.train()


@pytest.mark.slow
def test_embedded_model_logprobs_match_trls_recomputation(tmp_path):
    """fp32, temperature only: the behaviour log-probs are the trainer's (token_mult_prob_error <= 1.01)."""
    from specrl.model.presets import prepare

    rf = rollout_func(drafter="eagle:think", num_draft_tokens=3, certificate_samples=16, certificate_target_w=0.5)
    trainer = _trainer(prepare("smollm2-135m"), tmp_path / "out", rf, steps=1, batch=4, group=4, length=24)
    trainer.model.eval()
    prompts = [[{"role": "user", "content": "What is 12 + 30?"}]] * 4
    out = rf(prompts, trainer)
    assert rf.history[-1]["acceptance_length"] > 1.0  # speculation ran
    errs = []
    for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"], strict=True):
        ids = torch.tensor([p + c])
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits[0, len(p) - 1:-1].float() / trainer.temperature
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
        errs.append(torch.exp((ref - torch.tensor(lp)).abs()))
    token_mult_prob_error = float(torch.cat(errs).mean())
    assert token_mult_prob_error <= 1.01


@pytest.mark.serial  # two torchrun ranks meet in a gloo process group: `make test` runs it alone
def test_each_process_of_a_two_rank_run_generates_its_slice_on_its_own_engine(tiny_dir, tmp_path):
    """torchrun with 2 CPU processes (gloo): each rank's engine gets its own prompts and seed, and both hold the
    same (DDP-synchronised) weights at every step."""
    import json
    import socket
    import subprocess
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ranks"
    out.mkdir()
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                        str(port), str(Path(__file__).with_name("trl_ranks.py")), str(tiny_dir), str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]
    assert [x["world"] for x in ranks] == [2, 2]
    assert all(x["versions"] == [0, 1] for x in ranks)
    assert ranks[0]["seed"] != ranks[1]["seed"]
    assert ranks[0]["prompts"] != ranks[1]["prompts"]  # each rank its own slice
    assert ranks[0]["digest"] == ranks[1]["digest"]  # the same trained weights on both engines
    assert all(x["certificate_tokens"] for x in ranks)
