"""specrl.drafters.training.build: building a drafter offline: `specrl draft init` from in-domain rollouts, and
`specrl draft build`'s resumable stages (recipe, rollout shards, target features, fit, held-out evaluation, release).
"""
