"""Scaling out: one job spread over several worker processes.

One host: `graphrun run SPEC --gpus N|all` (workers.py) or `torchrun --nproc-per-node N -m
graphrun run SPEC` (worker.py); each worker runs its share (world.py) into one folder
(layout.py), and one manifest is merged from theirs (merge.py).
"""
