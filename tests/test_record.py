"""The committed record: its artifacts are in the committed DVC remote (so a clone gets them with `dvc pull`), a
run is compared with it, the run's metadata keeps the last real run's numbers, and another params file's
output root never is the default run's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def _remote_dir() -> Path:
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(REPO / ".dvc" / "config")
    default = cfg["core"]["remote"]
    return (REPO / ".dvc" / cfg[f"'remote \"{default}\"'"]["url"]).resolve()


def _object(remote: Path, md5: str) -> Path:
    return remote / "files" / "md5" / md5[:2] / md5[2:]


def test_the_default_remote_is_committed_inside_the_repository():
    remote = _remote_dir()
    assert remote.parent == REPO.resolve() and remote.name == "dvc-remote"
    ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", "dvc-remote/files/md5/00/x"])
    assert ignored.returncode == 1, "dvc-remote/ must be committed, not ignored"


def test_committed_remote_holds_every_output_dvc_lock_pins():
    """`dvc pull` on a fresh clone restores the record: every cached output of dvc.lock (and, for a directory,
    every file it lists) is in dvc-remote/. After re-recording: `dvc push`, then commit dvc-remote/ with dvc.lock."""
    remote = _remote_dir()
    lock = yaml.safe_load((REPO / "dvc.lock").read_text())
    in_git = set(subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True).stdout.split())
    missing = []
    for stage, st in lock["stages"].items():
        for out in st.get("outs") or []:
            md5, path = out.get("md5"), out["path"]
            if not md5 or any(f == path or f.startswith(path + "/") for f in in_git):
                continue  # metrics and plots are `cache: false`: they travel in git, not through the remote
            obj = _object(remote, md5)
            if not obj.exists():
                missing.append(f"{stage}: {path} ({md5})")
                continue
            if md5.endswith(".dir"):
                missing += [f"{stage}: {out['path']}/{e['relpath']}" for e in json.loads(obj.read_text())
                            if not _object(remote, e["md5"]).exists()]
    assert not missing, ("the committed DVC remote lacks outputs of dvc.lock (run `dvc push`, then "
                         "`git add dvc-remote`):\n  " + "\n  ".join(missing[:20]))


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout


LOCK = """\
schema: '2.0'
stages:
  base:
    cmd: tandem stage base
    outs:
    - path: metrics/base.json
      hash: md5
      md5: {metrics}
    - path: models/base
      hash: md5
      md5: {model}.dir
  train@tandem:
    cmd: tandem stage train --arm tandem
    outs:
    - path: models/checkpoints/tandem
      hash: md5
      md5: cccc.dir
"""


def test_compare_with_record(tmp_path):
    from tasks.record import compare_with_record, record_summary

    root = tmp_path / "proj"
    (root / "metrics").mkdir(parents=True)
    _git(root, "init", "-q")
    (root / "dvc.lock").write_text(LOCK.format(metrics="m1", model="aaaa"))
    (root / "metrics" / "base.json").write_text(json.dumps({"accuracy": {"greedy": {"macro": 0.5},
                                                                        "sampled": {"macro": 0.37}}}))
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "record")
    same = compare_with_record(root)
    assert same.identical and same.same == ["base", "train@tandem"]
    assert "reproduced the committed record" in record_summary(same) and "bit for bit" in record_summary(same)

    (root / "dvc.lock").write_text(LOCK.format(metrics="m2", model="bbbb"))
    (root / "metrics" / "base.json").write_text(json.dumps({"accuracy": {"greedy": {"macro": 0.47},
                                                                        "sampled": {"macro": 0.37}}}))
    other = compare_with_record(root)
    assert not other.identical and other.same == ["train@tandem"]
    assert other.differs == {"base": ["metrics/base.json", "models/base"]}
    text = record_summary(other, "AMD EPYC (2 CPUs; AVX2 kernels)")
    assert "base (metrics/base.json, models/base)" in text and "base greedy macro 0.500 -> 0.470" in text
    assert "sampled" not in text.split("headline numbers")[1].split("\n")[0]  # unchanged numbers stay out
    assert "AVX2" in text and "git checkout -- dvc.lock metrics && dvc checkout" in text
    assert compare_with_record(tmp_path / "nowhere") is None
    # the report records its time and commit: it alone differing still reproduces the record
    (root / "dvc.lock").write_text(LOCK.format(metrics="m1", model="aaaa") + "  report:\n    cmd: tandem stage report\n"
                                   "    outs:\n    - path: reports\n      hash: md5\n      md5: r2.dir\n")
    (root / "metrics" / "base.json").write_text(json.dumps({"accuracy": {"greedy": {"macro": 0.5},
                                                                        "sampled": {"macro": 0.37}}}))
    only_report = compare_with_record(root)
    assert only_report.identical and only_report.differs == {"report": ["reports"]}
    assert "bit for bit" in record_summary(only_report) and "apart from report" in record_summary(only_report)


def _base_json(greedy: float, sampled: float) -> str:
    return json.dumps({"accuracy": {"greedy": {"macro": greedy}, "sampled": {"macro": sampled}}})


def test_the_closing_message_states_the_records_band(tmp_path):
    """A run that is not bit for bit the record shows every headline number beside the record's value and the
    band committed with it (metrics/band.json), says which landed outside, and says "within the record's band"
    only when every one landed inside; a bit-for-bit run still says "bit for bit"."""
    from tasks.record import compare_with_record, read_band, record_summary

    root = tmp_path / "proj"
    (root / "metrics").mkdir(parents=True)
    _git(root, "init", "-q")
    (root / "dvc.lock").write_text(LOCK.format(metrics="m1", model="aaaa"))
    (root / "metrics" / "base.json").write_text(_base_json(0.80, 0.50))
    band = {"base greedy macro": [0.75, 0.85], "base sampled macro": [0.45, 0.55]}
    (root / "metrics" / "band.json").write_text(json.dumps({"band": band, "runs": []}))
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "record")
    assert "bit for bit" in record_summary(compare_with_record(root))

    (root / "dvc.lock").write_text(LOCK.format(metrics="m2", model="bbbb"))
    (root / "metrics" / "base.json").write_text(_base_json(0.83, 0.46))
    inside = compare_with_record(root)
    assert inside.band == {"base greedy macro": (0.75, 0.85), "base sampled macro": (0.45, 0.55)}
    text = record_summary(inside)
    assert "bit for bit" not in text and "within the record's band" in text and "OUTSIDE" not in text
    assert text.startswith("This run landed within the record's band, not on its bytes")  # the first line says it
    assert "base greedy macro: 0.830 (record 0.800; band 0.750-0.850: inside)" in text
    assert "base sampled macro: 0.460 (record 0.500; band 0.450-0.550: inside)" in text

    # one number past its band: named, and the run is not called within the band
    (root / "metrics" / "base.json").write_text(_base_json(0.83, 0.40))
    text = record_summary(compare_with_record(root))
    assert "within the record's band:" not in text and text.startswith("This run differs")
    assert "base sampled macro: 0.400 (record 0.500; band 0.450-0.550: OUTSIDE)" in text
    assert "1 of 2 headline numbers landed outside the record's band: base sampled macro" in text

    # a headline number the band does not cover is said to have none, never counted as inside
    (root / "metrics" / "band.json").write_text(json.dumps({"band": {"base greedy macro": [0.75, 0.85]}}))
    _git(root, "commit", "-q", "-m", "narrower band file", "--", "metrics/band.json")
    (root / "dvc.lock").write_text(LOCK.format(metrics="m3", model="cccc"))
    text = record_summary(compare_with_record(root))
    assert "base sampled macro: 0.400 (record 0.500; no band measured)" in text
    assert "No band was measured for: base sampled macro" in text and "Every headline number landed" not in text

    # no band committed: the moved numbers, record -> this run, as before
    _git(root, "rm", "-q", "metrics/band.json")
    _git(root, "commit", "-q", "-m", "no band")
    plain = compare_with_record(root)
    assert plain.band is None and "base sampled macro 0.500 -> 0.400" in record_summary(plain)
    with pytest.raises(ValueError, match="low <= high"):
        read_band(json.dumps({"band": {"base greedy macro": [0.9, 0.8]}}))
    with pytest.raises(ValueError, match="no `band` object"):
        read_band("[]")


def test_a_run_that_ran_nothing_reproduced_nothing(tmp_path):
    """Only stages the run computed vouch for the record: with every stage up to date, dvc.lock matches HEAD's
    because nothing touched it, and the summary says so; a partial run names what it took as it was."""
    from tasks.record import compare_with_record, record_summary

    root = tmp_path / "proj"
    (root / "metrics").mkdir(parents=True)
    _git(root, "init", "-q")
    (root / "dvc.lock").write_text(LOCK.format(metrics="m1", model="aaaa"))
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "record")

    nothing = compare_with_record(root, ran=[])
    assert nothing.identical and nothing.ran == [] and nothing.ran_nothing and not nothing.reproduced
    text = record_summary(nothing)
    assert "ran nothing" in text and "reproduced nothing" in text and "bit for bit" not in text
    assert "tandem run --force" in text
    # a stage outside dvc.lock (or a flow entry such as the promotion) is no stage of the record
    assert compare_with_record(root, ran=["promotion"]).ran_nothing

    partial = compare_with_record(root, ran=["train@tandem"])
    assert partial.reproduced and partial.ran == ["train@tandem"]
    text = record_summary(partial)
    assert "bit for bit" in text and "recomputed: train@tandem; up to date, not rerun: base" in text
    every = compare_with_record(root, ran=["base", "train@tandem"])
    assert every.reproduced and "not rerun" not in record_summary(every)

    # only the report ran: its outputs record the run's context, so nothing was checked
    lock = LOCK.format(metrics="m1", model="aaaa") + ("  report:\n    cmd: tandem stage report\n    outs:\n"
                                                      "    - path: reports\n      hash: md5\n      md5: r2.dir\n")
    (root / "dvc.lock").write_text(lock)
    report_only = compare_with_record(root, ran=["report"])
    assert report_only.ran_nothing and "it ran only report" in record_summary(report_only)
    assert "bit for bit" not in record_summary(report_only)

    # nothing ran, yet the outputs on disk (an earlier run's) are not the record's: say both
    (root / "dvc.lock").write_text(LOCK.format(metrics="m2", model="aaaa"))
    stale = record_summary(compare_with_record(root, ran=[]))
    assert stale.startswith("This run ran nothing") and "an earlier run's) differ from the committed record" in stale
    assert "base (metrics/base.json)" in stale


def test_run_metadata_keeps_the_last_real_run(tmp_path):
    from tasks.record import write_run_metadata

    proc = {"peak_rss_mb": 10.0, "process_max_rss_mb": 12.0, "children_max_rss_mb": 0.0}
    first = write_run_metadata(tmp_path, {"base": 300.0, "train@tandem": 40.0}, {"base": 900.0}, proc,
                               ["base", "train@tandem"])
    assert first["timing"] == {"base": 300.0, "train@tandem": 40.0} and first["resources"]["run_peak_rss_mb"] == 900.0
    assert first["machine"]["cpu"]["logical_cpus"] and first["machine"]["kernels"]["isa_level"]
    text = (tmp_path / "results" / "run.json").read_text()
    # nothing ran (every stage current): the file stays as the last real run left it
    assert write_run_metadata(tmp_path, {}, {}, proc, []) == first
    assert (tmp_path / "results" / "run.json").read_text() == text
    # one stage ran: its numbers change, the others are kept
    third = write_run_metadata(tmp_path, {"train@tandem": 41.0}, {"train@tandem": 500.0}, proc, ["train@tandem"])
    assert third["timing"] == {"base": 300.0, "train@tandem": 41.0}
    assert third["resources"]["peak_rss_mb_by_task"] == {"base": 900.0, "train@tandem": 500.0}


def test_another_params_file_gets_its_own_root(tmp_path, monkeypatch):
    from tandem.config import params_from_dict
    from tasks.common import own_root_name, run_root

    monkeypatch.chdir(tmp_path)
    p = params_from_dict({"out_root": "."})
    assert own_root_name("params.study.yaml") == "study" and own_root_name("dir/mine.yml") == "mine"
    moved, why = run_root("params.study.yaml", p, tmp_path)
    assert moved.out_root == "runs/study" and "default run" in why and "runs/study/" in why
    assert run_root("params.yaml", p, tmp_path) == (p, None)  # the project's own run
    own = params_from_dict({"out_root": "studies/x"})
    assert run_root("params.study.yaml", own, tmp_path) == (own, None)  # an out_root of its own is kept
    assert run_root("params.study.yaml", p, None) == (p, None)  # no DVC project: nothing to protect


@pytest.mark.slow
@pytest.mark.integration
def test_a_fresh_clone_gets_the_record_with_dvc_pull(tmp_path):
    """What the README tells a user: clone, `dvc pull`, and the record's models are there, as dvc.lock pins them."""
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=300)
    shutil.rmtree(clone / ".dvc" / "cache", ignore_errors=True)
    res = subprocess.run([sys.executable, "-m", "dvc", "pull", "-q"], cwd=clone, capture_output=True, text=True,
                         timeout=900, env={**__import__("os").environ, "DVC_NO_ANALYTICS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    lock = yaml.safe_load((clone / "dvc.lock").read_text())
    outs = [o["path"] for st in lock["stages"].values() for o in st.get("outs") or []]
    assert all((clone / p).exists() for p in outs), [p for p in outs if not (clone / p).exists()]
    assert (clone / "models" / "base" / "model.safetensors").exists()


def _record_band(tmp_path: Path, monkeypatch):
    """scripts/record_band.py as a module, its repository root at `tmp_path`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("record_band", REPO / "scripts" / "record_band.py")
    rb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rb)
    monkeypatch.setattr(rb, "REPO", tmp_path)
    return rb


def test_the_band_script_takes_each_headline_numbers_range_over_the_runs(tmp_path, monkeypatch):
    """scripts/record_band.py: every finished run's headline numbers (with the labels the closing message uses),
    and per label [lowest, highest] over the runs that measured it; an unfinished run is left out."""
    from tasks.record import read_band

    rb = _record_band(tmp_path, monkeypatch)
    for name, greedy, arms in (("avx2-s0", 0.9, {"grpo": 0.7}), ("default-s0", 0.95, {"grpo": 0.66}),
                               ("avx2-s1", 0.8, None)):
        root = tmp_path / rb.BAND_ROOT / name
        (root / "metrics").mkdir(parents=True)
        (root / "metrics" / "base.json").write_text(json.dumps({"accuracy": {"greedy": {"macro": greedy},
                                                                             "sampled": {"macro": greedy - 0.2}},
                                                                "pretrain": {"steps": 3000}}))
        if arms:
            (root / "metrics" / "eval.json").write_text(json.dumps(
                {"summary": {a: {"solo/pass@1": v} for a, v in arms.items()}}))
        if name != "avx2-s1":
            (root / "band-run.json").write_text(json.dumps({"seed": 0, "kernel": name.split("-")[0]}))
    doc = rb.write_band(Path("band.json"))
    assert [r["root"] for r in doc["runs"]] == ["runs/band/avx2-s0", "runs/band/default-s0"]
    assert doc["runs"][0]["values"] == {"base greedy macro": 0.9, "base sampled macro": 0.7, "solo pass@1 grpo": 0.7}
    band = read_band((tmp_path / "band.json").read_text())
    assert band == {"base greedy macro": (0.9, 0.95), "base sampled macro": (0.7, 0.75),
                    "solo pass@1 grpo": (0.66, 0.7)}


def test_a_sweep_run_counts_only_when_its_benchmarks_are_the_default_runs(tmp_path, monkeypatch):
    """record_band.same_recipe: a run's params against params.yaml; a params file from before data.eval_seed drew
    its benchmarks with its own seed, which is the default's (eval_seed 0) for seed 0 only."""
    import yaml

    rb = _record_band(tmp_path, monkeypatch)
    default = yaml.safe_load((REPO / "params.yaml").read_text())
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(default))
    assert default["data"]["eval_seed"] == 0

    def run(name: str, seed: int, **data) -> Path:
        p = yaml.safe_load(yaml.safe_dump(default))
        p["seed"], p["out_root"] = seed, f"runs/levels/{name}"
        p["data"].update(data)
        if data.get("eval_seed") is None:
            p["data"].pop("eval_seed")
        (tmp_path / p["out_root"]).mkdir(parents=True)
        (tmp_path / p["out_root"] / "params.yaml").write_text(yaml.safe_dump(p))
        return Path(p["out_root"])

    assert rb.same_recipe(run("old-s0", 0, eval_seed=None)) is None  # its own seed, 0: the default's benchmarks
    assert "data.eval_seed" in rb.same_recipe(run("old-s1", 1, eval_seed=None))  # seed 1's own problems
    assert rb.same_recipe(run("new-s1", 1, eval_seed=0)) is None
    assert "data.eval_seed" in rb.same_recipe(run("own-s2", 2, eval_seed=-1))
    assert "data.n_eval" in rb.same_recipe(run("other-s0", 0, eval_seed=0, n_eval=50))


@pytest.mark.parametrize("key,before,other", [("pretrain_level_decoding", "greedy", "evaluation"),
                                               ("pretrain_loss", "completion", "sequence"),
                                               ("pretrain_question_order", "given", "shuffled")])
def test_a_sweep_run_from_before_a_later_key_ran_as_that_key_says(tmp_path, monkeypatch, key, before, other):
    """record_band.same_recipe: a params file without a key added later (record_band.LATER_KEYS) ran as the key's
    `before` value says (the level probed greedily; the loss on the completion), the same recipe as that value,
    which is the default's only while the default keeps it; another value is another recipe."""
    import yaml

    rb = _record_band(tmp_path, monkeypatch)
    assert rb.LATER_KEYS[f"model.{key}"] == before
    default = yaml.safe_load((REPO / "params.yaml").read_text())
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(default))
    now = default["model"][key]  # the default's value: `before`, or (the level probe) a later one

    def run(name: str, value: str | None) -> Path:
        p = yaml.safe_load(yaml.safe_dump(default))
        p["out_root"] = f"runs/levels/{name}"
        if value is None:
            p["model"].pop(key)
        else:
            p["model"][key] = value
        (tmp_path / p["out_root"]).mkdir(parents=True)
        (tmp_path / p["out_root"] / "params.yaml").write_text(yaml.safe_dump(p))
        return Path(p["out_root"])

    assert (rb.same_recipe(run("missing", None)) is None) == (now == before)
    assert (rb.same_recipe(run("before", before)) is None) == (now == before)
    assert rb.same_recipe(run("same", now)) is None
    assert f"model.{key}" in rb.same_recipe(run("other", other if other != now else before))
