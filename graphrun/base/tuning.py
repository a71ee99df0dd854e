"""How hard the data path works: threads, processes and chunk sizes, built once per run from
the machine's cores and the environment (envs.py), and passed down to the readers and the
writer. Tests construct one (or dataclasses.replace a default) instead of patching globals.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphrun.base import envs
from graphrun.base.cores import usable_cores


@dataclass(frozen=True)
class Tuning:
    # ---- reading ----
    # npy/npz/Parquet rows read at once: about this many bytes, and at most this many rows (a
    # record may also cost Python objects, a string id, whatever its array bytes)
    array_chunk_bytes: int = 16 << 20
    array_chunk_rows: int = 16384
    jsonl_chunk_bytes: int = 256 << 10  # JSONL lines parsed and converted together
    # child processes parsing JSONL blocks, off this process's GIL; only for files this big
    # (the children take a while to start)
    jsonl_workers: int = 0
    jsonl_workers_min_bytes: int = 1 << 20
    # data.text read in this process: threads parsing and tokenizing JSONL blocks ahead of the
    # stream (the tokenizer's batch encoding runs off the GIL, on its own threads), and how
    # many blocks they hold ahead at most; 0 threads: in line, on the stream's thread
    text_threads: int = 2
    text_ahead: int = 4
    # batches read ahead of the stream, on their own thread, at most this many bytes (and
    # always the next one): the reading and tokenizing run during setup's imports, where
    # cores are spare (from_machine: none below 6 cores, where it slows the imports down)
    read_ahead_bytes: int = 256 << 20
    rejects_held: int = 4096  # a longer run of bad records is handed out without a full batch
    # Parquet row groups decoded at once: pyarrow decodes a column chunk on one thread only
    parquet_threads: int = 2
    # decoded row groups waiting ahead of the reader, those being decoded included
    parquet_ahead_bytes: int = 1 << 30
    # a row group bigger than this decoded is streamed a batch at a time, not decoded whole
    parquet_group_bytes: int = 128 << 20
    parquet_nice: int = 5  # decoding threads run this much below the launcher's priority
    # a streamed row group's pages read this many bytes at a time (not a column chunk at once)
    parquet_buffer_bytes: int = 1 << 20
    # ---- writing ----
    row_writers: int = 1  # threads writing big npy batches at their offsets
    row_pool_bytes: int = 1 << 20  # npy batches at least this big go to those threads
    row_pool_pending: int = 8  # batches handed to them and not yet written, at most
    parquet_row_group_bytes: int = 64 << 20  # output row groups cut by bytes: resumable
    # sha256 re-reads files on these threads while the disk fsyncs others
    hashers: int = 3
    # an npy shard's file is hashed and flushed each time this many more bytes are written
    # (write/ahead.py): a step reads them back from the page cache
    hash_step_bytes: int = 8 << 20
    # shards handed to the committer and not yet journaled; past it the writer waits
    in_flight: int = 4
    # ---- hashing ----
    # input and model files at least this big have their sha256 kept between runs
    # (write/digests.py); smaller ones hash in well under 50 ms
    hash_keep_bytes: int = 64 << 20

    @classmethod
    def from_machine(cls, cores: int | None = None, environ=None, **given) -> "Tuning":
        """Sized by `cores` (default: the cores this process may use), overridden by the
        GRAPHRUN_* variables of `environ` (default: os.environ), then by `given`."""
        cores = usable_cores() if cores is None else cores
        # every core but four (the stager, launcher, completer and the CUDA driver's)
        parquet = max(min(cores, 2), min(12, cores - 4))
        jsonl = min(8, cores - 4) if cores >= 6 else 0
        sized = dict(
            parquet_threads=envs.integer("GRAPHRUN_PARQUET_THREADS", parquet, 1, environ),
            jsonl_workers=envs.integer("GRAPHRUN_JSONL_WORKERS", jsonl, 0, environ),
            text_threads=envs.integer("GRAPHRUN_TEXT_THREADS", min(2, cores), 0, environ),
            read_ahead_bytes=envs.integer("GRAPHRUN_READ_AHEAD_BYTES",
                                          cls.read_ahead_bytes if cores >= 6 else 0, 0, environ),
            row_writers=envs.integer("GRAPHRUN_ROW_WRITERS", min(4, cores), 1, environ),
            row_pool_bytes=envs.integer("GRAPHRUN_ROW_POOL_BYTES", cls.row_pool_bytes, 1,
                                        environ),
        )
        return cls(**{**sized, **given})
