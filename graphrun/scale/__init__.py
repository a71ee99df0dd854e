"""Scaling out: one job spread over several worker processes, or over a Ray cluster.

One host: `graphrun run SPEC --gpus N|all` (workers.py) or `torchrun --nproc-per-node N -m
graphrun run SPEC` (worker.py); each worker runs its share (world.py) into one folder
(layout.py), the input and the model's files hashed once for all of them (input_digest.py),
and one manifest is merged from theirs (merge.py). Many hosts: `graphrun run SPEC
--ray` and graphrun.ray.dataset_map (ray_run.py, ray_data.py), on Ray Data's readers, actor
pools and writers.
"""
