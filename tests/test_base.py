"""base/: the helpers every layer shares (a file's sha256, the error chain, the wall clock)."""

import hashlib
import re

from graphrun.base.digest import file_sha256
from graphrun.base.errors import error_chain
from graphrun.base.phases import utc_now


def test_a_file_s_sha256_whole_and_of_its_first_bytes(tmp_path):
    path = tmp_path / "f.bin"
    data = bytes(range(256)) * 9000  # past one block of a MiB
    path.write_bytes(data)
    assert file_sha256(path).hexdigest() == hashlib.sha256(data).hexdigest()
    assert file_sha256(path, 1_500_000).hexdigest() == hashlib.sha256(data[:1_500_000]).hexdigest()
    # nothing to read: a file that is not there yet hashes as empty
    assert file_sha256(tmp_path / "none", 0).hexdigest() == hashlib.sha256().hexdigest()


def test_the_error_chain_follows_context_cause_and_a_wrapper_s_cause_once_each():
    class Wrapped(Exception):  # as Ray wraps an actor's error
        def __init__(self, cause):
            super().__init__("wrapped")
            self.cause = cause

    inner = ValueError("inner")
    try:
        try:
            raise inner
        except ValueError as e:
            raise KeyError("middle") from e
    except KeyError as e:
        middle = e
    outer = Wrapped(middle)
    assert error_chain(outer) == [outer, middle, inner]
    inner.__context__ = middle  # a loop ends at the first error seen again
    assert error_chain(middle) == [middle, inner]
    assert error_chain(None) == []


def test_utc_now_is_an_iso_time_to_the_second():
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", utc_now())
