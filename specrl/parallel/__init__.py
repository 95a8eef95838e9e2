"""specrl.parallel: the data-parallel learner rank: the policy learner sharded with FSDP2 over a torch.distributed
process group. torch.distributed only; the ranks are placed by `specrl.cluster`.
"""
