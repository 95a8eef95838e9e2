"""specrl.sim.calibration: the simulator held against measurements. Fitting the efficiency factors to measured stage
tables and to specrl's own runs (`calibrate.py`, `specrl simulate fit`), the fitted values it writes and the presets
read (`calibrated.py`), and a real run's stages predicted from its `metrics.jsonl` and `config.yaml` (`fromrun.py`,
`specrl simulate --from-run`). It composes the simulation (`specrl.sim.pipeline`) and its cost models
(`specrl.sim.costs`); the measured tables are the data folder specrl/sim/data/.
"""
