"""`SpecRLRollouts`: the callable TRL's `GRPOTrainer(rollout_func=...)` calls with each process's prompt slice.

On its first call it reads what it needs from the trainer (the policy, tokenizer and chat template, num_generations,
max_completion_length, temperature / top-p / top-k), refuses what specrl's engine would not honour
(`checks.py`), builds the engine (specrl's native engine on an in-memory copy of the trainer's policy, or the vLLM
backend on the model's checkpoint directory) with the drafter, and registers the certificate callback. Before
every call whose `trainer.state.global_step` differs from the step the engine holds, it loads the trainer's current
weights (a PEFT model's merged) into the engine and checks the engine's acknowledgement digest against them
(`specrl.rollout.digest.check_refit`), so no token is generated with other weights. It tokenizes as TRL does,
generates one completion per prompt entry (TRL repeats each prompt num_generations times), and returns
`prompt_ids`, `completion_ids` and `logprobs`: the behaviour log-probs of the distribution each token was sampled
from (temperature, top-p, top-k applied). The call's speculation figures go into the trainer's metrics under
`specrl/...`, which TRL averages into every `trainer.log` (so wandb / tensorboard get them).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from specrl.errors import SpecRLError
from specrl.integrations.trl.checks import check_prompts, check_trainer, check_trl
from specrl.rollout.drafter_spec import drafts, parse_drafter_spec
from specrl.rollout.spec_decode.verify import VERIFY_MODES

BACKENDS = ("native", "vllm")
DTYPES = {"match": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
K_MAX = 7
LOGGED = ("acceptance_length", "acceptance_rate", "draft_tokens", "accepted_tokens", "generated_tokens",
          "num_draft_tokens_mean", "tokens_per_second")


class SpecRLRollouts:
    """TRL's `rollout_func`: speculative (or plain) generation with specrl's engine on the trainer's policy."""

    def __init__(self, drafter: str | None, num_draft_tokens: int | str = "auto", verify: str = "rejection",
                 backend: str = "native", rollout_dtype: str = "match", max_batch_size: int | None = None,
                 max_seq_len: int | None = None, certificate: bool = True, certificate_samples: int = 192,
                 certificate_target_w: float = 0.10,
                 staleness_fraction: float = 0.85):
        self.trl_version = check_trl()
        if drafter is not None and not isinstance(drafter, str):
            raise SpecRLError(f"rollout_func: drafter must be a drafter spec such as 'eagle:think', 'ngram' or "
                              f"'none', got {drafter!r}")
        self.drafter_spec = drafter or "none"
        if drafts(self.drafter_spec):
            parse_drafter_spec(self.drafter_spec)  # an unknown kind is refused here, with the kinds there are
        if num_draft_tokens != "auto" and (isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int)
                                           or not 1 <= num_draft_tokens <= K_MAX):
            raise SpecRLError(f"rollout_func: num_draft_tokens must be an integer in 1..{K_MAX} or 'auto', got "
                              f"{num_draft_tokens!r}")
        if verify not in VERIFY_MODES:
            raise SpecRLError(f"rollout_func: verify={verify!r} is unknown; use one of {list(VERIFY_MODES)}")
        if backend not in BACKENDS:
            raise SpecRLError(f"rollout_func: backend={backend!r} is unknown; use one of {list(BACKENDS)}")
        if rollout_dtype not in DTYPES:
            raise SpecRLError(f"rollout_func: rollout_dtype={rollout_dtype!r} is unknown; use one of {list(DTYPES)} "
                              "('match': the trainer model's dtype, so the log-probs agree with TRL's scoring)")
        for name, v in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise SpecRLError(f"rollout_func: {name} must be a positive integer or None, got {v!r}")
        if not 0 < staleness_fraction < 1:
            raise SpecRLError(f"rollout_func: staleness_fraction must be in (0, 1), got {staleness_fraction!r}")
        self.num_draft_tokens = num_draft_tokens
        self.verify = verify
        self.backend_name = backend
        self.rollout_dtype = rollout_dtype
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.certificate_enabled = certificate
        self.certificate_samples = certificate_samples
        if not 0 < certificate_target_w <= 1:
            raise SpecRLError(f"rollout_func: certificate_target_w must be a Cohen's w in (0, 1], got "
                              f"{certificate_target_w!r}")
        self.certificate_target_w = certificate_target_w
        self.staleness_fraction = staleness_fraction
        self.engine = None
        self.trainer = None
        self.version: int | None = None
        self.calls = 0
        self.next_request = 0
        self.history: list[dict[str, Any]] = []  # one row per call: the figures logged
        self.certificate: dict[str, Any] | None = None
        self.health = None
        self.seen_prompts: list[list[int]] = []

    @property
    def speculative(self) -> bool:
        return drafts(self.drafter_spec)

    # ------------------------------------------------------------------ the call TRL makes
    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        if self.trainer is None:
            self._attach(trainer)
        elif trainer is not self.trainer:
            raise SpecRLError("rollout_func (specrl): one rollout_func(...) object serves one trainer; make another "
                              "for a second GRPOTrainer")
        mode = "train" if trainer.model.training else "eval"
        group = trainer.num_generations if mode == "train" else trainer.num_generations_eval
        check_prompts(prompts, group)
        self.sync(trainer)
        prompt_ids = self._tokenize(prompts, trainer)
        if len(self.seen_prompts) < 8:
            self.seen_prompts.extend(p for p in prompt_ids[::group][: 8 - len(self.seen_prompts)])
        longest = max(len(p) for p in prompt_ids) + trainer.max_completion_length
        if longest > self.engine_max_seq_len:
            raise SpecRLError(f"rollout_func (specrl): a prompt of {longest - trainer.max_completion_length} tokens "
                              f"plus max_completion_length={trainer.max_completion_length} needs {longest} positions; "
                              f"the engine holds {self.engine_max_seq_len}: pass rollout_func(max_seq_len={longest})"
                              " or shorter prompts")
        from specrl.rollout.protocol import RolloutRequest

        requests = [RolloutRequest(list(p), self.next_request + i) for i, p in enumerate(prompt_ids)]
        self.next_request += len(requests)
        t0 = time.perf_counter()
        result = self.engine.generate(requests, self._params(trainer))
        seconds = time.perf_counter() - t0
        self.calls += 1
        self._log(trainer, mode, result.metrics, seconds)
        return {"prompt_ids": prompt_ids, "completion_ids": [list(o.token_ids) for o in result],
                "logprobs": [list(o.logprobs) for o in result]}

    # ------------------------------------------------------------------ set-up
    def _attach(self, trainer) -> None:
        from specrl.integrations.trl.weights import base_model, check_architecture

        check_trainer(trainer)
        self.trainer = trainer
        self.model = trainer.accelerator.unwrap_model(trainer.model)
        if self.backend_name == "native":
            check_architecture(self.model)
        self.tokenizer = getattr(trainer.processing_class, "tokenizer", None) or trainer.processing_class
        eos = set(getattr(trainer, "eos_token_ids", None) or [])
        if not eos and self.tokenizer.eos_token_id is not None:
            eos = {int(self.tokenizer.eos_token_id)}
        self.stop_ids = tuple(sorted(int(t) for t in eos))
        self.process_index = int(getattr(trainer.accelerator, "process_index", 0))
        self.seed = (int(trainer.args.seed) + 1_000_003 * self.process_index) % (2**63 - 1)
        per_call = trainer.args.per_device_train_batch_size * trainer.args.steps_per_generation
        self.engine_batch = self.max_batch_size or max(1, min(64, per_call))
        max_pos = int(base_model(self.model).config.max_position_embeddings)
        self.engine_max_seq_len = self.max_seq_len or min(max_pos, 512 + int(trainer.max_completion_length))
        if self.engine_max_seq_len > max_pos:
            raise SpecRLError(f"rollout_func: max_seq_len={self.engine_max_seq_len} exceeds the model's "
                              f"max_position_embeddings {max_pos}")
        self.engine = self._build_engine(trainer)
        if self.speculative:
            from specrl.drafters.training.online import DrafterHealth

            self.health = DrafterHealth(self.staleness_fraction, 1.05, 2)
        from specrl.integrations.trl.callback import SpecRLCallback

        trainer.add_callback(SpecRLCallback(self))

    def _dtype(self) -> torch.dtype:
        want = DTYPES[self.rollout_dtype]
        return want if want is not None else next(self.model.parameters()).dtype

    def _build_engine(self, trainer):
        if self.backend_name == "vllm":
            from specrl.integrations.trl.vllm import vllm_engine

            return vllm_engine(self, trainer)
        from specrl.drafters.storage.default import resolve_drafter
        from specrl.integrations.trl.weights import engine_model
        from specrl.rollout.engine import RolloutEngine

        device = trainer.accelerator.device
        model = engine_model(self.model, self._dtype(), device)
        model.checkpoint_dir = self._tokenizer_dir()  # a drafter's manifest checks the target by its vocabulary
        drafter = resolve_drafter(self.drafter_spec, model) if self.speculative else None
        self.version = None  # engine_model copied the weights; sync() checks and records the version
        return RolloutEngine(model, max_batch_size=self.engine_batch, max_seq_len=self.engine_max_seq_len,
                             drafter=drafter, num_draft_tokens=self.num_draft_tokens if drafter is not None else 0,
                             verify=self.verify, k_max=K_MAX)

    def _tokenizer_dir(self):
        """A directory holding the trainer's tokenizer files (saved once, in a temporary directory): the identity
        a drafter's manifest compares against what it was trained for."""
        import atexit
        import shutil
        import tempfile
        from pathlib import Path

        d = Path(tempfile.mkdtemp(prefix="specrl-trl-tokenizer-"))
        atexit.register(shutil.rmtree, d, True)
        self.tokenizer.save_pretrained(str(d))
        return d

    # ------------------------------------------------------------------ weights
    def sync(self, trainer) -> None:
        """Load the trainer's current weights when its global step moved, and prove the engine holds them."""
        from specrl.integrations.trl.weights import policy_tensors
        from specrl.rollout.digest import check_refit

        step = int(trainer.state.global_step)
        if step == self.version:
            return
        with policy_tensors(self.model) as named:
            ack = self.engine.load_weights("policy", named, step)
            check_refit(named, ack, "policy", self.backend_name, step)
        self.version = step
        self.synced_digest = ack

    # ------------------------------------------------------------------ prompts and sampling
    def _tokenize(self, prompts: list, trainer) -> list[list[int]]:
        """Token ids as TRL's own generation path makes them (chat template for conversational prompts)."""
        from trl.data_utils import is_conversational

        pc = trainer.processing_class
        if is_conversational({"prompt": prompts[0]}):
            out = pc.apply_chat_template(conversation=prompts, chat_template=getattr(trainer, "chat_template", None),
                                         add_generation_prompt=True, tokenize=True, return_dict=True,
                                         **(getattr(trainer, "chat_template_kwargs", None) or {}))
            return [list(map(int, ids)) for ids in out["input_ids"]]
        return [list(map(int, ids)) for ids in pc(text=prompts)["input_ids"]]

    def _params(self, trainer):
        from specrl.rollout.sampling import SamplingParams

        return SamplingParams(temperature=float(trainer.temperature), top_p=float(trainer.top_p or 1.0),
                              top_k=int(trainer.top_k or 0), max_new_tokens=int(trainer.max_completion_length),
                              stop_token_ids=self.stop_ids, seed=self.seed)

    # ------------------------------------------------------------------ what TRL logs
    def _log(self, trainer, mode: str, m: dict, seconds: float) -> None:
        row = {key: float(m.get(key, 0.0)) for key in LOGGED}
        row["generation_seconds"] = seconds
        row["policy_version"] = float(self.version or 0)
        if self.health is not None and m.get("verify_steps"):
            stale, _ = self.health.observe(row["acceptance_length"], self.calls)
            row["drafter_stale"] = float(stale)
        self.history.append({"mode": mode, "step": self.version, **row})
        metrics = getattr(trainer, "_metrics", None)
        if metrics is None:
            raise SpecRLError(f"TRL {self.trl_version}'s GRPOTrainer keeps no _metrics; specrl cannot add its figures "
                              "to the trainer's logs")
        for key, value in row.items():
            metrics[mode][f"specrl/{key}"].append(value)


def rollout_func(drafter: str | None, num_draft_tokens: int | str = "auto", **options) -> SpecRLRollouts:
    """The callable for `GRPOTrainer(..., rollout_func=rollout_func(drafter="eagle:think"))`.

    `drafter`: a drafter spec ('eagle:think', 'ngram', 'eagle:DIR', ...; 'none' for plain decoding on specrl's
    engine). `num_draft_tokens`: k (1..7) or 'auto'. Options: `verify` ('rejection' | 'seed_exact'), `backend`
    ('native' | 'vllm'), `rollout_dtype` ('match' the trainer model's dtype, 'float32', 'bfloat16'),
    `max_batch_size`, `max_seq_len` (the engine's), `certificate` (run the losslessness certificate at the end of
    training; default on), `certificate_samples` (the fewest continuations), `certificate_target_w` (the bias it is
    sized to detect at power 0.99; default 0.10), `staleness_fraction` (the drafter staleness alarm)."""
    return SpecRLRollouts(drafter, num_draft_tokens, **options)
