"""The Parquet writer of a --ray run: a Ray Datasink that keeps each write task's rows in order.

Ray's own write_parquet hands a task's blocks to pyarrow's threaded dataset writer, which may
write them in any order (a task's first batch can land after its last); outputs must read back
in input order, so this sink writes a task's blocks as they come, through Ray's public Datasink
interface (Dataset.write_datasink), on any filesystem pyarrow reaches.
"""

from __future__ import annotations

import uuid

from ray.data import Datasink


class OrderedParquetSink(Datasink):
    """part-<task>-<write uuid>-<k>.parquet, at most rows_per_file rows each, in order."""

    def __init__(self, out_dir: str, rows_per_file: int):
        self.out_dir, self.rows_per_file = out_dir, rows_per_file
        self.write_uuid = uuid.uuid4().hex

    def write(self, blocks, ctx) -> None:
        import pyarrow as pa
        import pyarrow.fs
        import pyarrow.parquet as pq

        tables = [pa.table(b) if not isinstance(b, pa.Table) else b for b in blocks]
        tables = [t for t in tables if t.num_rows]  # an all-rejected batch: no columns typed
        if not tables:
            return
        table = pa.concat_tables(tables, promote_options="permissive")
        fs, root = pyarrow.fs.FileSystem.from_uri(self.out_dir)
        for k, start in enumerate(range(0, table.num_rows, self.rows_per_file)):
            name = f"part-{ctx.task_idx:05d}-{self.write_uuid}-{k}.parquet"
            with fs.open_output_stream(f"{root}/{name}") as f:
                pq.write_table(table.slice(start, self.rows_per_file), f)

    def get_name(self) -> str:
        return "graphrun parquet"
