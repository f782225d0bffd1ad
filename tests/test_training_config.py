"""Config loading: YAML numbers, where errors are reported, the schema's checks."""
from pathlib import Path

import pytest
import yaml

from coat_jax.training import config_io, schema

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path, text: str) -> Path:
  path = tmp_path / "run.yaml"
  path.write_text(text)
  return path


@pytest.mark.parametrize("text,want", [("1e-3", 0.001), ("3E+2", 300.0), ("-2.5e-4", -2.5e-4),
                                       (".5", 0.5), ("7", 7), ("0.25", 0.25)])
def test_yaml_numbers_in_scientific_notation_load_as_numbers(tmp_path, text, want):
  path = write(tmp_path, f"optimizer:\n  lr: 1e-3\n  eps: {text}\nrun:\n  steps: 7\n")
  cfg = schema.load(path) if want > 0 else None
  raw = config_io.load_yaml(path)
  assert raw["optimizer"]["lr"] == 0.001 and isinstance(raw["optimizer"]["lr"], float)
  assert raw["optimizer"]["eps"] == want and type(raw["optimizer"]["eps"]) is type(want)
  assert raw["run"]["steps"] == 7 and type(raw["run"]["steps"]) is int
  if cfg is not None:
    assert cfg.optimizer.lr == 0.001 and cfg.optimizer.eps == float(want)


def test_plain_safe_load_reads_1e_minus_3_as_a_string():
  """The reason for config_io.YamlLoader: PyYAML's YAML 1.1 resolver (so the test above could fail)."""
  assert yaml.safe_load("x: 1e-3")["x"] == "1e-3"


def test_yaml_strings_and_bools_stay_what_they_were(tmp_path):
  raw = config_io.load_yaml(write(tmp_path, "a: abc\nb: true\nc: '1e-3'\nd: [1, 2.5]\ne: null\n"))
  assert raw == {"a": "abc", "b": True, "c": "1e-3", "d": [1, 2.5], "e": None}


def test_file_and_override_agree_on_floats(tmp_path):
  path = write(tmp_path, "optimizer:\n  lr: 2e-4\n")
  assert schema.load(path).optimizer.lr == schema.load(None, ["optimizer.lr=2e-4"]).optimizer.lr == 2e-4


@pytest.mark.parametrize("item,pattern", [
    ("optimizer.lrr=1", r"^--set optimizer.lrr=1: unknown config key 'optimizer.lrr' \(did you mean 'lr'\?\)"),
    ("run.steps=ten", r"^--set run.steps=ten: config key 'run.steps' must be an int"),
    ("modle.num_layers=2", r"^--set modle.num_layers=2: unknown config key 'modle'"),
    ("precision=fp4", r"^--set precision=fp4: config key 'precision' must be one of"),
    ("model.attention_residuals=fp16",
     r"^--set model.attention_residuals=fp16: config key 'model.attention_residuals' must be one of"),
    ("model.linear_residuals=recomputed",
     r"^--set model.linear_residuals=recomputed: config key 'model.linear_residuals' must be one "
     r"of"),
    ("optimizer.lr=-1", r"^--set optimizer.lr=-1: config key 'optimizer.lr' must be > 0"),
    ("optimizer", r"^--set optimizer: expected key=value"),
    ("optimizer=1", r"^--set optimizer=1: 'optimizer' names a section"),
])
def test_bad_override_error_names_the_override_not_the_file(tmp_path, item, pattern):
  path = write(tmp_path, "run:\n  steps: 5\n")
  with pytest.raises(ValueError, match=pattern) as e:
    schema.load(path, [item])
  assert str(path) not in str(e.value) and "\n" not in str(e.value)


def test_error_in_the_file_names_the_file(tmp_path):
  path = write(tmp_path, "optimizer:\n  lrr: 0.1\n")
  with pytest.raises(ValueError, match=rf"^config file {path}: unknown config key 'optimizer.lrr'"):
    schema.load(path, ["run.steps=3"])
  path = write(tmp_path, "optimizer:\n  lr: -0.1\n")
  with pytest.raises(ValueError, match=rf"^config file {path}: config key 'optimizer.lr' must be > 0"):
    schema.load(path, ["run.steps=3"])
  assert schema.load(path, ["optimizer.lr=0.1"]).optimizer.lr == 0.1  # an override may fix it
  path = write(tmp_path, "optimizer: [unclosed\n")
  with pytest.raises(ValueError, match=rf"^config file {path} is not valid YAML"):
    schema.load(path)


def test_a_value_error_that_needs_two_overrides_blames_the_first_that_breaks(tmp_path):
  with pytest.raises(ValueError, match=r"^--set data.kind=tokens: data.kind='tokens' needs 'data.paths'"):
    schema.load(None, ["run.steps=3", "data.kind=tokens"])
  cfg = schema.load(None, ["data.kind=tokens", "data.paths=[a.bin]"])
  assert cfg.data.kind == "tokens" and cfg.data.paths == ["a.bin"]


def test_files_named_for_the_stdlib_corpus_are_an_error_not_ignored(tmp_path):
  """data.paths with data.kind 'stdlib' (the default, which reads no files) stops the load: a
  user's own YAML that names its files but not its kind, or files given on the command line, must
  not train on the standard library's sources instead."""
  path = write(tmp_path, "data:\n  paths: [my/*.npy]\n")
  with pytest.raises(ValueError, match=rf"^config file {path}: data.paths=\['my/\*.npy'\] names "
                                       r"files, but data.kind='stdlib' .* reads none"):
    schema.load(path)
  with pytest.raises(ValueError, match=r"^--set data.kind=stdlib: .*data.paths=\[\]"):
    schema.load(REPO / "configs" / "olmo-1b.yaml", ["data.kind=stdlib"])
  # the shipped configs' offline smoke run: the stdlib with no files
  cfg = schema.load(REPO / "configs" / "olmo-1b.yaml", ["data.kind=stdlib", "data.paths=[]"])
  assert cfg.data.kind == "stdlib" and cfg.data.paths == []
  assert schema.load(path, ["data.kind=tokens"]).data.paths == ["my/*.npy"]


def test_precision_choices_come_from_coat_jax_precision():
  from coat_jax.precision import PRECISIONS
  assert not hasattr(schema, "PRECISIONS") or schema.PRECISIONS is PRECISIONS
  for p in PRECISIONS:
    assert schema.load(None, [f"precision={p}"]).precision == p


@pytest.mark.parametrize("name", ["tiny", "llama-125m", "olmo-1b", "llama2-7b", "llama2-13b"])
def test_shipped_configs_load_and_round_trip(name):
  cfg = schema.load(REPO / "configs" / f"{name}.yaml")
  assert cfg.model.preset == name
  assert schema.from_dict(config_io.parse_yaml(cfg.to_yaml())) == cfg


@pytest.mark.parametrize("key,default,other", [("attention_residuals", "bf16", "fp8"),
                                                ("linear_residuals", "kept", "remade")])
def test_residual_choices_reach_the_model_config(key, default, other):
  """model.attention_residuals / model.linear_residuals (None: the preset's) become
  LlamaConfig's."""
  from coat_jax.training.build import model_config
  for value, want in ((None, default), (other, other)):
    sets = [] if value is None else [f"model.{key}={value}"]
    cfg = schema.load(None, sets)
    assert getattr(model_config(cfg, None), key) == want


def test_set_mesh_axis_to_fill_moves_the_fill_from_the_file():
  """`--set mesh.fsdp=-1` over a config that fills data (-1) is FSDP over all devices, not an
  error; an override naming both fills is still refused in one line."""
  cfg = schema.load(REPO / "configs" / "tiny.yaml", ["mesh.fsdp=-1"])
  assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (1, -1, 1)
  cfg = schema.load(None, ["mesh.tensor=-1", "mesh.data=2"])   # data named: kept
  assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (2, 1, -1)
  assert schema.load(None, []).mesh.data == -1
  with pytest.raises(ValueError, match="at most one mesh axis may be -1"):
    schema.load(None, ["mesh.tensor=-1", "mesh.data=-1"])
