"""A drafter build recipe: everything `specrl draft build` needs to reproduce a drafter, in one JSON file.

A recipe names the target model, the workload the drafter serves (task, difficulty, answer format, sampling
temperature and length: the RL run's own, since on-policy rollouts at the workload's temperature and template are
the data that matter most), how many prompts are rolled out and how they are sharded, and the training settings
(drafter kind, draft vocabulary size, target top-K, training-time-test depth, the parallel head's `max_k` and
`markov`, the loss: "ce" or "ce+tv" with `tv_weight`, epochs, learning rate). The shipped recipes are
`specrl/drafters/training/build/recipes/*.json`; `Recipe.load` validates a file and names every wrong or unknown
key.
`Recipe.hash()` identifies the rollout data a recipe produces (the fields that change the data), so a build
directory refuses a recipe whose data would differ from the shards it holds, and a build may read another build's
data when their hashes agree (`--data-from`). `build_class` is the drafter class a recipe's kind trains.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from specrl.drafters.trainable import Objective
from specrl.errors import SpecRLError

RECIPES_DIR = Path(__file__).parent / "recipes"
# the fields that decide the rollout data: changing one of them invalidates a build directory's shards
DATA_FIELDS = ("model", "task", "difficulty", "answer_format", "task_seed", "prompts", "heldout_prompts",
               "temperature", "top_p", "max_new_tokens", "seed", "shard_size", "rollout_dtype")


@dataclass(frozen=True)
class Recipe:
    name: str
    model: str = "smollm2-135m"
    task: str = "chain_sum"
    difficulty: str = "easy"
    answer_format: str = "auto"
    task_seed: int = 0
    prompts: int = 2048  # training prompts rolled out (one rollout each)
    heldout_prompts: int = 64  # validation-split prompts the evaluator samples on (never trained on)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    seed: int = 0
    shard_size: int = 64
    rollout_batch: int = 32
    rollout_dtype: str = "auto"
    kind: str = "eagle"  # a kind the build trains from the features stage (`build_class`): eagle, parallel
    draft_vocab_size: int = 8192
    target_topk: int = 32
    ttt_steps: int = 3  # EAGLE's training-time-test depth
    max_k: int = 7  # parallel: the most tokens one forward drafts (its last context entry + max_k - 1 placeholders)
    markov: bool = False  # parallel: each draft after the first also reads the token drafted before it (DSpark)
    loss: str = "ce"  # "ce" (soft cross-entropy against the target's top-K) or "ce+tv" (plus tv_weight * TV distance)
    tv_weight: float = 1.0  # the TV term's weight under loss "ce+tv"
    epochs: int = 6
    lr: float = 1e-3
    batch_size: int = 8
    train_dtype: str = "float32"  # the head's training matmuls: float32, or bfloat16 autocast (float32 weights)
    k: int = 3
    curve: tuple[int, ...] = field(default_factory=tuple)  # shard counts to train on for the scaling curve

    @classmethod
    def load(cls, path: str | Path) -> Recipe:
        """A recipe from a JSON file, or a shipped recipe by name (`think`, `default`)."""
        p = Path(path)
        if not p.exists() and (RECIPES_DIR / f"{path}.json").exists():
            p = RECIPES_DIR / f"{path}.json"
        try:
            raw = json.loads(p.read_text())
        except FileNotFoundError:
            shipped = ", ".join(sorted(x.stem for x in RECIPES_DIR.glob("*.json")))
            raise SpecRLError(f"no recipe file {path!r}; give a JSON file or a shipped recipe name ({shipped})") \
                from None
        except json.JSONDecodeError as e:
            raise SpecRLError(f"recipe {p} is not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise SpecRLError(f"recipe {p} must be a JSON object of recipe fields")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise SpecRLError(f"recipe {p}: unknown field(s) {', '.join(unknown)}; the fields are "
                              f"{', '.join(known)}")
        if "name" not in raw:
            raise SpecRLError(f"recipe {p} has no 'name'")
        if "curve" in raw:
            raw = {**raw, "curve": tuple(raw["curve"])}
        return cls(**raw)

    def __post_init__(self):
        ints = {"prompts": 2, "heldout_prompts": 1, "shard_size": 1, "rollout_batch": 1, "max_new_tokens": 1,
                "draft_vocab_size": 2, "target_topk": 1, "ttt_steps": 1, "epochs": 1, "batch_size": 1, "k": 1,
                "max_k": 1}
        for key, lo in ints.items():
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise SpecRLError(f"recipe {self.name!r}: {key} must be an integer >= {lo}, got {v!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise SpecRLError(f"recipe {self.name!r}: temperature must be > 0 (a drafter for sampled RL "
                              f"rollouts), got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise SpecRLError(f"recipe {self.name!r}: top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise SpecRLError(f"recipe {self.name!r}: lr must be > 0, got {self.lr!r}")
        if self.train_dtype not in ("float32", "bfloat16"):
            raise SpecRLError(f"recipe {self.name!r}: train_dtype must be float32 or bfloat16, got "
                              f"{self.train_dtype!r}")
        if not isinstance(self.markov, bool):
            raise SpecRLError(f"recipe {self.name!r}: markov must be true or false, got {self.markov!r}")
        if self.markov and not build_class(self.kind, where=f"recipe {self.name!r}").takes_markov:
            raise SpecRLError(f"recipe {self.name!r}: markov is an option of kind parallel (its drafts after the "
                              f"first read the token drafted before them), not of kind {self.kind!r}")
        try:
            Objective(self.loss, self.tv_weight)
        except SpecRLError as e:
            raise SpecRLError(f"recipe {self.name!r}: {e}") from None
        build_class(self.kind, where=f"recipe {self.name!r}")
        n_shards = -(-self.prompts // self.shard_size)
        for c in self.curve:
            if not isinstance(c, int) or not 1 <= c <= n_shards:
                raise SpecRLError(f"recipe {self.name!r}: curve entries are shard counts in 1..{n_shards}, "
                                  f"got {c!r}")

    @property
    def objective(self) -> Objective:
        return Objective(self.loss, self.tv_weight)

    @property
    def n_shards(self) -> int:
        return -(-self.prompts // self.shard_size)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["curve"] = list(self.curve)
        return d

    def hash(self) -> str:
        """sha256 of the fields that decide the rollout data (`DATA_FIELDS`)."""
        d = self.as_dict()
        return hashlib.sha256(json.dumps({k: d[k] for k in DATA_FIELDS}, sort_keys=True).encode()).hexdigest()


def build_class(kind: str, where: str = "recipe"):
    """The drafter class `specrl draft build` trains for `kind`: a kind of the table whose class learns from the
    features stage's fused target layers (`TrainableDrafter.builds_from_features`); a SpecRLError naming them
    otherwise."""
    from specrl.rollout.drafter_spec import DRAFTER_KINDS

    ok = {k.name: k.drafter_class for k in DRAFTER_KINDS.values()
          if k.drafter_class is not None and getattr(k.drafter_class, "builds_from_features", False)}
    if kind not in ok:
        raise SpecRLError(f"{where}: kind {kind!r} is not one `specrl draft build` trains; it trains "
                          f"{', '.join(sorted(ok))} (heads that learn from the features stage's fused target layers)")
    return ok[kind]
