"""specrl.sim: the open RL-step performance simulator behind `specrl simulate`.

It projects whether speculative decoding (and async RL) pays for a model, cluster and workload without an
engine or a GPU: catalogs of models and accelerators (`models`, `hardware`), a roofline per forward pass
(`roofline`), drafter and acceptance models (`speculation`), an event-driven continuous-batching simulation
(`generation`), the sync/async RL step (`pipeline`), fitting (`calibrate`), presets, sweeps/advice and the
CLI. Entry point: `simulate(SimConfig(...))` returns the JSON-contract dict described in docs/simulator.md.
"""

from specrl.sim.pipeline import SimConfig, simulate

__all__ = ["SimConfig", "simulate"]
