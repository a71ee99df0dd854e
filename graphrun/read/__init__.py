"""The read step: records out of a file (formats/), checked, given ids, grouped and batched."""
