"""specrl.drafters.storage: drafters on disk. The drafter directory format (`io.py`: config.json and
model.safetensors), its `manifest.json` and the check every load runs (`manifest.py`), the drafters shipped inside
the package (`shipped.py`; their files are the data folder specrl/drafters/shipped/), the embedded model's
default drafters and the specs that name them (`default.py`) and the export to vLLM's EAGLE-3 layout
(`export.py`).
"""
