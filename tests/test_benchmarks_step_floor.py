"""benchmarks/step/step_floor.py: the FLOPs and bytes it counts from the traced train step, against the
model's shapes counted by hand, and its report against a profile."""
import json

import pytest

from benchmarks.step import step_floor as sf

# The tiny preset (hidden 256, 4 heads and 2 KV heads of 64, vocab 4096) with an FFN of 768 (the
# preset's 688 would be padded to the GEMM kernel's 128-wide tiles, more FLOPs than 6 T N), 4 x 64
# tokens.
PRESET, SEQ, BATCH, SETS = "tiny", 64, 4, ["model.intermediate_size=768"]


def _linear_params_per_layer(m):
  q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
  return m.hidden_size * (q + 2 * kv) + q * m.hidden_size + 3 * m.hidden_size * m.intermediate_size


@pytest.fixture(scope="module")
def counted():
  m = sf.llama_config(PRESET, SEQ, BATCH, SETS)
  return m, sf.floors(PRESET, SEQ, BATCH, SETS)


def test_gemm_flops_are_six_tokens_params(counted):
  """Forward + two backward products per weight: 6 T N, N the matmul parameters; coat's linears
  in FP8 and its LM head in bf16, bf16's all in bf16."""
  m, fl = counted
  tokens = SEQ * BATCH
  linears = 6 * tokens * m.num_layers * _linear_params_per_layer(m)
  head = 6 * tokens * m.hidden_size * m.vocab_size
  assert fl["coat"]["counts"]["FP8 GEMM flops"] == linears
  assert fl["coat"]["counts"]["bf16 GEMM flops"] == head
  assert fl["bf16"]["counts"].get("FP8 GEMM flops", 0) == 0
  assert fl["bf16"]["counts"]["bf16 GEMM flops"] == linears + head
  assert fl["coat"]["ms"]["FP8 GEMM"] == pytest.approx(linears / sf.H100["fp8_flops"] * 1e3)


def test_depth_extrapolated_from_two_traces_equals_the_full_trace(counted):
  m, fl = counted
  full = sf.trace_counts(PRESET, "coat", m.num_layers, SEQ, BATCH, SETS)
  assert full["quantize bytes"] > 0 and full["kernels"] > 0
  for key in ("FP8 GEMM flops", "bf16 GEMM flops", "quantize bytes", "kernels"):
    assert fl["coat"]["counts"][key] == full[key], key
  assert fl["bf16"]["counts"].get("quantize bytes", 0) == 0


def test_report_against_a_profile(counted, tmp_path, capsys):
  """The report reads profile_step's JSON: measured beside floor, the back-to-back step from the
  trace's span, and what the asked ratio needs of the FP8 GEMMs and quantize kernels."""
  _, fl = counted
  rows = []
  for variant, step, span, cats in (
      ("bf16:loop", 230.0, 660.0, {"bf16 GEMM": 150.0, "attention": 20.0, "optimizer": 12.0}),
      ("coat:loop", 190.0, 530.0, {"FP8 GEMM": 80.0, "bf16 GEMM": 12.0, "quantize": 19.0,
                                   "attention": 20.0, "optimizer": 12.0})):
    rows.append({"variant": variant, "step_ms": step, "kernel_ms": sum(cats.values()) + 30.0,
                 "category_ms": cats, "iters": 3, "gaps": {"span_ms": span}})
  path = tmp_path / "profile.json"
  path.write_text(json.dumps(rows))
  assert sf.main(["--preset", PRESET, "--seq-len", str(SEQ), "--batch", str(BATCH),
                  "--profile", str(path)]) == 0
  out = capsys.readouterr().out
  assert "step, back to back" in out and "220.00" in out and "176.67" in out   # 660 / 3, 530 / 3
  assert "1.25x (176.7 vs 220.0 ms)" in out
  # 1.43x: coat <= 153.8 ms; everything but FP8 GEMM + quantize is 176.67 - 99 = 77.7 ms.
  assert "needs coat <= 153.8 ms" in out and "take 99.0 ms now" in out


def test_missing_profile_is_one_line(capsys):
  with pytest.raises(SystemExit) as e:
    sf.main(["--profile", "/nonexistent/profile.json"])
  assert e.value.code == 2
  assert "--profile /nonexistent/profile.json: no such file" in capsys.readouterr().err


def test_unknown_preset_is_one_line(capsys):
  with pytest.raises(SystemExit) as e:
    sf.main(["--preset", "llama-9z"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert "unknown model preset 'llama-9z'" in err and "Traceback" not in err
