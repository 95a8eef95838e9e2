"""The local Ray that specrl starts for itself (the async pipeline, the N-rank learner): loopback only, no dashboard,
and its workers at the driver's scheduling priority.

Ray starts worker processes with niceness 15 (its `worker_niceness` setting) so that its own daemons stay responsive.
specrl's actors are not background work: they are the training job (the learner ranks, the rollout workers). At
niceness 15 any ordinary process on the machine (another job, a build, a test run) takes their CPU first: on a
2-core machine with two competing busy processes, an async GRPO step of `examples/short.yaml` took 247 s, 237 s
of it in the learner's train stage. The sync pipeline, one ordinary process, has no such handicap, so the
Ray that specrl starts runs its workers at niceness 0, as the driver does. A cluster the user started
(`pipeline.ray_address`) keeps its own setting (`RAY_worker_niceness` when starting it).
"""

from __future__ import annotations

WORKER_NICENESS = 0  # the driver's priority: specrl's actors are the job, not background work


def start_local_ray(num_cpus: int) -> None:
    """`ray.init` a local Ray with `num_cpus` logical CPUs on 127.0.0.1, workers at niceness WORKER_NICENESS."""
    import ray

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             _node_ip_address="127.0.0.1", configure_logging=False,
             _system_config={"worker_niceness": WORKER_NICENESS})
