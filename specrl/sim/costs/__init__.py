"""specrl.sim.costs: the simulator's cost models, what a forward pass and a draft cost: the model catalog and
architectures (`models.py`), the accelerator catalog (`accelerators.py`), the roofline of one forward pass
(`roofline.py`) and the drafters' cost and acceptance models (`speculation.py`). The simulation itself
(`specrl.sim.generation`, `specrl.sim.pipeline`) composes them; nothing here imports it.
"""
