"""specrl.sim: the open RL-step performance simulator behind `specrl simulate`.

It projects whether speculative decoding (and async RL) pays for a model, cluster and workload without an
engine or a GPU. Its cost models are `costs/` (catalogs of models and accelerators, a roofline per forward pass,
drafter and acceptance models); the simulation against measurements is `calibration/` (fitting the efficiency
factors, their fitted values, a real run predicted from its metrics); this folder is the simulation that uses
them: the workload (`workload.py`), an event-driven continuous-batching simulation (`generation.py`), the
sync/async RL step (`pipeline.py`), presets (`scenarios.py`), sweeps and advice (`sweep.py`), the report
(`report.py`) and the CLI (`commands.py`). Entry point: `simulate(SimConfig(...))` returns the JSON-contract dict
described in docs/simulator.md.
"""

from specrl.sim.pipeline import SimConfig, simulate

__all__ = ["SimConfig", "simulate"]
