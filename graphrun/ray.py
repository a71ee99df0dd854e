"""graphrun on Ray Data: `graphrun.ray.dataset_map(spec, ds)` maps a Ray Dataset through one
Runner per actor (graphrun/scale/ray/data.py). Needs the ray extra: pip install -e ".[ray]" in
the clone."""

from graphrun.scale.ray.data import Collector, dataset_map

__all__ = ["dataset_map", "Collector"]
