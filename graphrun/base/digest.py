"""A file's sha256, read in blocks of a MiB. Standalone (hashlib only): the input hash's child
process runs this module's source in an isolated interpreter (write/journal.InputHash)."""

import hashlib


def file_sha256(path, size=None):
    """A sha256 object fed the file's bytes, or its first `size` bytes (a writer that resumes
    goes on feeding it what it appends)."""
    h = hashlib.sha256()
    if size == 0:  # nothing to read: the file need not exist
        return h
    with open(path, "rb") as f:
        while size is None or size > 0:
            chunk = f.read(1 << 20 if size is None else min(size, 1 << 20))
            if not chunk:
                break
            h.update(chunk)
            if size is not None:
                size -= len(chunk)
    return h
