"""Many hosts: `graphrun run --ray` and graphrun.ray.dataset_map on Ray Data."""
