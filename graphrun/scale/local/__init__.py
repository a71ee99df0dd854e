"""One host, several workers: `--gpus N` and torchrun, one folder, one merged manifest."""
