"""Calibrated efficiency factors (written by `specrl simulate fit --write`; do not hand-edit)."""

CALIBRATION = {'source': 'specrl simulate fit on paper_8b.json; median |error| 0.009',
 'efficiency': {'bw_eff': 0.728068,
                'flops_eff': 0.6,
                'step_overhead_s': 0.00187425,
                'draft_overhead_s': 0.00147834,
                'ngram_overhead_s': 0.0005,
                'mfu_logprob': 0.189305,
                'mfu_train': 0.330498,
                'prepare_fixed_s': 1.9068,
                'data_s': 0.225},
 'workload_sigma': {'RL-Think': 1.1227, 'RL-Zero': 0.637763}}
