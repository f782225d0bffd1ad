"""Property tests of bad input: random `--set` strings, random YAML files and random bytes in token
files are either accepted or rejected with a one-line ValueError (train.py: `error: ...`, exit 2),
never another exception (a traceback)."""
import string

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from coat_jax.training import config_io, schema
from coat_jax.training.build import dataset_from_config
from coat_jax.training.schema import DataConfig

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
KEYS = ["optimizer.lr", "run.steps", "precision", "model.dtype", "data.paths", "mesh.data",
        "optimizer", "model.remat", "data.kind", "run.progress", "nope.x", ""]


def accepted_or_one_line(fn, *args):
  try:
    fn(*args)
  except ValueError as e:
    msg = str(e)
    assert msg and "\n" not in msg and "\r" not in msg, repr(msg)
    return False
  return True


@SETTINGS
@example(key="run.ste\nps", sep="=", value="1")   # a newline in the override itself
@example(key="optimizer.lr", sep="=", value="[1,\n2")
@given(key=st.sampled_from(KEYS) | st.text(max_size=20),
       sep=st.sampled_from(["=", "", "==", ".="]),
       value=st.text(max_size=30) | st.sampled_from(["1e-3", "[1, 2", "{a: b}", "true", "-1", "nan", "~"]))
def test_random_set_overrides(key, sep, value):
  accepted_or_one_line(schema.load, None, [key + sep + value])


yaml_text = st.text(alphabet=string.printable + "éλ\t", max_size=200) | st.builds(
    lambda sec, key, val: f"{sec}:\n  {key}: {val}\n",
    st.sampled_from(["optimizer", "run", "data", "model", "mesh", "bogus", "- x"]),
    st.sampled_from(["lr", "steps", "paths", "kind", "dtype", "data", "x: y"]),
    st.text(max_size=15) | st.sampled_from(["1e-3", "[a", "{", "!!python/object:os.system", "*a"]))


@SETTINGS
@example(text="optimizer:\n  lr: [1e-3\n")   # PyYAML's messages span lines
@given(text=yaml_text)
def test_random_yaml_files(tmp_path, text):
  path = tmp_path / "cfg.yaml"
  path.write_text(text, encoding="utf-8")
  accepted_or_one_line(schema.load, path)


@SETTINGS
@given(data=st.binary(max_size=300) | st.builds(lambda tail: b"\x93NUMPY" + tail, st.binary(max_size=200)),
       dtype=st.sampled_from(["uint16", "uint32"]), name=st.sampled_from(["t.bin", "t.npy"]))
def test_random_bytes_in_token_files(tmp_path, data, dtype, name):
  path = tmp_path / name
  path.write_bytes(data)
  cfg = DataConfig(kind="tokens", paths=[str(path)], dtype=dtype, seq_len=4, batch_size=2,
                   eval_fraction=0.0)

  def load_and_batch():
    ds = dataset_from_config(cfg, seed=0, log=lambda _: None)
    ds.check_vocab(1000)
    batch = ds.train_batch(0)
    assert batch.shape == (2, 5) and batch.dtype == np.int32 and batch.min() >= 0 and batch.max() < 1000

  accepted_or_one_line(load_and_batch)


def test_the_properties_can_fail():
  """The checker rejects a multi-line message and lets other exceptions through."""
  def multi():
    raise ValueError("a\nb")
  with pytest.raises(AssertionError):
    accepted_or_one_line(multi)
  with pytest.raises(KeyError):
    accepted_or_one_line(lambda: {}["x"])
  assert config_io.parse_yaml("x: 1e-3") == {"x": 0.001}
