"""Params: typed frozen sections, unknown keys, wrong types and impossible values all reported at once; every
shipped params file is complete (a file that leaves out a setting is refused, naming it)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from tandem.config import SECTIONS, ParamsError, Params, params_from_dict, setting_keys

REPO = Path(__file__).resolve().parents[1]
# every params file shipped: the run files at the top level and the tiny pipeline of the tests and benchmarks
PARAMS_FILES = sorted(p.name for p in REPO.glob("params*.yaml")) + ["tests/flows/tiny_params.yaml"]


def _stated(raw: dict) -> set[str]:
    """Dotted keys a parsed params file states (a dict-valued setting such as data.benchmarks is one key)."""
    return {f"{k}.{f}" for k, v in raw.items() if isinstance(v, dict) for f in v} | \
        {k for k, v in raw.items() if not isinstance(v, dict)}


def test_shipped_params_files_are_complete_and_load_strictly():
    from tasks.common import load_params

    assert {"params.yaml", "params.study.yaml", "params.paper.yaml"} <= set(PARAMS_FILES)
    for name in PARAMS_FILES:
        p = load_params(REPO / name)  # strict: raises on any missing setting
        assert isinstance(p, Params)
        raw = yaml.safe_load((REPO / name).read_text())
        # check-params resolves no setting that the file does not state, and the file states nothing else
        assert _stated(raw) == set(setting_keys()), name


def test_study_file_is_the_default_run_with_other_train_and_evaluate_values():
    """The study reuses the default run's prepared data and base model (tandem study links them), so its
    data and model sections (and everything outside train/evaluate) must equal params.yaml's."""
    main = yaml.safe_load((REPO / "params.yaml").read_text())
    study = yaml.safe_load((REPO / "params.study.yaml").read_text())
    assert {k: v for k, v in study.items() if k not in ("train", "evaluate")} == \
        {k: v for k, v in main.items() if k not in ("train", "evaluate")}
    assert study["train"]["arms"] == main["train"]["arms"]
    assert study["train"]["steps"] > 10 * main["train"]["steps"]


def test_a_file_that_leaves_out_a_setting_is_refused_naming_each_key():
    full = yaml.safe_load((REPO / "params.yaml").read_text())
    raw = {**full, "train": {k: v for k, v in full["train"].items() if k not in ("max_grad_norm", "lr_schedule")}}
    del raw["analyze"]
    with pytest.raises(ParamsError) as e:
        params_from_dict(raw, strict=True)
    missing = [p for p in e.value.problems if "(missing)" in p]
    named = {p.split(":")[0] for p in missing}
    assert named == {"train.max_grad_norm", "train.lr_schedule"} | {f"analyze.{k}" for k in full["analyze"]}
    assert all("must state every setting" in p for p in missing)
    # lenient (configs built in code): the defaults fill the gap
    assert params_from_dict(raw).train.max_grad_norm == 1.0


def test_removed_keys_say_where_the_setting_went():
    with pytest.raises(ParamsError) as e:
        params_from_dict({"preset": "study", "rollout": {"temperature": 1.0, "cpu_threads": 1},
                          "evaluate": {"torch_threads": 1}})
    text = str(e.value)
    assert "--params" in text and "train.temperature" in text and "train.cpu_threads" in text
    assert "evaluate.cpu_threads" in text


def test_one_thread_setting_per_stage_section():
    """cpu_threads in each section whose stage does torch work, and no other thread setting anywhere."""
    have = {k for k in setting_keys() if "thread" in k.split(".")[-1]}
    assert have == {"model.cpu_threads", "train.cpu_threads", "evaluate.cpu_threads", "analyze.cpu_threads"}


def test_sections_are_frozen_and_documented():
    p = params_from_dict({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.train.steps = 3  # type: ignore[misc]
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"


def test_unknown_key_wrong_type_and_range_all_named():
    raw = {"data": {"n_trian": 5}, "train": {"steps": "ten"}, "rollout": {"p_senior": 1.5}}
    with pytest.raises(ParamsError) as e:
        params_from_dict(raw)
    text = str(e.value)
    assert "data.n_trian" in text and "unknown key" in text
    assert "train.steps" in text and "'ten'" in text and "wrong type" in text
    assert "rollout.p_senior" in text and "1.5" in text and "[0, 1]" in text
    assert len(e.value.problems) == 3


@pytest.mark.parametrize("section,key,value,rule", [
    ("train", "group_size", 1, "relative within a group"),
    ("data", "n_train", -3, ">= 0"),
    ("evaluate", "ks", [1, 16], "n_samples"),
    ("evaluate", "top_p", 0.0, "(0, 1]"),
    ("evaluate", "checkpoints", "last", "one of all, final"),
    ("train", "arms", ["tandem", "nope"], "drawn from"),
    ("data", "solution_styles", {"verbose": 0.7, "terse": 0.2}, "sum to 1"),
    ("data", "solution_styles", {"verbose": 0.5, "poetic": 0.5}, "unknown style"),
    ("data", "solution_styles", {"verbose": 1.5, "terse": -0.5}, ">= 0"),
])
def test_impossible_values(section, key, value, rule):
    with pytest.raises(ParamsError) as e:
        params_from_dict({section: {key: value}})
    assert f"{section}.{key}" in str(e.value) and rule in str(e.value)


def test_bool_is_not_an_int_and_int_is_a_float():
    with pytest.raises(ParamsError, match="train.steps"):
        params_from_dict({"train": {"steps": True}})
    assert params_from_dict({"train": {"learning_rate": 1}}).train.learning_rate == 1.0


def test_cli_check_params_exit_code_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  n_trian: 5\ntrain:\n  steps: ten\nrollout:\n  p_senior: 1.5\n")
    out = subprocess.run([sys.executable, "-m", "cli", "check-params", str(bad)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2
    for needle in ("data.n_trian", "train.steps", "rollout.p_senior"):
        assert needle in out.stderr
    ok = subprocess.run([sys.executable, "-m", "cli", "check-params", "params.yaml"],
                        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert ok.returncode == 0, ok.stderr
    full = yaml.safe_load((REPO / "params.yaml").read_text())
    del full["model"]["vocab_size"]
    bad.write_text(yaml.safe_dump(full))
    out = subprocess.run([sys.executable, "-m", "cli", "check-params", str(bad)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and "model.vocab_size: (missing)" in out.stderr


def test_modes_the_analysis_cannot_use_are_refused_at_load(tmp_path):
    """analyze teacher-forces every checkpoint's solo generations: a run without solo would fail there, minutes
    in, so the loader refuses it (exit 2 before any work); the report and the promotion need no other mode."""
    from typer.testing import CliRunner

    from cli.main import app

    with pytest.raises(ParamsError) as e:
        params_from_dict({"evaluate": {"modes": ["step", "word"]}})
    (problem,) = e.value.problems
    assert problem == ("evaluate.modes: ['step', 'word'] -> must include solo: the analyze stage reads the solo "
                       "generations of every checkpoint")
    for modes in (["solo"], ["word", "solo"], ["solo", "step"]):
        assert params_from_dict({"evaluate": {"modes": modes}}).evaluate.modes == modes
    full = yaml.safe_load((REPO / "params.yaml").read_text())
    full["evaluate"]["modes"] = ["step"]
    bad = tmp_path / "no-solo.yaml"
    bad.write_text(yaml.safe_dump(full))
    res = CliRunner().invoke(app, ["check-params", str(bad)])
    assert res.exit_code == 2 and "evaluate.modes: ['step'] -> must include solo" in res.output


def test_stage_rejects_bad_params_before_any_work(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"out_root: {tmp_path}\ntrain:\n  group_size: 1\n")
    out = subprocess.run([sys.executable, "-m", "cli", "stage", "prepare", "--params", str(bad)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and "train.group_size" in out.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "metrics").exists()


def test_a_key_given_twice_is_refused(tmp_path):
    from tasks.common import load_params

    text = Path("params.yaml").read_text().replace("\ntrain:\n", "\ntrain:\n  steps: 3\n", 1)
    bad = tmp_path / "dup.yaml"
    bad.write_text(text)
    with pytest.raises(ParamsError, match="appears twice"):
        load_params(bad)


# --------------------------------------------------------------------------------------------------
# One rule per setting, defaults, the environment, --explain
# --------------------------------------------------------------------------------------------------

def test_code_defaults_equal_params_yaml():
    """A config built in code is the default run: every code default equals params.yaml's value."""
    from tasks.common import load_params

    file, code = load_params(REPO / "params.yaml").to_dict(), Params().to_dict()
    differ = [f"{s}.{k}: code {code[s][k]!r}, params.yaml {file[s][k]!r}" for s in SECTIONS for k in code[s]
              if code[s][k] != file[s][k]]
    differ += [f"{k}: code {code[k]!r}, params.yaml {file[k]!r}" for k in code if k not in SECTIONS and code[k] != file[k]]
    assert not differ, "\n".join(differ)


def _numeric(ann) -> bool:
    args = typing.get_args(ann)
    return ann in (int, float) or (typing.get_origin(ann) is list and args and args[0] in (int, float))


def test_every_number_has_a_lower_and_an_upper_bound():
    """Bounds describe a run this project can do: no number setting is unbounded (lists: each item)."""
    from tandem.config import rule_of

    owners = {"": Params, **SECTIONS}
    unbounded = []
    for section, cls in owners.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            ann = hints[f.name]
            if not _numeric(ann):
                continue
            rule = rule_of(f)
            rule = rule.items if typing.get_origin(ann) is list else rule
            if rule is None or not rule.has_bounds():
                unbounded.append(f"{section}.{f.name}".lstrip("."))
    assert not unbounded, unbounded


@pytest.mark.parametrize("key,value,rule", [
    ("train.learning_rate", float("inf"), "finite"),
    ("train.learning_rate", 1e308, "<= 1"),
    ("evaluate.temperature", float("inf"), "finite"),
    ("data.parse_timeout", float("inf"), "finite"),
    ("train.steps", 10**20, "<= 1000000"),
    ("seed", 2**70, "<= 4294967295"),
    ("evaluate.n_samples", 10**9, "<= 1024"),
    ("data.n_train", 10**12, "<= 1000000"),
    ("data.max_value", 1, ">= 2"),
    ("data.max_steps", 21, "<= 20"),
])
def test_impossible_runs_are_refused_with_one_bounded_message(key, value, rule):
    raw = {key: value} if "." not in key else {key.split(".")[0]: {key.split(".")[1]: value}}
    with pytest.raises(ParamsError) as e:
        params_from_dict(raw)
    (problem,) = e.value.problems  # one bad value, one message: rules between fields wait for valid fields
    assert problem.startswith(f"{key}: ") and rule in problem and len(problem) < 300
    assert str(e.value) == f"invalid params: {problem}"


def test_messages_render_values_bounded():
    from tandem.config import show

    assert show(10**5000).startswith("<integer of") and len(show("x" * 10**6)) <= 80
    nested: list = ["lol"] * 9
    for _ in range(8):
        nested = [nested] * 9  # 9**9 leaves: never walked
    assert len(show(nested)) <= 80 and "\n" not in show("a\nb")


def test_a_code_built_config_obeys_the_same_rules():
    from tandem.config import TrainConfig

    with pytest.raises(ParamsError, match=r"train\.learning_rate: inf -> must be a finite number"):
        TrainConfig(learning_rate=float("inf"))
    assert TrainConfig(learning_rate=1).learning_rate == 1.0 and isinstance(TrainConfig(learning_rate=1).learning_rate, float)


@pytest.mark.parametrize("value,ok", [
    (".", True), ("runs/real", True), ("runs/../runs/x", True), ("{tmp}/out", True), ("{home}/tandem-out", True),
    ("{cwd}/sub", True),
    ("/", False), ("/etc", False), ("/etc/tandem", False), ("..", False), ("a/../../b", False), ("/usr", False),
    ("/usr/lib", False), ("/var/log", False), ("/proc/1", False), ("/sys/x", False), ("{tmp}/to-etc", False),
    ("", False),
])
def test_out_root_rule(value, ok, tmp_path):
    from tandem.config import out_root_problem

    (tmp_path / "to-etc").symlink_to("/etc")
    value = value.format(tmp=tmp_path, home=Path.home(), cwd=Path.cwd())
    problem = out_root_problem(value)
    assert (problem is None) == ok, problem
    if not ok:
        with pytest.raises(ParamsError, match="out_root"):
            params_from_dict({"out_root": value})


def test_environment_overrides_only_the_listed_settings_and_obeys_their_rules(tmp_path):
    from tandem.config import ENV_OVERRIDES
    from tasks.common import load_params

    assert set(ENV_OVERRIDES) == {"evaluate.workers", "rollout.vllm_url", "rollout.vllm_python"}
    path = REPO / "params.yaml"
    assert load_params(path, environ={"TANDEM_VLLM_PYTHON": "/opt/vllm/bin/python"}).rollout.vllm_python == \
        "/opt/vllm/bin/python"
    p = load_params(path, environ={"TANDEM_EVAL_WORKERS": "3", "TANDEM_VLLM_URL": "http://node:8471"})
    assert p.evaluate.workers == 3 and p.rollout.vllm_url == "http://node:8471"
    assert load_params(path, environ={"TANDEM_EVAL_WORKERS": "", "TANDEM_VLLM_URL": ""}) == load_params(path, environ={})
    with pytest.raises(ParamsError, match=r"evaluate\.workers: 0 -> must be >= 1.*\(set by \$TANDEM_EVAL_WORKERS\)"):
        load_params(path, environ={"TANDEM_EVAL_WORKERS": "0"})


def test_check_params_explain_prints_every_setting_with_its_rule_and_help():
    from typer.testing import CliRunner

    from cli.main import app
    from tandem.config import field_help

    res = CliRunner().invoke(app, ["check-params", "--explain", str(REPO / "params.yaml")])
    assert res.exit_code == 0, res.output
    keys = [line.split(" = ")[0].strip() for line in res.output.splitlines()
            if line.startswith("  ") and not line.startswith("      ")]
    assert keys == setting_keys()
    assert "train.learning_rate = 0.0002  [in (0, 1]]" in res.output
    assert field_help(SECTIONS["train"])["learning_rate"] in res.output
    assert "[environment: $TANDEM_EVAL_WORKERS]" in res.output


def test_sharding_values_and_the_memory_plan_agree():
    """train.sharding accepts exactly what the train stage launches, the plan splits by each of them, and
    its advice names no other value."""
    import re

    from tandem.config import SHARDING, TrainConfig
    from tandem.plan import KNOWN_SHAPES, ModelShape, advice, plan_train_arm

    assert typing.get_args(typing.get_type_hints(TrainConfig)["sharding"]) == SHARDING
    plan_src = (REPO / "tandem" / "plan.py").read_text()
    named = set(re.findall(r"train\.sharding: (\w+)", plan_src)) | set(re.findall(r'shard(?:ing)? == "(\w+)"', plan_src))
    assert named and named <= set(SHARDING), named
    assert not re.search(r"zero[23]", plan_src)
    shape = ModelShape(**KNOWN_SHAPES["Qwen/Qwen3-4B"])
    plans = {}
    for s in SHARDING:
        p = params_from_dict({"train": {"num_processes": 8, "prompts_per_step": 16, "sharding": s}})
        plans[s] = plan_train_arm(p, "tandem", shape, "cuda")
        tips = advice(plans[s], p)
        assert set(re.findall(r"train\.sharding: (\w+)", tips)) <= set(SHARDING), tips
    assert plans["fsdp"].persistent["senior_weights"] == plans["none"].persistent["senior_weights"] / 8


def test_tool_defaults_are_stated_once():
    """TOOL_ENV is the one list; the Makefile and the Prefect deployments, which cannot import it, restate
    some of its values, and those agree with it."""
    import re

    from tandem.config import TOOL_ENV

    make = dict(re.findall(r"^export (\w+) := (\S+)$", (REPO / "Makefile").read_text(), re.M))
    prefect = yaml.safe_load((REPO / "infra" / "prefect.yaml").read_text())["definitions"]
    restated = [make] + [env for env in (prefect.get("env_process", {}), prefect.get("env_gpu", {}))]
    for env in restated:
        for key, value in env.items():
            if key in TOOL_ENV:
                assert str(value) == TOOL_ENV[key], (key, value)
    assert set(make) >= set(TOOL_ENV)
    for path in ("cli/main.py", "tasks/train.py", "tasks/validation.py", "flows/dvc_sync.py", "tests/conftest.py",
                 "benchmarks/orchestration.py"):
        text = (REPO / path).read_text()
        assert not re.search(r'"(DVC_NO_ANALYTICS|GX_ANALYTICS_ENABLED|TRL_EXPERIMENTAL_SILENCE)"', text), path


def test_the_junior_takes_the_model_sections_sources_fields_and_rules():
    import dataclasses
    import typing

    from tandem.config import MODEL_SOURCES, JuniorConfig, ModelConfig, ParamsError

    junior = typing.get_args(typing.get_type_hints(JuniorConfig)["source"])
    # the model's sources, plus the senior's base itself and the base's warm-up without its dialect phase
    assert junior == ("base", *MODEL_SOURCES, "warmup") == (
        "base", *typing.get_args(typing.get_type_hints(ModelConfig)["source"]), "warmup")
    shared = ("hub_id", "revision", "path", "gguf_file")
    fm, fj = ({f.name: f for f in dataclasses.fields(c)} for c in (ModelConfig, JuniorConfig))
    for name in shared:  # one declaration: the same default, help and rule
        assert (fm[name].default, fm[name].metadata["help"]) == (fj[name].default, fj[name].metadata["help"]), name
    for source, key in (("gguf", "gguf_file"), ("path", "path"), ("hub", "hub_id")):
        msgs = []
        for cls, section in ((ModelConfig, "model"), (JuniorConfig, "junior")):
            with pytest.raises(ParamsError) as e:
                cls(source=source, **{key: ""})
            msgs.append(str(e.value).replace(f"{section}.", "<s>."))
        assert msgs[0] == msgs[1] and f"<s>.{key}" in msgs[0]
