"""specrl.trainer: one RL step in one process: the config checked against the registries (`config_check.py`), the
rollout producer (`producer.py`), the learner contract (`protocol.py`) and the one-process learner (`learner.py`)
with its scoring forward (`scoring.py`) and its optimizer and schedule builders (`optim.py`), the synchronous
trainer that composes them (`sync_trainer.py`), and the versioned weight sync with its checks (`weight_sync.py`,
`weight_check.py`).
"""
