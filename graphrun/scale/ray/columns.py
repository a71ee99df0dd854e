"""The columns graphrun adds to a Ray dataset before the map (data.py, jsonl.py)."""

# The input's record ordinal: the id of a record without data.id_field, and the position a
# reject reports.
ORDINAL = "graphrun_ordinal"
# A JSONL input's line rows (jsonl.py): the line's number in the file and its bytes.
LINE_NO = "graphrun_line"
LINE_TEXT = "graphrun_json"
