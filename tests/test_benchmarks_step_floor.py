"""benchmarks/step/step_floor.py and benchmarks/_floor.py: the FLOPs and bytes counted from the
traced train step against the model's shapes counted by hand, the GPU's peaks, the report against
a profile, and the --summary table against the numbers it is given."""
import json
import re

import jax
import jax.numpy as jnp
import pytest

from benchmarks import _floor
from benchmarks._common import GPU_PEAKS
from benchmarks.step import step_floor as sf

# The tiny preset (hidden 256, 4 heads and 2 KV heads of 64, vocab 4096) with an FFN of 768 (the
# preset's 688 would be padded to the GEMM kernel's 128-wide tiles, more FLOPs than 6 T N), 4 x 64
# tokens.
PRESET, SEQ, BATCH, SETS = "tiny", 64, 4, ["model.intermediate_size=768"]
H100, H200 = GPU_PEAKS["h100"], GPU_PEAKS["h200"]
TINY_ARGS = ["--preset", PRESET, "--seq-len", str(SEQ), "--batch", str(BATCH),
             "--set", SETS[0]]


def _linear_params_per_layer(m):
  q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
  return m.hidden_size * (q + 2 * kv) + q * m.hidden_size + 3 * m.hidden_size * m.intermediate_size


@pytest.fixture(scope="module")
def counted():
  m = _floor.llama_config(PRESET, SEQ, BATCH, SETS)
  return m, sf.floors(PRESET, SEQ, BATCH, SETS, H100)


def test_count_of_a_hand_written_program():
  """2 M N K and the operands' and result's bytes per GEMM, a scan's body `length` times, the
  batched (attention-like) dot_general left out."""
  m, n, k = 48, 40, 24

  def fn(x, w, q):
    y = x @ w                                                   # (m, k) x (k, n), bf16
    # 3 x ((m, n) x (n, k), then (m, k) x (k, n)), float32
    z, _ = jax.lax.scan(lambda c, _: (c @ w.T.astype(jnp.float32) @ w.astype(jnp.float32), None),
                        y.astype(jnp.float32), None, length=3)
    s = jnp.einsum("bik,bjk->bij", q, q)                        # batched: not counted
    return z, s

  args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16),
          jax.ShapeDtypeStruct((2, 8, 16), jnp.bfloat16))
  got = _floor.count(jax.make_jaxpr(fn)(*args).jaxpr)
  assert got["bf16 GEMM flops"] == 2 * m * n * k + 3 * 2 * (2 * m * n * k)
  assert got["GEMM bytes"] == 2 * (m * k + k * n + m * n) + 3 * 4 * (
      (m * n + n * k + m * k) + (m * k + k * n + m * n))
  assert got["FP8 GEMM flops"] == 0 and got["kernels"] == 0


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
  assert fl["coat"]["ms"]["FP8 GEMM"] == pytest.approx(linears / H100["fp8_flops"] * 1e3)
  attn = 3.5 * 2 * BATCH * m.num_heads * SEQ ** 2 * m.head_dim * m.num_layers
  assert fl["coat"]["counts"]["attention flops"] == attn


def test_remat_full_counts_the_recompute():
  """remat full: the forward's GEMMs run again but the down projection's (its output is not
  needed by the backward), 8 T N - 2 T N_down per layer; the attention one forward more."""
  full = _floor.step_counts(PRESET, "coat", SEQ, BATCH, (*SETS, "model.remat=full"))
  m = _floor.llama_config(PRESET, SEQ, BATCH, SETS)
  tokens = SEQ * BATCH
  per_layer, down = _linear_params_per_layer(m), m.hidden_size * m.intermediate_size
  assert full["remat"] == "full"
  assert full["per_layer"]["FP8 GEMM flops"] == 8 * tokens * per_layer - 2 * tokens * down
  one_forward = 2 * BATCH * m.num_heads * SEQ ** 2 * m.head_dim
  assert full["per_layer"]["attention flops"] == (2 + 2.5) * one_forward


def test_depth_extrapolated_from_two_traces_equals_the_full_trace(counted):
  m, fl = counted
  full = _floor.trace_counts(PRESET, "coat", m.num_layers, SEQ, BATCH, SETS)
  assert full["quantize bytes"] > 0 and full["kernels"] > 0
  for key in ("FP8 GEMM flops", "bf16 GEMM flops", "GEMM bytes", "quantize bytes", "kernels"):
    assert fl["coat"]["counts"][key] == full[key], key
  assert fl["bf16"]["counts"].get("quantize bytes", 0) == 0


def test_h200_moves_only_the_byte_floors_by_the_bandwidths_ratio(counted):
  _, h100 = counted
  h200 = sf.floors(PRESET, SEQ, BATCH, SETS, H200)
  ratio = H200["hbm_bytes_per_s"] / H100["hbm_bytes_per_s"]
  assert ratio == pytest.approx(4.8 / 3.35)
  for p in sf.PRECISIONS:
    for cat in ("quantize", "optimizer"):
      assert h100[p]["ms"][cat] == pytest.approx(ratio * h200[p]["ms"][cat]), (p, cat)
    for cat in ("FP8 GEMM", "bf16 GEMM", "attention"):
      assert h100[p]["ms"][cat] == pytest.approx(h200[p]["ms"][cat]), (p, cat)
  measured = sf.peaks_of("h200", 3.878)
  assert sf.floors(PRESET, SEQ, BATCH, SETS, measured)["coat"]["ms"]["optimizer"] == pytest.approx(
      h200["coat"]["ms"]["optimizer"] * 4.8 / 3.878)


def test_report_against_a_profile(counted, tmp_path, capsys):
  """The report reads profile_step's JSON: measured beside floor, the back-to-back step from the
  trace's span, and what the asked ratio needs of the FP8 GEMMs and quantize kernels."""
  rows = []
  for variant, step, span, cats in (
      ("bf16:loop", 230.0, 660.0, {"bf16 GEMM": 150.0, "attention": 20.0, "optimizer": 12.0}),
      ("coat:loop", 190.0, 530.0, {"FP8 GEMM": 80.0, "bf16 GEMM": 12.0, "quantize": 19.0,
                                   "attention": 20.0, "optimizer": 12.0})):
    rows.append({"variant": variant, "step_ms": step, "kernel_ms": sum(cats.values()) + 30.0,
                 "category_ms": cats, "iters": 3, "gaps": {"span_ms": span}})
  path = tmp_path / "profile.json"
  path.write_text(json.dumps(rows))
  assert sf.main(TINY_ARGS + ["--profile", str(path), "--gpu", "h100"]) == 0
  out = capsys.readouterr().out
  assert "H100 SXM datasheet peaks" in out and "HBM 3.35 TB/s" in out
  assert "step, back to back" in out and "220.00" in out and "176.67" in out   # 660 / 3, 530 / 3
  assert "1.25x (176.7 vs 220.0 ms)" in out
  # 1.43x: coat <= 153.8 ms; everything but FP8 GEMM + quantize is 176.67 - 99 = 77.7 ms.
  assert "needs coat <= 153.8 ms" in out and "take 99.0 ms now" in out


def _table(out):
  """{row label: [cells]} of the --summary markdown table."""
  rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ")]
  return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def test_summary_measured_over_floor(capsys, monkeypatch):
  """Each row: the measured ms from its input (kernel ms, layer ms, tokens/s -> batch x seq /
  tokens/s), the floor the larger of the two floors, measured / floor their quotient; rows
  without a number print the floor only."""
  monkeypatch.setattr(sf, "LAYER", dict(preset=PRESET, seq_len=SEQ, batch=BATCH, sets=tuple(SETS)))
  assert sf.main(TINY_ARGS + ["--summary", "--hbm-tbps", "3.878", "--optimizer-ms", "rows=6.5",
                              "--optimizer-ms", "7.6", "--layer-ms", "coat=0.05",
                              "--tokens-per-s", "coat=2500000"]) == 0
  out = capsys.readouterr().out
  assert "HBM 3.878 TB/s measured" in out
  rows = _table(out)
  opt = [cells for label, cells in rows.items() if label.startswith("optimizer step")]
  layer = [c for label, c in rows.items() if "decoder layer" in label and label.endswith("coat")]
  step = [(label, c) for label, c in rows.items() if "train step" in label]
  assert [c[6] for c in opt] == ["6.500", "7.600"] and layer[0][6] == "0.05000"
  assert len(step) == 1 and step[0][0].startswith("tiny train step, batch 4 x 64, coat")
  step_ms = BATCH * SEQ / 2.5e6 * 1e3
  assert float(step[0][1][6]) == pytest.approx(step_ms, rel=1e-3)
  # the optimizer's floor by hand: 1.21e9 params x 16.16 bytes at 3.878 TB/s
  bytes_ms = _floor.OPTIMIZER_PARAMS * (2 * (4 + 2 + 10 / 128) + 4) / 3.878e12 * 1e3
  assert float(opt[0][4]) == pytest.approx(bytes_ms, rel=1e-3)
  assert [c[7] for c in opt] == [f"{6.5 / bytes_ms:.2f}x", f"{7.6 / bytes_ms:.2f}x"]
  counts = _floor.step_counts(PRESET, "coat", SEQ, BATCH, SETS)["counts"]
  floor = _floor.roofline(counts, sf.peaks_of("h200", 3.878))["floor ms"]
  assert step[0][1][7] == f"{step_ms / floor:.2f}x"
  for cells in opt + layer + [step[0][1]]:
    compute, moved, floor = (float(cells[i]) for i in (2, 3, 4))
    assert floor == max(compute, moved)
  bf16_layer = next(c for label, c in rows.items() if "decoder layer" in label and "bf16" in label)
  assert bf16_layer[6] == "" and bf16_layer[7] == "" and float(bf16_layer[4]) > 0


def test_summary_reads_a_train_py_run(tmp_path, capsys, monkeypatch):
  """--summary-json: tokens/s from summary.json, the step's shape and precision from the
  config.yaml beside it."""
  from coat_jax.training import schema
  monkeypatch.setattr(sf, "LAYER", dict(preset=PRESET, seq_len=SEQ, batch=BATCH, sets=tuple(SETS)))
  run = tmp_path / "run"
  run.mkdir()
  cfg = schema.load(None, [f"model.preset={PRESET}", "precision=bf16", "data.seq_len=32",
                           "data.batch_size=2", "model.intermediate_size=768"])
  (run / "config.yaml").write_text(cfg.to_yaml())
  (run / "summary.json").write_text(json.dumps({"tokens_per_s": 16000.0, "mfu": None,
                                                "flops_per_token": 1e6}))
  assert sf.main(["--summary", "--summary-json", str(run / "summary.json")]) == 0
  out = capsys.readouterr().out
  label, cells = next((k, v) for k, v in _table(out).items() if "train step" in k)
  assert re.match(r"tiny train step, batch 2 x 32, bf16, remat none", label)
  assert cells[6] == "4.000"   # 2 x 32 tokens at 16000 tokens/s
  assert "16,000 tokens/s, MFU n/a" in out


@pytest.mark.parametrize("argv, message", [
    (["--profile", "/nonexistent/p.json"], "--profile /nonexistent/p.json: no such file"),
    (["--summary", "--layer-ms", "fp32=3"], "--layer-ms 'fp32=3': expected bf16|coat=NUMBER"),
    (["--summary", "--tokens-per-s", "coat=-1"], "expected bf16|coat=NUMBER with the number > 0"),
    (["--optimizer-ms", "5"], "go with --summary"),
    (["--summary", "--summary-json", "/nonexistent/summary.json"],
     "--summary-json /nonexistent/summary.json: not a train.py summary.json"),
])
def test_bad_input_is_one_line(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    sf.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert message in err and "Traceback" not in err


def test_unknown_preset_is_one_line(capsys):
  with pytest.raises(SystemExit) as e:
    sf.main(["--preset", "llama-9z"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert "unknown model preset 'llama-9z'" in err and "Traceback" not in err
