"""benchmarks/step/step_memory.py: variants parsed, each compiled and counted per parameter."""
import pytest

from benchmarks.step import step_memory


def test_variant_text_parses_and_bad_text_is_refused():
  assert step_memory.parse_variant("sr=") == ("sr", [])
  assert step_memory.parse_variant("n=optimizer.accumulate=4,model.remat=full") == (
      "n", ["optimizer.accumulate=4", "model.remat=full"])
  for bad in ("nameonly", "=optimizer.accumulate=4"):
    with pytest.raises(ValueError, match="NAME="):
      step_memory.parse_variant(bad)


def test_accumulator_appears_in_the_count_and_the_prediction():
  """Four microbatches add the float32 accumulator (4 B/param) to the count; XLA's prediction is
  its state plus temporaries (the outputs alias the donated state)."""
  base = ["model.num_layers=1", "data.seq_len=32", "data.batch_size=32"]
  one = step_memory.measure("configs/tiny.yaml", base + ["optimizer.accumulate=1"], None)
  four = step_memory.measure("configs/tiny.yaml", base + ["optimizer.accumulate=4",
                                                          "optimizer.accumulate_dtype=float32"],
                             None)
  assert one["params"] == four["params"] > 0
  extra = (four["budget"]["total"] - one["budget"]["total"]) / one["params"]
  assert extra == pytest.approx(4.0)
  for r in (one, four):
    assert r["predicted_bytes"] == (r["argument_size_in_bytes"] + r["output_size_in_bytes"]
                                    - r["alias_size_in_bytes"] + r["temp_size_in_bytes"])
    assert r["temp_size_in_bytes"] > 0


def test_a_linear_switch_in_a_variant_reaches_the_traced_step():
  """`linear.NAME=VALUE` is an FP8 linear switch, not a config key: a bad value is refused by the
  switch (so it was routed there), a good one compiles the tiny step."""
  base = ["model.num_layers=1", "data.seq_len=32", "data.batch_size=8", "precision=coat"]
  with pytest.raises(ValueError, match="weight_transpose must be one of"):
    step_memory.measure("configs/tiny.yaml", base + ["linear.weight_transpose=bogus"], None)
  r = step_memory.measure("configs/tiny.yaml", base + ["linear.weight_transpose=cast"], None)
  assert r["params"] > 0 and r["temp_size_in_bytes"] > 0
