"""Benchmark files are read like data files: one that is not JSON Lines is one report and exit code 1.

`evaluate.benchmark_files` (and the prepared benchmarks in data/prepared/eval/) used to be read with a plain
`json.loads` per line, so a CSV, a cut-short file or a non-UTF-8 byte ended the evaluate stage in a traceback.
They now go through the prepare stage's file-level rules (tandem/data/reader.py: file_exists, not_empty, utf8,
json_lines, json_object, truncated, row_size), all files at once, before any model is loaded.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from fault_fixtures import F, failure_line, tandem  # noqa: E402
from params_files import complete_params  # noqa: E402

EVAL_KEYS = ("n_samples", "ks", "max_new_tokens", "batch_size", "progress", "score_workers", "checkpoints")
GOOD = "".join(json.dumps({"id": f"g{i}", "problem": f"What is {i} plus one?", "answer": str(i + 1)}) + "\n"
               for i in range(3))


def _params(root: Path, benchmark_files: dict[str, str], **data):
    from tandem.config import params_from_dict

    return params_from_dict({"out_root": str(root), "data": data,
                             "evaluate": {"benchmark_files": benchmark_files, "benchmarks": sorted(benchmark_files)}})


@pytest.mark.parametrize("content,rule", [
    (b"id,problem,answer\na,What is one plus one?,2\n", "json_lines"),
    (b'{"id": "a", "problem": "p", "answer": "1"}\n[1, 2]\n', "json_object"),
    (b'{"id": "a", "problem": "p", "answer": "1"}\n{"id": "b", "probl', "truncated"),
    (b'{"id": "a", "problem": "caf\xe9", "answer": "1"}\n', "utf8"),
    (b"\n\n", "not_empty"),
], ids=["csv", "list", "cut_short", "latin1", "blank"])
def test_a_damaged_benchmark_file_is_a_data_file_error_naming_file_line_and_rule(tmp_path, content, rule):
    from tandem.data.reader import DataFileError
    from tasks import evaluate as ev

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    p = _params(tmp_path, {"bad": str(bad)})
    with pytest.raises(DataFileError) as info:
        ev.load_benchmarks(p, ev.default_io(p)[0])
    assert f"[rule: {rule}]" in str(info.value) and f"evaluate.benchmark_files.bad {bad}" in str(info.value)


def test_every_damaged_benchmark_is_in_one_report_and_good_rows_stay_clean(tmp_path):
    from tandem.data.reader import DataFileError
    from tasks import evaluate as ev

    (tmp_path / "good.jsonl").write_text(GOOD)
    (tmp_path / "a.jsonl").write_text("not json\n")
    (tmp_path / "b.jsonl").write_text('{"id": "x", "problem": "' + "y" * 300 + '", "answer": "1"}\n')
    files = {n: str(tmp_path / f"{n}.jsonl") for n in ("good", "a", "b")}
    p = _params(tmp_path, files, max_row_bytes=200)
    with pytest.raises(DataFileError) as info:
        ev.load_benchmarks(p, ev.default_io(p)[0])
    text = str(info.value)
    assert "2 problems" in text and "[rule: json_lines]" in text and "[rule: row_size]" in text
    good = ev.load_benchmarks(_params(tmp_path, {"good": files["good"]}), ev.default_io(p)[0])["good"]
    assert [r["id"] for r in good] == ["g0", "g1", "g2"] and all("_where" not in r for r in good)


def test_a_benchmark_file_that_is_not_json_lines_fails_the_stage_in_one_report(fault_tree, tmp_path):
    """`tandem stage evaluate` on a real (tiny) checkpoint tree: exit 1, one `failed:` line and the report's lines,
    no traceback, and nothing written."""
    root = tmp_path / "out"
    shutil.copytree(fault_tree, root)
    bad = tmp_path / "math.csv"
    bad.write_text("id,problem,answer\nm1,What is 2+2?,4\n")
    p = F.small_params(root, n_samples=1, ks=[1], max_new_tokens=4, checkpoints="final")
    params = root / "params.yaml"
    params.write_text(yaml.safe_dump(complete_params({
        "out_root": str(root), "train": {"arms": list(F.ARMS)},
        "evaluate": {**{k: getattr(p.evaluate, k) for k in EVAL_KEYS}, "benchmark_files": {"math": str(bad)}}})))
    res = tandem("stage", "evaluate", "-p", str(params))
    line = failure_line(res, "stage evaluate")
    assert "data input refused (2 problems" in line, res.stderr[-3000:]
    assert f"evaluate.benchmark_files.math {bad}:1" in res.stderr and "[rule: json_lines]" in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 4, res.stderr[-3000:]
    assert not (root / "metrics" / "eval.json").exists() and not (root / "scratch" / "evaluate").exists()
