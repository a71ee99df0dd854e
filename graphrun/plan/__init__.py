"""Bucket planning from the data, shared by `buckets: auto` (auto.py) and `graphrun plan`."""
