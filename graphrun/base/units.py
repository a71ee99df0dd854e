"""Byte units, one definition for every report and budget."""

MiB = 1 << 20
GiB = 1 << 30
