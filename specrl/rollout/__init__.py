"""specrl.rollout"""
