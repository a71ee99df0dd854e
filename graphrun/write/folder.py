"""Which files of an output folder graphrun wrote, and the lock that keeps a second process out.

graphrun deletes (--overwrite, --resume, a restart after a failed setup) only what it can show
it wrote: nothing in a folder without its run.json (the mark it writes first, into a folder
that was new or empty), and in a marked folder only its fixed bookkeeping names, the shards its
journal lists, and shard-shaped names (`part-00007.ids.npy`, `.part-00007.jsonl.tmp`: the
format's exact suffixes, which run.json records) numbered from the first shard not yet
journaled. A Ray run's folder (run.json's "ray") holds Ray's writers' files under their own
names until the run renames them (RAY_PART): run.json, written before them, makes them
graphrun's. A user's `part-1-of-my-thesis.docx` or `.secret.tmp` is never graphrun's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import sys
from pathlib import Path

from graphrun.base.errors import OutputError
from graphrun.manifest.keys import Manifest
from graphrun.write.journal import (JOURNAL, REJECTS, RUN_JSON, SPEC_COPY, InputHash, ResumePoint,
                                    ShardPlace, check_committed, fsync_path, journal_names,
                                    listed_names, read_journal, remove_and_sync, shard_number)
from graphrun.write.finished import FINISHED, FINISHED_TMP
from graphrun.write.guard import only_a_first_mark_temp, refuse_foreign
from graphrun.write.job_layout import WORKERS, is_job, job_shards, workers_entry
from graphrun.base.nofollow import open_file, read_own, refuse_links
from graphrun.base.tuning import Tuning

MANIFEST = "manifest.json"
LATENCIES = "latencies.jsonl"
# Bookkeeping files, and the temp names they are replaced through.
FIXED_NAMES = frozenset({JOURNAL, REJECTS, RUN_JSON, MANIFEST, LATENCIES, f".{RUN_JSON}.tmp",
                         f"{MANIFEST}.tmp", f"{LATENCIES}.tmp", f"{REJECTS}.tmp", FINISHED,
                         FINISHED_TMP})
# What a Ray run's writers name a file: part-<task>-<write uuid>[-<k>].<format> (scale/ray)
RAY_PART = re.compile(r"part-(\d{5})-([0-9a-f]{32})(?:[-_](\d+))?\.(parquet|jsonl)")


def read_mark(out_dir: Path) -> dict | None:
    """run.json when it is graphrun's (an object with a spec_sha256), else None."""
    try:
        data = json.loads(read_own(out_dir / RUN_JSON))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("spec_sha256"), str) else None


def own_entries(out_dir: Path, listed: set[str], unfinished: list[ShardPlace]
                ) -> tuple[list, list]:
    """(graphrun's files, everything else) in out_dir. listed: the shard files its journal
    names (a job's: its workers' journals); unfinished: the shard numbers not journaled (from
    the next shard on; a job's: each worker's rest of its range), whose files and temps are a
    run's unfinished work. A job's workers/ folder is graphrun's if it holds only workers'
    folders of graphrun's names."""
    mark = read_mark(out_dir)
    suffixes = mark.get("shards") if mark else None
    suffixes = suffixes if isinstance(suffixes, list) else []
    own, foreign = [], []
    entries = sorted(out_dir.iterdir())
    if mark is None and [p.name for p in entries] == [f".{RUN_JSON}.tmp"]:
        return entries, []  # a run killed while it first wrote run.json: nothing else here
    for p in entries:
        mine = False
        if is_job(mark) and p.name == WORKERS:
            mine = _workers_own(p)
        elif mark is not None and p.is_file() and not p.is_symlink():
            k = shard_number(p.name, suffixes)
            mine = (p.name in FIXED_NAMES or p.name in listed
                    or any(r.holds(k) for r in unfinished) or _ray_part(mark, p.name))
        (own if mine else foreign).append(p)
    return own, foreign


def _ray_part(mark: dict, name: str) -> bool:
    """A Ray run's writer's file not renamed yet (the run was killed while writing)."""
    if mark.get("ray") is not True:
        return False
    m = RAY_PART.fullmatch(name)
    return m is not None and m.group(4) in (mark.get("shards") or [])


def _workers_own(folder: Path) -> bool:
    """workers/ holds only rank-K folders of graphrun's bookkeeping files, and their progress
    and log files (job_layout.py)."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    for sub in folder.iterdir():
        kind = workers_entry(sub.name)
        if sub.is_symlink() or kind is None or (kind == "file") != sub.is_file():
            return False
        if kind == "dir" and any(p.name not in FIXED_NAMES or p.is_symlink() or not p.is_file()
                                 for p in sub.iterdir()):
            return False
    return True


def input_inside(out_dir: Path, input_path: Path) -> bool:
    """The input file is in out_dir or under it (then --overwrite could delete it)."""
    try:
        input_path.resolve().relative_to(out_dir.resolve())
    except (ValueError, OSError, RuntimeError):
        return False
    return True


def model_files(model, base_dir: Path) -> dict[str, Path]:
    """The files the model is made of, by role: weights, exported or TorchScript archive, and
    the source file of a `target` module (found as Python would import it, without importing
    it; not the packages that file imports)."""
    files = {role: getattr(model, role) for role in ("weights", "exported", "torchscript")
             if getattr(model, role, None) is not None}
    if getattr(model, "target", None):
        source = target_source(model.target, base_dir)
        if source is not None:
            files["target"] = source
    if getattr(model, "hf", None) is not None:
        files.update(hf_files(model.hf.path, base_dir))
    return {role: Path(p) for role, p in files.items()}


def hf_files(path: str, base_dir: Path) -> dict[str, Path]:
    """A local Hugging Face folder's files (weights, config, ...), by role "hf/<name>"; none
    for a hub name (its cache is the hub's) or a folder that is not there (validate says)."""
    from graphrun.base.errors import ModelError
    from graphrun.spec.paths import resolve_path

    try:
        folder = Path(resolve_path(path, base_dir))
    except ModelError:
        return {}
    if not folder.is_dir():
        return {}
    return {f"hf/{p.name}": p for p in sorted(folder.iterdir()) if p.is_file()}


def target_source(target: str, base_dir: Path) -> Path | None:
    """The .py file of "pkg.module:fn" (beside the spec, then on sys.path) or "file.py:fn"."""
    module = target.rpartition(":")[0]
    if module.endswith(".py"):
        path = Path(module) if Path(module).is_absolute() else base_dir / module
        return path if path.is_file() else None
    parts = module.split(".")
    for entry in [str(base_dir)] + sys.path:
        root = Path(entry or ".").joinpath(*parts)
        for candidate in (root.with_suffix(".py"), root / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


class FilesHash:
    """InputHash for several files at once, by name; result() is {name: sha256}."""

    def __init__(self, files: dict[str, Path], keep_bytes: int = Tuning.hash_keep_bytes):
        self.hashes = {name: InputHash(path, keep_bytes) for name, path in files.items()}

    @property
    def waited_s(self) -> float:
        return sum(h.waited_s for h in self.hashes.values())

    @property
    def source(self) -> dict[str, str | None]:
        """Per file, where its digest came from (InputHash.source)."""
        return {name: h.source for name, h in self.hashes.items()}

    def result(self) -> dict[str, str]:
        try:
            return {name: h.result() for name, h in self.hashes.items()}
        except BaseException:
            self.stop()
            raise

    def stop(self) -> dict[str, str | None]:
        return {name: h.stop() for name, h in self.hashes.items()}


class FolderLock:
    """An exclusive flock on the output folder itself, held for the whole run: a second
    graphrun process on the same folder is refused instead of deleting the first one's files.
    No lock file is left behind. (flock is advisory; on some network filesystems it is local
    to one machine, and where the filesystem has no locks at all the run goes on unlocked.)"""

    def __init__(self, out_dir: Path, shared: bool = False):
        self.out_dir, self.shared = Path(out_dir), shared  # shared: a job's workers, side by side
        self.fd: int | None = None

    def __enter__(self) -> "FolderLock":
        self.out_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.out_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP):  # a filesystem without locks
                return self
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            pid = lock_holder(self.out_dir)
            who = f"pid {pid}" if pid else "another process"
            raise OutputError(f"output folder {self.out_dir} is in use by another graphrun run "
                              f"({who}); wait for it to end or stop it, or pick another "
                              "output folder") from None
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None


def lock_holder(path: Path) -> int | None:
    """The pid holding a flock on `path`, from /proc/locks (Linux); None where unknown."""
    try:
        st = os.stat(path)
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in text.splitlines():
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 08:01:1234 0 EOF"; "->" marks a waiter
        if "FLOCK" in parts and "->" not in parts and dev in parts:
            try:
                return int(parts[parts.index(dev) - 1])
            except (ValueError, IndexError):
                return None
    return None


def prepare_out_dir(out_dir: Path, *, resume: bool, overwrite: bool, fingerprint: dict,
                    input_path: Path | None = None, model: dict[str, Path] | None = None,
                    accept_model_change: bool = False, spec: dict | None = None,
                    shard_dir: Path | None = None) -> ResumePoint | None:
    """Make `out_dir` ready for a run; return where to resume, or None to start from record 0.

    A new or empty folder is used as is. Otherwise: --overwrite replaces graphrun's own files
    (folder.py: never others'); --resume continues the run there if its fingerprint matches; a
    plain run is refused, unless the run there ended (failed or interrupted) before committing
    anything. A folder holding the input file is refused whatever is asked. model: the
    model's files by role (model_files), named when --resume finds one changed; with
    accept_model_change the run goes on and run.json takes the new hashes. spec: the resolved
    spec as JSON, compared key by key with the earlier attempt's (its manifest) where
    --resume finds another spec_sha256. shard_dir: where the shards are (a job's worker: the
    job's folder), default out_dir."""
    out_dir = Path(out_dir)
    if resume and overwrite:
        raise OutputError("--resume and --overwrite exclude each other; pass one of them")
    if input_path is not None and input_inside(out_dir, input_path):
        raise OutputError(f"the output folder {out_dir} holds the input file {input_path}; "
                          "graphrun would write (and --overwrite delete) beside it: pick "
                          "another output folder (--out or output.dir)")
    if not out_dir.exists() or not any(out_dir.iterdir()):
        _start(out_dir, fingerprint)
        return None
    if only_a_first_mark_temp(out_dir):  # nothing to resume, protect or replace: start
        remove_and_sync(out_dir, list(out_dir.iterdir()))
        _start(out_dir, fingerprint)
        return None
    own, foreign = split_entries(out_dir)
    if overwrite:
        if foreign:
            raise OutputError(f"output folder {out_dir} holds files graphrun did not write "
                              f"({listed_names(foreign)}); refusing to --overwrite it: move them "
                              "away or pick another output folder")
        remove_and_sync(out_dir, own)
        _start(out_dir, fingerprint)
        return None
    if not resume:
        if not own:
            raise OutputError(f"output folder {out_dir} is not empty ({listed_names(foreign)}); "
                              "pick a new or empty folder")
        if not foreign and ended_with_nothing_committed(out_dir):
            # An earlier attempt failed (e.g. at setup) or was stopped before its first commit:
            # nothing here is worth protecting or resuming, and sending the user to --resume
            # (refused once the spec is fixed) or --overwrite helps nobody. Start over in it,
            # keeping the completions it finished: taken back only where the run is the same
            remove_and_sync(out_dir, [p for p in own if p.name != FINISHED])
            _start(out_dir, fingerprint)
            return None
        raise OutputError(f"output folder {out_dir} exists and holds a run; pass --resume to "
                          "continue it or --overwrite to replace it (from Python, resume=True "
                          "or overwrite=True)")
    # before anything is written: restore would have to remove a user's entry to go on
    refuse_foreign(out_dir, shard_shaped(out_dir, fingerprint.get("shards") or []))
    refuse_links(out_dir, FIXED_NAMES)  # appended or replaced by name: never written through
    if _check_fingerprint(out_dir, fingerprint, model or {}, accept_model_change, spec,
                          input_path):
        write_fingerprint(out_dir, fingerprint)  # later resumes compare with the new model
    point = read_journal(out_dir, _first(fingerprint), first_shard(fingerprint), shard_dir)
    if point is None:
        # Nothing was committed: whatever the earlier attempt left is incomplete, but for
        # the completions it kept (finished.py checks they are this run's)
        remove_and_sync(out_dir, [p for p in own if p.name not in (RUN_JSON, FINISHED)])
        write_fingerprint(out_dir, fingerprint)
    return point


def shard_shaped(folder: Path, suffixes: list) -> list[Path]:
    """The entries of folder named as a shard or a shard's temp file of these suffixes."""
    return [p for p in sorted(folder.iterdir()) if shard_number(p.name, suffixes) is not None]


def _start(out_dir: Path, fingerprint: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_fingerprint(out_dir, fingerprint)


def write_fingerprint(out_dir: Path, fingerprint: dict) -> None:
    """run.json, replaced durably (the input's hash is added once it is known). A write that
    fails (a full disk) leaves no temp file: before run.json exists it would be a file in the
    folder that graphrun cannot show it wrote."""
    tmp = out_dir / f".{RUN_JSON}.tmp"
    f = open_file(tmp, "w")  # a link there is refused, and left for its owner
    try:
        with f:
            json.dump(fingerprint, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out_dir / RUN_JSON)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(out_dir)


def ended_with_nothing_committed(out_dir: Path) -> bool:
    """The last attempt ended (its manifest says failed or interrupted) and never committed a
    shard (no whole journal line). Without a manifest the folder may belong to a run still in
    setup, and a completed run whose every record was rejected has rejects but no journal:
    both are kept."""
    if (out_dir / JOURNAL).exists() or any((out_dir / WORKERS).glob(f"rank-*/{JOURNAL}")):
        return False
    try:
        status = json.loads(read_own(out_dir / "manifest.json")).get("status")
    except (OSError, ValueError, AttributeError):
        return False  # absent or unreadable: keep refusing rather than guess
    return status in ("failed", "interrupted")


def split_entries(out_dir: Path) -> tuple[list[Path], list[Path]]:
    """(graphrun's files, everything else) in out_dir, a run's folder or a job's."""
    mark = read_mark(out_dir)
    if is_job(mark):
        return own_entries(out_dir, *job_shards(out_dir, mark))
    listed, next_shard = journal_names(out_dir)
    return own_entries(out_dir, listed, [ShardPlace(out_dir, next_shard)])


def _first(fingerprint: dict) -> int:
    """The run's first input ordinal: its slice's start."""
    cut = fingerprint.get("slice")
    return cut[0] if isinstance(cut, (list, tuple)) and cut and isinstance(cut[0], int) else 0


def first_shard(fingerprint: dict) -> int:
    """A job's worker's first shard number (its run.json's shard_range, scale/), else 0."""
    cut = fingerprint.get("shard_range")
    return cut[0] if isinstance(cut, list) and cut and isinstance(cut[0], int) else 0


def _check_fingerprint(out_dir: Path, fingerprint: dict, model: dict[str, Path],
                       accept_model_change: bool, spec: dict | None = None,
                       input_path: Path | None = None) -> bool:
    """Refuse a folder holding another run, naming what changed (the input file by its
    path); True when only the model's files changed and that is accepted (run.json is then
    rewritten)."""
    path = out_dir / RUN_JSON
    if not path.exists():
        raise OutputError(f"output folder {out_dir} has no {RUN_JSON}, so it cannot be resumed; "
                          "rerun with --overwrite to replace it")
    before = read_mark(out_dir)
    if before is None:
        raise OutputError(f"{path} is not a run.json graphrun wrote (not a JSON object with a "
                          "spec_sha256), so the folder cannot be resumed; move it away or "
                          "pick another output folder")
    now = json.loads(json.dumps(fingerprint))  # compare as stored: tuples become lists
    before.pop(SPEC_COPY, None), now.pop(SPEC_COPY, None)  # spec_sha256 stands for them
    if not (out_dir / JOURNAL).exists():  # nothing committed: hashes not taken yet are no change
        for key in ("input_sha256", "model_sha256"):
            if before.get(key, "") is None:
                before[key] = now.get(key)
    keys = [k for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
    if keys == ["model_sha256"] and accept_model_change:
        return True
    changed = [_model_change(before.get(k), now.get(k), model) if k == "model_sha256"
               else _change(k, before.get(k), now.get(k)) for k in keys]
    if "input_sha256" in keys and input_path is not None:
        changed[keys.index("input_sha256")] += (f": the input file {input_path} is not the "
                                                "file the run read")
    if keys == ["model_sha256"]:
        raise OutputError(f"cannot resume {out_dir}: {changed[0]} since the run started. If "
                          "the change does not alter outputs (e.g. it fixes the error that "
                          "stopped the run), add --accept-model-change; otherwise use "
                          "--overwrite to start over")
    differ = spec_changes(out_dir, spec) if "spec_sha256" in keys and spec else None
    if differ:  # the manifest names the keys: say them, and how to give them again
        changed[keys.index("spec_sha256")], again = spec_change_text(differ)
    elif "spec_sha256" in keys:
        again = "to resume it, repeat the spec file and the --set options it ran with; "
    else:
        again = ""
    if changed:
        raise OutputError(f"cannot resume {out_dir}: it holds a different run ("
                          + "; ".join(changed) + f"); {again}--overwrite starts over "
                          "(discarding its committed work), or pick another output folder")
    return False


def spec_changes(out_dir: Path, spec: dict) -> list[tuple[str, object, object]] | None:
    """(key path, then, now) for every key of the resolved spec but output.dir that differs
    from the one the earlier attempt wrote into its run.json (or, a folder older than that
    copy, its manifest); None where neither holds it."""
    before = None
    for name, key in ((RUN_JSON, SPEC_COPY), (MANIFEST, "spec")):
        try:
            before = json.loads(read_own(out_dir / name)).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(before, dict):
            break
    if not isinstance(before, dict):
        return None
    was, now = _flat(before), _flat(json.loads(json.dumps(spec)))
    # output.dir is no part of the run (manifest.keys.spec_digest): a copied folder's differs
    return [(k, was.get(k), now.get(k)) for k in sorted(set(was) | set(now))
            if was.get(k) != now.get(k) and k != "output.dir"]


def spec_change_text(differ: list[tuple[str, object, object]]) -> tuple[str, str]:
    """spec_changes' keys as a reason ("k was a, now b; ...") and what to do to resume."""
    said = "; ".join(f"{k} was {_shown(a)}, now {_shown(b)}" for k, a, b in differ[:6]) + (
        f"; and {len(differ) - 6} more keys" if len(differ) > 6 else "")
    again = ("to resume it, repeat the interrupted run's settings ("
             + " ".join(f"--set {k}={_shown(a)}" for k, a, _ in differ[:6] if a is not None)
             + ", or the spec file as it was); ")
    return said, again


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _shown(value) -> str:
    """A value as --set takes it (YAML flow; JSON is YAML)."""
    return "absent" if value is None else json.dumps(value)


def _model_change(was, now, model: dict[str, Path]) -> str:
    """Which of the model's files changed: 'the model's weights file /m/w.pt changed'."""
    was, now = (v if isinstance(v, dict) else {} for v in (was, now))
    roles = [r for r in sorted(set(was) | set(now)) if was.get(r) != now.get(r)]
    what = {"weights": "weights file", "exported": "exported program",
            "torchscript": "TorchScript archive", "target": "source file"}
    named = [f"{what.get(r, 'file')} {model.get(r, '(no longer given)')}" for r in roles]
    return (f"the model's {', '.join(named)} changed" if named
            else "the model's files changed")


def _change(key: str, was, now) -> str:
    def short(v):
        return "absent" if v is None else repr(v[:12] + "..." if isinstance(v, str)
                                               and len(v) > 16 else v)
    return f"{key} changed (was {short(was)}, now {short(now)})"


def unusable_folder(out_dir: Path, err: OSError) -> OutputError:
    """The user's error for an output folder that cannot be made or written: a file in its
    place (or in its path's) named as such, else the system's reason."""
    place = next((p for p in (Path(out_dir), *Path(out_dir).parents)
                  if p.exists() or p.is_symlink()), None)
    if place is not None and not place.is_dir():
        what = "is a file" if place == Path(out_dir) else f"is inside {place}, a file"
        return OutputError(f"output folder {out_dir} {what}, not a folder; give output.dir "
                           "(or --out) a folder's path, or move the file")
    return OutputError(f"cannot use output folder {out_dir}: {err.strerror or err}; pick a "
                       "folder you can write to (--out or output.dir)")


@contextlib.contextmanager
def locked(out_dir: Path, shared: bool = False):
    """FolderLock held for the block; a folder that cannot be made or opened is a user error."""
    try:
        lock = FolderLock(out_dir, shared).__enter__()
    except OSError as err:
        raise unusable_folder(out_dir, err) from err
    try:
        yield lock
    finally:
        lock.__exit__()


def completed_manifest(out_dir: Path, fingerprint: dict, *, with_model: bool = True,
                       shard_dir: Path | None = None) -> "Manifest | None":
    """The manifest of a completed run of this very spec, input, model (unless with_model is
    False: --accept-model-change) and slice in out_dir (the one --resume would continue),
    else None: prepare_out_dir then decides, and explains."""
    try:
        ran = json.loads(read_own(out_dir / "run.json"))
        manifest = Manifest.model_validate_json(read_own(out_dir / "manifest.json"))
    except (OSError, ValueError):
        return None
    if not isinstance(ran, dict):
        return None
    keys = ("spec_sha256", "input_sha256") + (("model_sha256",) if with_model else ())
    same = all(ran.get(k) == fingerprint.get(k) for k in keys)
    if not same or any(ran.get(k) != fingerprint.get(k) for k in ("slice", "shard_range")):
        return None
    # the journal, not the manifest, says what is committed
    point = read_journal(out_dir, fingerprint["slice"][0] or 0, first_shard(fingerprint),
                         shard_dir)
    committed = point.rows if point else 0
    if manifest.status != "completed" or committed != manifest.totals.records_out:
        return None
    if point is not None:  # refuses a folder changed since (a file missing or edited)
        check_committed(out_dir, point, hashes=True, shard_dir=shard_dir)
    stray = stray_shards(shard_dir or out_dir, fingerprint, point)
    if stray:
        raise OutputError(f"cannot resume {out_dir}: the run there completed, but "
                          f"{shard_dir or out_dir} also holds {listed_names(stray)}, named as "
                          f"its shards but not in its {JOURNAL} (graphrun did not write them "
                          "there): move them out of the folder, or --overwrite to start over")
    return manifest.found_complete()


def stray_shards(folder: Path, fingerprint: dict, point: ResumePoint | None) -> list[Path]:
    """The files in folder named as this run's shards (a job's worker: those numbered in its
    shard_range; the other workers' lie beside them) that its journal does not list."""
    suffixes = fingerprint.get("shards") or []
    cut = fingerprint.get("shard_range")
    place = ShardPlace(folder, *cut) if isinstance(cut, list) and len(cut) == 2 else (
        ShardPlace(folder))
    listed = {Path(f.path).name for f in point.files} if point else set()
    return [p for p in shard_shaped(folder, suffixes)
            if p.name not in listed and place.holds(shard_number(p.name, suffixes))]
