"""Scaling out: one job spread over several worker processes, or over a Ray cluster.

One host: `graphrun run SPEC --gpus N|all` (local/workers.py) or `torchrun --nproc-per-node N -m
graphrun run SPEC` (local/worker.py); each worker runs its share (local/world.py) into one folder
(write/job_layout.py), the input and the model's files hashed once for all of them (local/input_digest.py),
and one manifest is merged from theirs (local/merge.py). Many hosts: `graphrun run SPEC
--ray` and graphrun.ray.dataset_map (ray/run.py, ray/data.py), on Ray Data's readers, actor
pools and writers.
"""
