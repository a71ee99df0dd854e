"""The writers of a --ray run: a Ray Datasink per output format that keeps each write task's rows
in order and writes them as one process's shards do.

Ray's own write_parquet hands a task's blocks to pyarrow's threaded dataset writer, which may
write them in any order (a task's first batch can land after its last); outputs must read back
in input order, so these sinks write a task's blocks as they come, through Ray's public Datasink
interface (Dataset.write_datasink), on any filesystem pyarrow reaches. Ray's write_json goes
through pandas, which writes a NaN as null and floats to its own digits; the JSONL sink writes
each row as write/sinks/jsonl.py does (strict JSON: "NaN", "Infinity", "-Infinity").
"""

from __future__ import annotations

import uuid

from ray.data import Datasink


class OrderedSink(Datasink):
    """part-<task>-<write uuid>-<k>.<suffix>, at most rows_per_file rows each, in order."""

    suffix = ""

    def __init__(self, out_dir: str, rows_per_file: int):
        self.out_dir, self.rows_per_file = out_dir, rows_per_file
        self.write_uuid = uuid.uuid4().hex

    def write(self, blocks, ctx) -> None:
        import pyarrow as pa
        import pyarrow.fs

        tables = [pa.table(b) if not isinstance(b, pa.Table) else b for b in blocks]
        tables = [t for t in tables if t.num_rows]  # an all-rejected batch: no columns typed
        if not tables:
            return
        table = pa.concat_tables(tables, promote_options="permissive")
        fs, root = pyarrow.fs.FileSystem.from_uri(self.out_dir)
        for k, start in enumerate(range(0, table.num_rows, self.rows_per_file)):
            name = f"part-{ctx.task_idx:05d}-{self.write_uuid}-{k}.{self.suffix}"
            with fs.open_output_stream(f"{root}/{name}") as f:
                self.write_file(table.slice(start, self.rows_per_file), f)

    def write_file(self, table, f) -> None:
        raise NotImplementedError

    def get_name(self) -> str:
        return f"graphrun {self.suffix}"


class OrderedParquetSink(OrderedSink):
    suffix = "parquet"

    def write_file(self, table, f) -> None:
        import pyarrow.parquet as pq

        pq.write_table(table, f)


class OrderedJsonlSink(OrderedSink):
    """One JSON object a row, its columns in the table's order (id first, as the map puts it)."""

    suffix = "jsonl"

    def write_file(self, table, f) -> None:
        from graphrun.write.strict_json import strict_dumps

        f.write("".join(strict_dumps(row, separators=(",", ":")) + "\n"
                        for row in table.to_pylist()).encode("utf-8"))
