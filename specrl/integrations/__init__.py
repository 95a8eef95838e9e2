"""Adapters that put specrl's rollouts inside trainers people already run.

`specrl.integrations.trl`: TRL's `GRPOTrainer(..., rollout_func=rollout_func(drafter=...))` generates with specrl's
engine (speculative, lossless), on the trainer's current weights, with the certificate and the speculation figures
in TRL's own logs. Nothing here is imported by the rest of specrl: an integration sits on top of the stack.
"""
