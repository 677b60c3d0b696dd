"""Shared plumbing for stages: params loading, a params file's output root, the standard path layout, JSON/JSONL
I/O, atomic writes, and metrics written without the run's timings (those go to a `*.timing.*` sidecar).

Every stage module exposes `run(params, inputs, outputs) -> dict` plus `default_io(params)` returning the
`inputs` and `outputs` dicts of paths that `dvc.yaml` declares for it. The CLI, DVC, Prefect and the tests
all go through those two functions. `load_params` reads a params file through a bounded, strict YAML loader.
"""

from __future__ import annotations

import csv
import json
import os
import re
import resource
import stat
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import yaml

from tandem.config import Params, ParamsError, params_from_dict
from tandem.config import clip as _clip
from tandem.config import show as _show
from tandem.errors import DiskFullError, disk_full_error, free_bytes
from tandem.redact import redact
from tandem.timing import merge_timing, split_timing
from tandem.transactions import (StageOutputs, fsync_dir, fsync_path, recover, remove,  # noqa: F401
                                 sweep_temp_siblings, swap_in, temp_sibling)

DEFAULT_PARAMS = "params.yaml"


# Bounds of a params file (params.yaml is ~8 KB, ~250 values, 3 levels deep): a hostile file fails fast, in
# bounded memory, whatever it holds.
MAX_PARAMS_BYTES = 1 << 20
MAX_YAML_DEPTH = 32        # nesting of mappings and lists, aliases followed
MAX_YAML_VALUES = 100_000  # values after alias expansion (a "billion laughs" file expands to 10**9)
# a run of opening brackets deeper than the bound, found before PyYAML's scanner spends seconds on it
_DEEP_BRACKETS = re.compile(r"(?:[\[{][ \t\r\n]*){%d}" % (MAX_YAML_DEPTH + 1))


class _Refused(yaml.MarkedYAMLError):
    """A params file that is valid YAML but breaks one of the loader's own rules (bounds, keys)."""


class _ParamsLoader(yaml.SafeLoader):
    """YAML's safe loader, bounded and strict for params files.

    - A key given twice in one mapping is an error: with plain YAML the last one silently wins, so a params
      file could say two things about one setting. A list or mapping used as a key is an error too, and so
      is a merge key (`<<`): a params file states each setting itself.
    - While the document is composed, every node's size after alias expansion and its depth are counted (an
      alias costs what its anchor holds), and composing stops as soon as either passes its bound, before the
      composer's recursion or the constructor could run away.
    """

    def __init__(self, stream):
        super().__init__(stream)
        self._sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (values after expansion, depth)
        self._depth = 0

    def compose_node(self, parent, index):
        is_alias = self.check_event(yaml.AliasEvent)
        mark = self.peek_event().start_mark
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise _Refused(None, None, f"nests deeper than {MAX_YAML_DEPTH} levels", mark)
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if is_alias:
            if id(node) not in self._sizes:  # the anchor is still being composed: it contains itself
                raise _Refused(None, None, "an alias refers to a node that contains it", mark)
            return node
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        size, depth = 1, 0
        for child in children:
            c_size, c_depth = self._sizes[id(child)]
            size, depth = size + c_size, max(depth, c_depth + 1)
        if size > MAX_YAML_VALUES:
            raise _Refused(
                None, None, f"expands to more than {MAX_YAML_VALUES:,} values (YAML aliases repeat what they "
                "refer to)", mark)
        if depth > MAX_YAML_DEPTH:
            raise _Refused(None, None, f"nests deeper than {MAX_YAML_DEPTH} levels once its aliases are followed",
                           mark)
        self._sizes[id(node)] = (size, depth)
        return node

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise _Refused(
                    None, None, "merge keys (<<) are not supported: a params file states each setting itself",
                    key_node.start_mark)
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise _Refused(
                    None, None, "a list or mapping is used as a key (keys are names)", key_node.start_mark) from None
            if key in seen:
                raise _Refused(
                    None, None, f"key {_show(key)} appears twice in one mapping (the second would silently win)",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _not_regular(name: str, mode: int) -> ParamsError | None:
    """The refusal of a params file that is not a regular file (None for a regular one)."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return ParamsError([f"params file: {name} -> is a directory, not a params file"])
    kind = "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return ParamsError([f"params file: {name} -> is {kind}, not a regular file: save the params to a file and give "
                        f"its path"])


def _params_bytes(p: Path) -> bytes:
    """The bytes of a params file, read only if it is a regular file and at most MAX_PARAMS_BYTES long.

    A named pipe, device or socket is refused without being read: opening a FIFO blocks until some process
    writes to it. The file is opened non-blocking and checked again through its descriptor, so a path swapped
    for a FIFO between the check and the open cannot hang the read either."""
    name = _show(str(p))
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ParamsError([f"params file: {name} -> does not exist"]) from None
    except OSError as e:
        raise ParamsError([f"params file: {name} -> cannot be read ({e.strerror or e})"]) from None
    if (refused := _not_regular(name, st.st_mode)) is not None:
        raise refused
    too_big = f"params file: {name} -> is larger than {MAX_PARAMS_BYTES // 1024} KiB (a params file is a few KB)"
    if st.st_size > MAX_PARAMS_BYTES:
        raise ParamsError([too_big])
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ParamsError([f"params file: {name} -> cannot be read ({e.strerror or e})"]) from None
    try:
        with open(fd, "rb") as f:
            if (refused := _not_regular(name, os.fstat(f.fileno()).st_mode)) is not None:
                raise refused
            data = f.read(MAX_PARAMS_BYTES + 1)
    except OSError as e:
        raise ParamsError([f"params file: {name} -> cannot be read ({e.strerror or e})"]) from None
    if len(data) > MAX_PARAMS_BYTES:
        raise ParamsError([too_big])
    return data


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error as one bounded line: what is wrong and where."""
    if isinstance(e, yaml.MarkedYAMLError):
        what = " ".join(x for x in (e.context, e.problem) if x) or "cannot be parsed"
        mark = e.problem_mark or e.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        return f"{what}{where}"
    return str(e)


def parse_params_text(data: bytes, name: str = "params file") -> Any:
    """Parse the bytes of a params file with `_ParamsLoader`; every failure is a one-line ParamsError."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ParamsError([f"params file: {name} -> is not UTF-8 text (byte 0x{data[e.start]:02x} on line {line})"]) \
            from None
    if (deep := _DEEP_BRACKETS.search(text)) is not None:
        line = text[: deep.start()].count("\n") + 1
        raise ParamsError([f"params file: {name} -> nests deeper than {MAX_YAML_DEPTH} levels (line {line})"])
    loader = _ParamsLoader(text)
    try:
        node = loader.get_single_node()
        return None if node is None else loader.construct_document(node)
    except _Refused as e:
        raise ParamsError([f"params file: {name} -> {_clip(_yaml_problem(e))}"]) from None
    except yaml.YAMLError as e:
        raise ParamsError([f"params file: {name} -> is not valid YAML: {_clip(_yaml_problem(e))}"]) from None
    except (ValueError, TypeError, OverflowError, RecursionError) as e:  # e.g. an integer of 5,000 digits
        raise ParamsError([f"params file: {name} -> holds a value that cannot be read: {_clip(str(e), 200)}"]) \
            from None
    finally:
        loader.dispose()


def load_params(path: str | os.PathLike = DEFAULT_PARAMS, environ: Mapping[str, str] | None = None) -> Params:
    """Parse and validate a params file; raises ParamsError (the CLI turns it into exit code 2).

    Strict: the file must state every setting (a missing key is an error naming the key and the rule), so
    the file is the complete record of what a stage runs with. The one way to change a setting for a run is
    another file (`--params FILE`) or DVC editing this one (`dvc exp run -S key=value`); a deployment may
    override the few settings in `tandem.config.ENV_OVERRIDES` from `environ` (default: os.environ).
    Hostile files (huge, not UTF-8, alias bombs, deep nesting, devices, named pipes, directories) fail fast,
    one line each.
    """
    p = Path(path)
    name = _show(str(p))
    raw = parse_params_text(_params_bytes(p), name)
    if raw is None:
        raise ParamsError([f"params file: {name} -> holds no settings (an empty document)"])
    if not isinstance(raw, dict):
        found = "a list" if isinstance(raw, list) else f"a single value ({_show(raw, 40)})"
        raise ParamsError([f"params file: {name} -> must hold a mapping of sections, not {found}"])
    return params_from_dict(raw, strict=True, environ=os.environ if environ is None else environ)


def own_root_name(params_path: str | os.PathLike) -> str:
    """`params.study.yaml` -> `study`, `mine.yaml` -> `mine`: the name of a params file's own output root."""
    stem = Path(params_path).name
    for suffix in (".yaml", ".yml"):
        stem = stem.removesuffix(suffix)
    return stem.removeprefix("params.") or stem


def run_root(params_path: str | os.PathLike, params: Params, project: Path | None) -> tuple[Params, str | None]:
    """The output root a `tandem run` of `params_path` writes into, and why it moved (None when it did not).

    The DVC project's root holds the default run's outputs, which dvc.lock records for the project's
    params.yaml. Another params file whose `out_root` is that root (`.`, what the shipped files say) would write
    over them and leave dvc.lock describing other files, so it runs in `runs/<name>/` instead (`<name>` from
    the file's name: params.study.yaml -> runs/study/). An `out_root` naming any other directory is kept."""
    import dataclasses

    if project is None:
        return params, None
    project = Path(project).resolve()
    if Path(params_path).resolve() == project / DEFAULT_PARAMS or Path(params.out_root).resolve() != project:
        return params, None
    moved = project / "runs" / own_root_name(params_path)
    try:
        new = str(moved.relative_to(Path.cwd().resolve()))
    except ValueError:
        new = str(moved)
    why = (f"{Path(params_path).name}: out_root {params.out_root!r} holds the default run's outputs (dvc.lock records "
           f"them for {DEFAULT_PARAMS}), so this run writes under {new}/ (state another out_root in the file to "
           f"choose, or run it as the project's run: cp {Path(params_path).name} {DEFAULT_PARAMS} && tandem run)")
    return dataclasses.replace(params, out_root=new), why


@dataclass(frozen=True)
class Layout:
    """Where every artifact lives, relative to `params.out_root` (mirrors dvc.yaml)."""

    root: Path

    @classmethod
    def of(cls, params: Params) -> "Layout":
        return cls(Path(params.out_root))

    # data
    @property
    def raw(self) -> Path: return self.root / "data" / "raw"
    @property
    def prepared(self) -> Path: return self.root / "data" / "prepared"
    # models
    @property
    def base_model(self) -> Path: return self.root / "models" / "base"
    @property
    def junior_model(self) -> Path: return self.root / "models" / "junior"  # the junior stage's output
    @property
    def checkpoints(self) -> Path: return self.root / "models" / "checkpoints"
    # results
    @property
    def metrics(self) -> Path: return self.root / "metrics"
    @property
    def plots(self) -> Path: return self.root / "metrics" / "plots"
    @property
    def generations(self) -> Path: return self.root / "results" / "generations"
    @property
    def reports(self) -> Path: return self.root / "reports"
    @property
    def data_docs(self) -> Path: return self.root / "reports" / "data-docs"  # GX Data Docs of the prepare stage
    @property
    def runs(self) -> Path: return self.root / "runs"
    # crash-resume state that no DVC stage declares (training checkpoints in progress, the evaluation result
    # cache): outputs stay plain DVC outs, so every stage is in DVC's run-cache
    @property
    def scratch(self) -> Path: return self.root / "scratch"


def junior_of(params: Params, inputs: dict) -> Path:
    """The junior's model directory: the base's when `junior.source` is base, else the junior stage's output,
    checked to share the base's tokenizer (refused in one line otherwise)."""
    from tandem.models import check_junior_tokenizer, check_model_dir, resolve_junior

    base = Path(inputs["base_model"])
    d = resolve_junior(inputs.get("junior_model"), base, params.junior.is_base)
    if d != base:
        check_model_dir(d)
        check_junior_tokenizer(base, d, params.model.trust_remote_code)
    return d


def junior_record(params: Params, junior_dir: Path) -> dict:
    """What a stage records of the junior it used: its source and content hash (equal across stages: B2)."""
    from tandem.evaluation import content_hash

    return {"source": params.junior.source, "hash": content_hash(junior_dir)}


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as JSON, atomically, with any secret from the environment redacted (metrics, summaries)."""
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(redact(obj), indent=2, sort_keys=False, ensure_ascii=False) + "\n")


def write_npz(path: str | os.PathLike, arrays: dict[str, Any]) -> None:
    """Write named numpy arrays as one uncompressed `.npz` file, atomically."""
    import numpy as np

    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)


def write_csv(path: str | os.PathLike, cols: list[str], rows: list[dict]) -> None:
    """A CSV with header `cols`; None becomes an empty cell (undefined, never 0)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({c: ("" if r.get(c) is None else r[c]) for c in cols})


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


# --------------------------------------------------------------------------------------------------
# Timings beside the metrics: a stage's outputs depend on its inputs only
# --------------------------------------------------------------------------------------------------

# The timing rule itself (which keys measure the run, splitting and merging them) is tandem.timing's.
TIMING_SUFFIX = ".timing"  # metrics/base.json -> metrics/base.timing.json (.gitignore, .dvcignore)


def timing_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p.with_name(p.stem + TIMING_SUFFIX + p.suffix)


def sidecar_of(path: str | os.PathLike, timing_to: str | os.PathLike | None = None) -> tuple[Path, bool]:
    """(where the timing sidecar of the file at `path` is written, whether that is a staged path).

    The sidecar's final path is `timing_to`, default `timing_path(path)`. When `path` is a staged output of an
    open stage transaction of this process (`tandem.transactions.StageOutputs`), the sidecar is staged in the
    same transaction (declared there as an optional output), so it is swapped in with its summary: a run
    killed at any point leaves the old summary with the old timings, or the new with the new. A `timing_to`
    that is itself a staged path (a launched worker writing into its stage's transaction) is used as it is."""
    final = Path(timing_to) if timing_to is not None else timing_path(path)
    txn = StageOutputs.of_staged(path)
    if txn is None or final in txn.staged.values():
        return final, txn is not None or StageOutputs.of_staged(final) is not None
    return txn.staged_for(final) or txn.add_optional(f"timing:{final}", final), True


def write_metrics(path: str | os.PathLike, doc: Any, timing_to: str | os.PathLike | None = None) -> Any:
    """Write a stage's metrics without their timings (those go to `timing_to`, default `timing_path(path)`);
    returns the part written to `path`. The stage's DVC-tracked output then depends on the inputs alone.

    A stage writing into its output transaction's staging directory passes the final sidecar path as
    `timing_to` (or a staged path of its own, `sidecar_of`): the sidecar is staged in the same transaction and
    changes with the summary, or is removed with it when this run has no timings. Written in place (no
    transaction), the old sidecar is removed before the summary is replaced and the new one written after, so
    a run killed in between leaves a summary without timings, never one beside another run's timings."""
    kept, timing = split_timing(doc)
    side, staged = sidecar_of(path, timing_to)
    if not staged:
        remove(side)
    write_json(path, kept)
    if timing is not None:
        write_json(side, timing)
    return kept


def read_metrics(path: str | os.PathLike, timing_to: str | os.PathLike | None = None) -> Any:
    """A metrics file with the timings of the run that wrote it merged back in (when its sidecar, `timing_to`
    or `timing_path(path)`, exists; for a staged `path`, the sidecar staged with it: `sidecar_of`)."""
    doc = read_json(path)
    side = Path(timing_to) if timing_to is not None else timing_path(path)
    txn = StageOutputs.of_staged(path)
    if txn is not None and side not in txn.staged.values():
        side = txn.staged_for(side)  # a staged summary reads the sidecar staged with it, never the old one
    if side is not None and side.exists():
        try:
            return merge_timing(doc, read_json(side))
        except ValueError:  # a half-written sidecar from a killed run: the metrics themselves are what count
            return doc
    return doc


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling path; swap it in for `path` only if the block succeeds (file or dir).

    A block that raises midway (disk full, a bug) or a process killed at any point leaves `path` as it was:
    the new content is flushed to disk, then `tandem.transactions.swap_in` replaces the old one in one step
    (a directory too: the two names are exchanged, so `path` is never missing). A full disk is reported as
    `DiskFullError` naming `path`. Temporary siblings that killed processes left in the same directory are
    removed the first time this process writes there.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_temp_siblings(path.parent)
    try:
        with temp_sibling(path) as work:
            tmp = work / path.name
            yield tmp
            if not tmp.exists() and not tmp.is_symlink():
                raise RuntimeError(f"atomic_path({path}): the block wrote nothing to {tmp}")
            fsync_path(tmp)
            swap_in(tmp, path)
            fsync_dir(path.parent)
    except DiskFullError:
        raise
    except OSError as e:
        full = disk_full_error(e, path.parent)
        if full is None:
            raise
        raise DiskFullError(path, free_bytes(path)) from e


def stage_outputs(params: Params, name: str, targets: dict[str, str | os.PathLike],
                  optional: dict[str, str | os.PathLike] | None = None) -> StageOutputs:
    """One stage's outputs as one transaction (`tandem.transactions.StageOutputs`), staged under out_root;
    `optional` outputs (timing sidecars) may stay unwritten, which removes them at the commit."""
    return StageOutputs(Layout.of(params).root, name, targets, optional)


# --------------------------------------------------------------------------------------------------
# Resources: peak memory per stage
# --------------------------------------------------------------------------------------------------

def _status_kb(field: str) -> int | None:
    """A `kB` field of /proc/self/status (Linux), e.g. VmHWM (peak resident set), else None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark (VmHWM) so the next reading covers one stage only.

    Writing 5 to /proc/self/clear_refs does that on Linux; elsewhere (or without permission) it is a no-op
    and the reading is the peak since the process started. `ru_maxrss` cannot be reset at all.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss() -> dict[str, float | None]:
    """Peak resident memory in MB: since the last reset (VmHWM), of the whole process (ru_maxrss) and of its
    largest finished child process (worker processes)."""
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / 1024 / 1024  # ru_maxrss: kB on Linux, bytes on macOS
    hwm = _status_kb("VmHWM")
    return {"peak_rss_mb": round(hwm / 1024, 1) if hwm is not None else None,
            "process_max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, 1),
            "children_max_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale, 1)}


def torch_threads() -> int | None:
    """torch's intra-op thread count when torch is already imported (importing it here would cost seconds)."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None
