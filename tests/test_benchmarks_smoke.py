"""Smoke tests of the benchmark scripts (step/bench_e2e, accuracy/{accuracy,stability,
master_weights}, step/compile_breakdown, ...): tiny shapes, outputs exist, finite;
benchmarks/_common.py; and the scripts' import rules (only the underscored modules are shared, no
sys.path edits)."""
import json
import math
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax.training.build import cross_entropy
from tests.benchmark_scripts import REPO, load as _load

common = _load("_common")
e2e = _load("bench_e2e")
accuracy = _load("accuracy")
seeds = _load("seeds")
loss_curves = _load("_loss_curves")
stability = _load("stability")
master = _load("master_weights")
resume = _load("resume_across_meshes")


def test_logit_sharpness_is_the_maximum_over_the_box(rng):
  v, eps = 11, 0.05
  z = jnp.asarray(rng.standard_normal((2, 3, v)) * 3, jnp.float32)
  y = jnp.asarray(rng.integers(0, v, (2, 3)), jnp.int32)
  sharp, loss = stability.logit_sharpness(z, y, eps)
  ce = jax.jit(jax.vmap(lambda d: cross_entropy(z + d, y)))
  base = float(ce(jnp.zeros((1,) + z.shape))[0])
  assert abs(float(loss) - base) < 1e-6 and float(sharp) > 0
  worst = base + float(sharp) / 100 * (1 + base)
  bound = np.asarray(eps * (jnp.abs(z) + 1))
  # Random points and random vertices of the box never beat the closed form.
  inside = bound * rng.uniform(-1, 1, (300,) + z.shape)
  vertices = bound * rng.choice([-1.0, 1.0], (300,) + z.shape)
  assert float(jnp.max(ce(jnp.asarray(np.concatenate([inside, vertices]), jnp.float32)))) <= worst + 1e-5


def test_quant_error_of_a_moment(rng):
  x = (rng.standard_normal((8, 256)) * np.exp(rng.uniform(-4, 4, (8, 1)))).astype(np.float32)
  err, ss, flushed, nonzero = stability.quant_error(x ** 2, "e4m3", 128, 16, True)
  assert 1e-5 < err / ss < 1e-2 and 0 <= flushed <= nonzero == x.size   # rounded, not skipped


def test_e2e_child_and_table(capsys):
  args = e2e.parse_args(["--one", "bf16+adamw", "--preset", "tiny", "--set", "model.num_layers=1",
                         "--set", "model.hidden_size=64", "--set", "model.intermediate_size=128",
                         "--seq-len", "16", "--batch", "8", "--steps", "2", "--warmup", "1"])
  r = e2e.measure_one(args)
  assert r["status"] == "ok", r.get("error")
  assert r["tokens_per_s"] > 0 and r["peak_bytes"] > 0 and r["loss_finite"]
  assert math.isfinite(r["loss_last"]) and r["flops_per_token"] > 0
  assert r["timed_steps"] == 2 and r["step_s"] > 0 and r["step_s_blocking"] > 0
  assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / r["num_devices"])
  assert isinstance(r["hlo_ops"], dict) and r["mesh"]["data"] == r["num_devices"]
  other = dict(r, mode="coat+coat_adamw", peak_bytes=r["peak_bytes"] // 2,
               tokens_per_s=2 * r["tokens_per_s"])
  rows = e2e.ratio_rows([r, other, {"mode": "fp8_linear+adamw", "batch": 8, "status": "oom"}])
  assert rows[1]["mem_ratio"] == pytest.approx(0.5, rel=1e-3) and rows[1]["tps_ratio"] == pytest.approx(2)
  assert rows[2]["mem_ratio"] is None
  e2e.print_table("t", rows)
  assert "coat+coat_adamw" in capsys.readouterr().out
  assert r["layers"] == "scanned"
  # --layers best: bf16 both ways; every ratio against bf16's best row for that metric (its
  # fastest for tokens/s, its smallest peak for memory), not against the first bf16 row.
  unrolled = dict(r, layers="unrolled", tokens_per_s=1.5 * r["tokens_per_s"],
                  peak_bytes=r["peak_bytes"] * 2)
  rows = e2e.ratio_rows([r, unrolled, other])
  assert rows[2]["tps_ratio"] == pytest.approx(2 / 1.5) and rows[2]["mem_ratio"] == pytest.approx(0.5, rel=1e-3)
  assert rows[0]["tps_ratio"] == pytest.approx(1 / 1.5) and rows[1]["mem_ratio"] == pytest.approx(2, rel=1e-3)
  e2e.print_table("t", rows)
  assert "unrolled" in capsys.readouterr().out


def test_e2e_compile_only_reports_the_prediction_and_runs_nothing(capsys):
  args = e2e.parse_args(["--one", "coat+coat_adamw", "--preset", "tiny", "--set", "model.num_layers=1",
                         "--set", "model.hidden_size=64", "--set", "model.intermediate_size=128",
                         "--seq-len", "16", "--batch", "8", "--compile-only"])
  r = e2e.measure_one(args)
  assert r["status"] == "compiled", r.get("error")
  assert r["memory_analysis"]["predicted_bytes"] > r["params_bytes"] > 0 and r["compile_s"] > 0
  assert "tokens_per_s" not in r and "loss_first" not in r
  e2e.print_table("t", e2e.ratio_rows([r]))
  assert "compiled" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    e2e.parse_args(["--compile-only", "--find-max-batch"])


def test_e2e_state_over_the_device_is_compiled_only_under_compile_only(monkeypatch):
  """A mode whose state exceeds the device's bytes_limit is "oom (state)" without compiling when
  it would run, and still compiled under --compile-only (compiling allocates nothing)."""
  monkeypatch.setattr(e2e, "device_bytes_limit", lambda dev: 1024)
  base = ["--one", "bf16+adamw", "--preset", "tiny", "--set", "model.num_layers=1",
          "--set", "model.hidden_size=64", "--set", "model.intermediate_size=128",
          "--seq-len", "16", "--batch", "8"]
  ran = e2e.measure_one(e2e.parse_args(base))
  assert ran["status"] == "oom (state)" and "cannot fit at any batch" in ran["error"]
  assert "compile_s" not in ran
  compiled = e2e.measure_one(e2e.parse_args(base + ["--compile-only"]))
  assert compiled["status"] == "compiled", compiled.get("error")
  assert compiled["compile_s"] > 0 and compiled["state_lower_bound_bytes"] > 1024


def test_e2e_linear_switch_reaches_the_child_trace():
  """`--set linear.NAME=VALUE` is an FP8 linear switch set while the child traces, not a config
  key: a bad value is the switch's error, a good one compiles and is reported."""
  base = ["--one", "coat+coat_adamw", "--preset", "tiny", "--set", "model.num_layers=1",
          "--set", "model.hidden_size=64", "--set", "model.intermediate_size=128",
          "--seq-len", "16", "--batch", "8", "--compile-only"]
  bad = e2e.measure_one(e2e.parse_args(base + ["--set", "linear.weight_transpose=bogus"]))
  assert bad["status"] == "error" and "weight_transpose must be one of" in bad["error"]
  good = e2e.measure_one(e2e.parse_args(base + ["--set", "linear.weight_transpose=cast"]))
  assert good["status"] == "compiled", good.get("error")
  assert good["linear_switches"] == {"weight_transpose": "cast"}


def test_e2e_layers_option():
  """--layers runs children scanned, unrolled or both; it may not be given together with a
  --set of model.scan_layers (two answers to one question), a one-line parser error."""
  assert e2e.LAYERS["best"] == ("scanned", "unrolled")
  assert e2e.parse_args(["--layers", "best"]).layers == "best"
  with pytest.raises(SystemExit):
    e2e.parse_args(["--layers", "unrolled", "--set", "model.scan_layers=true"])
  with pytest.raises(SystemExit):
    e2e.parse_args(["--layers", "sideways"])
  assert e2e.parse_args(["--set", "model.scan_layers=false"]).layers == "scanned"   # as before


def test_master_weights_child_table_and_plot(tmp_path):
  """benchmarks/accuracy/master_weights.py: one child in-process (Kahan, bf16 master from the float32
  init), then the comparison table and plot against a made-up reference."""
  args = master.parse_args(["--one", "bf16_master_kahan", "--preset", "tiny", "--precision", "bf16",
                            "--steps", "2", "--eval-every", "1", "--seq-len", "16", "--batch", "2",
                            "--set", "model.num_layers=1", "--set", "model.hidden_size=32",
                            "--set", "model.intermediate_size=64", "--out", str(tmp_path)])
  rec = master.train_one(args)
  assert [s for s, _ in rec["evals"]] == [1, 2] and len(rec["losses"]) == 2
  assert all(math.isfinite(x) for x in rec["losses"])
  n = rec["num_params"]
  assert rec["budget"]["params"] == 2 * n and rec["budget"]["grads"] == 2 * n
  ref = {"variant": "f32_master", "losses": rec["losses"],
         "evals": [[1, rec["evals"][0][1]], [2, rec["evals"][1][1] / 1.01]]}
  common, rows = master.compare({"f32_master": ref, "bf16_master_kahan": rec,
                                 "bf16_master_sr": {"variant": "bf16_master_sr", "error": "x"}})
  assert common == 2 and rows[1]["diff_pct"] == pytest.approx(1.0, rel=1e-6)
  assert rows[1]["within"] is False and rows[0]["within"] is True and rows[2]["eval_loss"] is None
  assert "| bf16_master_kahan |" in master.markdown(args, common, rows)
  assert master.plot({"f32_master": ref, "bf16_master_kahan": rec}, tmp_path / "p.png")


def test_accuracy_report_from_metrics(tmp_path):
  for mode, shift in (("bf16+adamw", 0.0), ("coat+coat_adamw", 0.05)):
    d = accuracy.mode_dir(tmp_path, mode)
    d.mkdir(parents=True)
    recs = [{"step": s, "split": "eval", "loss": 5.0 - s / 100 + shift} for s in (10, 20, 30)]
    recs += [{"step": s, "split": "train", "loss": 6.0 - s / 100, "epoch": s / 100} for s in (1, 10, 20, 30)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
  out = accuracy.main(["--plot-only", "--out", str(tmp_path)])
  assert (tmp_path / "accuracy.png").stat().st_size > 1000
  gap = out["comparison"]["final_gap"]["coat+coat_adamw"]
  assert gap == pytest.approx(0.05 / 4.7)
  assert json.loads((tmp_path / "accuracy.json").read_text())["comparison"]["final_step"] == 30


def test_accuracy_seeds_table_and_plot(tmp_path, capsys):
  # Two seeds' accuracy.json (as accuracy.py writes them), bf16 and coat curves made by hand.
  files = []
  for seed, bf16, coat in ((0, [5.0, 4.0, 4.2], [5.1, 3.9, 4.3]), (1, [5.2, 4.4, 4.6], [5.2, 4.3, 4.6])):
    gap = [(c - b) / b for b, c in zip(bf16, coat)]
    result = {"args": {"seed": seed}, "comparison": {
        "steps": [100, 200, 300], "eval": {"bf16+adamw": bf16, "coat+coat_adamw": coat},
        "rel_gap": {"coat+coat_adamw": gap}}}
    files.append(tmp_path / f"s{seed}.json")
    files[-1].write_text(json.dumps(result))
  png = tmp_path / "gap.png"
  s = seeds.main([str(f) for f in files] + ["--plot", str(png)])
  assert png.stat().st_size > 1000
  assert [r["seed"] for r in s["seeds"]] == [0, 1]
  assert s["seeds"][0]["final_gap"] == pytest.approx(0.1 / 4.2)    # the last eval, not the lowest
  assert s["seeds"][1]["lowest_gap"] == pytest.approx(-0.1 / 4.4)  # each mode's own lowest
  assert s["mean"]["final"] == pytest.approx(4.45)
  assert s["mean"]["final_gap"] == pytest.approx((4.45 - 4.4) / 4.4)
  assert s["bf16_seed_spread"] == pytest.approx(np.std([4.2, 4.6], ddof=1) / 4.4)
  assert (s["evals"], s["evals_above"]) == (6, 2)                    # a zero gap is not above
  assert s["gap_range"] == pytest.approx((-0.1 / 4.0, 0.1 / 4.2))
  assert "mean" in capsys.readouterr().out
  with pytest.raises(SystemExit):   # a run without the compared mode: one line, exit status 2
    seeds.main([str(files[0]), "--mode", "fp8_linear+adamw"])


def test_accuracy_seeds_baseline(tmp_path):
  # A run of coat alone takes bf16's curve from the baseline run of its own seed.
  def run(seed, curves, steps=2000):
    return {"args": {"seed": seed, "config": "/x/configs/llama-125m.yaml", "steps": steps,
                     "seq_len": 64, "batch": 4, "eval_every": 100, "eval_batches": 1},
            "curves": {m: {"eval": [[100, a], [200, b]]} for m, (a, b) in curves.items()},
            "comparison": {}}
  base = [run(0, {"bf16+adamw": (5.0, 4.0), "coat+coat_adamw": (9.0, 9.0)}),
          run(1, {"bf16+adamw": (6.0, 5.0)})]
  for r in base:
    r["comparison"] = loss_curves.compare(r["curves"])
  coat = run(1, {"coat+coat_adamw": (6.3, 5.1)})
  coat["comparison"] = loss_curves.compare(coat["curves"])
  files = {}
  for name, r in (("b0", base[0]), ("b1", base[1]), ("c1", coat),
                  ("c1_steps", dict(coat, args=dict(coat["args"], steps=1000))),
                  ("c2", dict(coat, args=dict(coat["args"], seed=2)))):
    files[name] = str(tmp_path / f"{name}.json")
    Path(files[name]).write_text(json.dumps(r))
  s = seeds.main([files["c1"], "--baseline", files["b0"], files["b1"]])
  assert s["seeds"][0]["bf16_final"] == 5.0 and s["seeds"][0]["final"] == 5.1  # seed 1's bf16
  assert s["seeds"][0]["final_gap"] == pytest.approx(0.02)
  assert s["gap_range"] == pytest.approx((0.02, 0.05))
  for bad in ("c1_steps", "c2"):   # another run length; a seed no baseline ran: exit status 2
    with pytest.raises(SystemExit) as e:
      seeds.main([files[bad], "--baseline", files["b0"], files["b1"]])
    assert e.value.code == 2


def test_stability_sweep_and_formats(tmp_path):
  out = stability.main([
      "--out", str(tmp_path), "--modes", "bf16+adamw", "--seeds", "0", "--lrs", "3e-3",
      "--steps", "4", "--seq-len", "16", "--batch", "4", "--sharpness-every", "2",
      "--hessian-iters", "0", "--formats", "int8", "--format-steps", "0", "--check-every", "2",
      "--set", "model.num_layers=1", "--set", "model.hidden_size=64",
      "--set", "model.intermediate_size=128", "--set", "data.eval_batches=1"])
  (run,) = out["runs"]
  assert len(run["losses"]) == 4 and all(math.isfinite(x) for x in run["losses"])
  assert run["diverged"] == (run["div_nonfinite"] or run["div_final_gt_initial"])
  assert math.isfinite(run["eval_loss"]) and "hessian_lmax" not in run
  assert [s[0] for s in run["sharpness"]] == [0, 2, 4]
  rows = out["formats"]["rows"]
  assert [(r["format"], r["expand"]) for r in rows] == [("int8", False), ("int8", True)]
  for r in rows:  # quantization errors only (--format-steps 0: no coat_adamw runs here)
    assert 0 < r["v_rel_mse_geomean"] < 1 and 0 <= r["v_flushed_frac"] <= 1
  assert rows[1]["v_rel_mse_geomean"] < rows[0]["v_rel_mse_geomean"]  # expansion helps
  for name in ("stability.json", "stability.md", "stability.png"):
    assert (tmp_path / name).stat().st_size > 100


def test_hessian_power_iteration_matches_dense_eigenvalue(rng):
  v = 5
  w0 = jnp.asarray(rng.standard_normal((v, v)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, v, (3, 7)), jnp.int32)

  class Parts:  # a bigram "model": logits = W[token]
    @staticmethod
    def merge(params, rest):
      return lambda t: params["w"][t]

  lam = float(stability.make_hessian_lmax(Parts, 300)({"w": w0}, {}, tokens, jax.random.key(0)))
  loss = lambda w: cross_entropy(w.reshape(v, v)[tokens[:, :-1]], tokens[:, 1:])
  eig = np.linalg.eigvalsh(np.asarray(jax.hessian(loss)(w0.reshape(-1)), np.float64))
  assert lam == pytest.approx(eig[np.argmax(np.abs(eig))], rel=1e-3)


def test_scripts_share_only_common_and_never_edit_sys_path():
  scripts = sorted((REPO / "benchmarks").rglob("*.py"))
  names = {p.stem for p in scripts}
  assert {"_common", "_moments", "_hlo", "bench_e2e", "stability", "accuracy"} <= names
  for p in scripts:
    text = p.read_text()
    assert "sys.path" not in text, f"{p.name} edits sys.path"
    imported = set(re.findall(r"^\s*from\s+benchmarks(?:\.\w+)*\.(\w+)\s+import", text, re.M))
    imported |= set(re.findall(r"^\s*(?:from|import)\s+(\w+)", text, re.M))
    siblings = {n for n in imported & names if not n.startswith("_")}   # shared: _common, ...
    assert not siblings, f"{p.name} imports the scripts {siblings}; move shared code to _common"
    private = set(re.findall(r"^\s*from\s+(\S+)\s+import\s+(_\w+)", text, re.M))
    assert not private, f"{p.name} imports private names {private}"


def test_common_timing_and_budget(rng):
  x = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
  f = jax.jit(lambda a: a @ a)
  assert 0 < common.median_ms(lambda: f(x), iters=3, warmup=1) < 10_000
  assert 0 < common.median_ms_back_to_back(f, x, iters=2, repeats=3) < 10_000
  chained = common.time_calls(lambda a: a + 1, lambda out: (x,) if out is None else (out,), steps=3,
                              warmup=1)
  assert 0 < chained < 10_000
  b = common.Budget(100.0, reserve=10.0)
  assert 89.0 < b.left() <= 90.0 and b.deadline() == pytest.approx(b.t0 + 90.0)
  assert common.Budget(None).left() == math.inf and common.Budget(None).deadline() is None
  assert common.Budget(0.0, reserve=0.0).left() <= 0
  assert 0 <= b.elapsed() < 5 and time.time() >= b.t0


def test_device_time_is_the_traced_kernels_per_call(monkeypatch):
  """device_ms_per_call: the traced kernels' microseconds summed, per call; on a CPU (no GPU
  kernel in the trace) a clear error, not a zero time."""
  f = jax.jit(lambda a: a + 1)
  x = jnp.ones((256,), jnp.float32)
  with pytest.raises(ValueError, match="no GPU kernel"):
    common.device_ms_per_call(f, x, iters=2)
  import collections
  monkeypatch.setattr(common, "kernel_times",
                      lambda trace: collections.Counter({"quantize": 240.0, "memset": 60.0}))
  assert common.device_ms_per_call(f, x, iters=3) == pytest.approx(0.1)
  from benchmarks.kernels import bench_kernels_mgpu as bench
  assert bench.timer(3, device_time=True)(lambda: f(x)) == pytest.approx(1e-4)


@pytest.mark.gpu
def test_gpu_device_time_of_a_copy_is_within_the_hbm_rate():
  """A 256 MB read + write by the device's own clock: positive, and no faster than the HBM
  datasheet rate allows (a profiler trace that missed work would read faster)."""
  f = jax.jit(lambda a: a + 1)
  x = jnp.ones((32 * 2**20,), jnp.float32)
  ms = common.device_ms_per_call(f, x, iters=5)
  assert 256e6 / 4.8e12 * 1e3 < ms < 10.0, ms


@pytest.mark.slow
def test_compile_breakdown_child():
  """benchmarks/step/compile_breakdown.py: one child in-process (tiny coat step, remat full)."""
  cb = _load("compile_breakdown")
  args = cb.parse_args(["--one", "coat:coat_adamw/remat=full", "--preset", "tiny",
                        "--seq-len", "16", "--batch", "8", "--set", "model.num_layers=1", "--set",
                        "model.hidden_size=64", "--set", "model.intermediate_size=128"])
  r = cb.measure_one(args)
  assert r["status"] == "ok", r.get("error")
  assert r["compile_s"] > 0 and r["lower_s"] > 0
  assert r["hlo"]["instructions"] > r["hlo"]["kernels"] > 0


def test_compile_breakdown_hlo_stats():
  """compile_breakdown's hlo_stats on optimized HLO text in XLA's format: top-level fusions and
  custom calls are kernels (a fused computation's body is not), custom calls by target, XLA's
  Triton fusions by kind."""
  from benchmarks.step._compile_log import hlo_stats
  fusion = ('  %{} = f32[4]{{0}} fusion(%{}), kind=kCustom, calls=%body, '
            'backend_config={{"fusion_backend_config":{{"kind":"{}"}}}}')
  text = "\n".join([
      "HloModule m", "", "%body (p: f32[4]) -> f32[4] {", "  %p = f32[4]{0} parameter(0)",
      "  ROOT %n = f32[4]{0} negate(%p)", "}", "", "ENTRY %main (x: f32[4]) -> f32[4] {",
      "  %x = f32[4]{0} parameter(0)", fusion.format("a", "x", "__triton_gemm"),
      fusion.format("b", "a", "__triton"), fusion.format("c", "b", "__triton"),
      '  ROOT %d = f32[4]{0} custom-call(%c), custom_call_target="mosaic_gpu_v2"', "}"])
  h = hlo_stats(text)
  assert (h["kernels"], h["fusions"], h["instructions"]) == (4, 3, 7)
  assert h["xla_triton_kinds"] == {"__triton_gemm": 1, "__triton": 2}
  assert h["custom_calls"] == {"mosaic": 1, "xla-triton fusions": 3}


def test_compile_breakdown_kernel_counts_and_pass_log():
  """benchmarks/step/compile_breakdown.py: the Pallas lowering counter on an interpreted Mosaic GPU
  kernel (same shape twice: one signature; another shape: a second one), XLA pass-log parsing
  (lines in XLA's format) and variant parsing."""
  cb = _load("compile_breakdown")
  from pallas_kernels.quantize import quantize_mgpu as qm
  kw = dict(group_size=16, out_dtype=jnp.float8_e4m3fn, fmax=448.0, floor=1e-10, interpret=True)
  f = lambda x, y: [qm.quantize_per_group(a, **kw)[0] for a in (x, 2 * x, y)]
  with cb.instrument() as st:
    jax.jit(f).lower(jax.ShapeDtypeStruct((64, 16), jnp.float32),
                     jax.ShapeDtypeStruct((128, 16), jnp.float32))
  assert st["pallas_lowerings"] >= 2 and len(st["kernels"]) == 2 and st["pallas_lower_s"] > 0

  from benchmarks.step._compile_log import PHASE_TAG, parse_log
  tid = "I1123 18:32:33.769186   28367 hlo_pass_pipeline.cc:{}] {}"
  lines = [PHASE_TAG + "lower", tid.format(206, "HLO pass: dce time: 9 s (9 s)"),
           tid.format(1, "a line of XLA's thread, cut by the tag: ") + PHASE_TAG + "compile",
           tid.format(302, "Running HLO pass pipeline on module jit_train_step: simplification"),
           tid.format(206, "HLO pass: algsimp time: 1.5 ms (1.5 ms) (cumulative: 2 ms)"),
           tid.format(206, "HLO pass: algsimp time: 2.5 s (2.5 s)"),
           tid.format(206, "HLO pass: simplification time: 3 s (3 s)"),
           tid.format(302, "Running HLO pass pipeline on module gemm_fusion_autotuning: p"),
           tid.format(206, "HLO pass: fusion time: 1.2 min (1.2 min)"),
           "I1123 18:32:34.000000   28367 gpu_compiler.cc:1] GpuCompiler::RunHloPasses for "
           "jit_train_step time: 40 s (cumulative: 40 s)"]
  log = parse_log(lines)
  assert log["passes"] == {"algsimp": pytest.approx(2.5015)}   # the lower phase's dce left out
  assert log["pipelines"] == {"simplification": 3.0}
  assert log["other_modules"] == {"gemm_fusion_autotuning": pytest.approx(72.0)}
  assert log["timers"] == {"GpuCompiler::RunHloPasses": 40.0}
  v = cb.parse_variant("coat:coat_adamw/kernels=gemm=reference/set=model.num_layers=1/prewarm")
  assert (v["kernels"], v["sets"], v["prewarm"]) == ("gemm=reference", ["model.num_layers=1"], True)
  with pytest.raises(ValueError, match="unknown option"):
    cb.parse_variant("coat:coat_adamw/bogus=1")
  with pytest.raises(ValueError, match="unknown option"):
    cb.parse_variant("coat:coat_adamw/prewarm=1")
  assert cb.parse_variant("coat:coat_adamw/warm_threads=0")["warm_threads"] == 0
  with pytest.raises(ValueError, match="whole number"):
    cb.parse_variant("coat:coat_adamw/warm_threads=two")


def test_dispatch_bench_table_and_fit(capsys, monkeypatch):
  """bench_dispatch on the CPU: a row per count, both columns timed, and the per-buffer fit."""
  dispatch = _load("bench_dispatch")
  monkeypatch.setattr(sys, "argv", ["bench_dispatch", "--counts", "4,32", "--steps", "3"])
  dispatch.main()
  out = capsys.readouterr().out
  rows = [l for l in out.splitlines() if re.match(r"\| (4|32) \|", l)]
  assert len(rows) == 2 and all(float(c) > 0 for r in rows for c in r.strip("| ").split(" | ")[2:])
  assert re.search(r"not donated: -?[\d.]+ us per buffer", out) and "donated:" in out


def test_e2e_state_counted_per_device_on_an_fsdp_mesh():
  """8 simulated devices: FSDP shards params, grads and the optimizer state, so the per-device
  budget is smaller than the data-parallel one (which holds everything on every device)."""
  base = ["--one", "bf16+adamw", "--preset", "tiny", "--set", "model.num_layers=1",
          "--set", "model.hidden_size=128", "--set", "model.intermediate_size=256",
          "--seq-len", "16", "--batch", "8", "--steps", "1", "--warmup", "1"]
  dp = e2e.measure_one(e2e.parse_args(base))
  fsdp = e2e.measure_one(e2e.parse_args(base + ["--set", "mesh.fsdp=-1"]))
  assert dp["status"] == fsdp["status"] == "ok", (dp.get("error"), fsdp.get("error"))
  assert fsdp["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1} and dp["mesh"]["data"] == 8
  for key in ("params", "grads", "optimizer_state"):
    assert 0 < fsdp["memory_budget"][key] < dp["memory_budget"][key] / 2, key
  assert fsdp["hlo_ops"].get("all-gather", 0) > 0 and "all-gather" not in dp["hlo_ops"]


def test_e2e_hlo_ops_and_device_env():
  text = """  %a = f32[4]{0} custom-call(f32[4]{0} %p), custom_call_target="mosaic_gpu_v2"
  %b = f32[4]{0} custom-call(f32[4]{0} %a), custom_call_target="mosaic_gpu_v2"
  %ag = (f32[4]{0}, f32[8]{0}) all-gather-start(f32[4]{0} %b), channel_id=1
  %ar = f32[8]{0} all-reduce(f32[8]{0} %q), to_apply=%add"""
  assert _load("_hlo").hlo_ops(text) == {"custom-call mosaic_gpu_v2": 2, "all-gather": 1,
                                          "all-reduce": 1}
  env = common.device_env(2, {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8"})
  assert env == {"CUDA_VISIBLE_DEVICES": "0,1",
                 "XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=2"}


def test_resume_across_meshes_reads_losses_and_checks_its_arguments(tmp_path, capsys):
  with pytest.raises(SystemExit):
    resume.parse_args(["--steps", "10", "--split", "10"])
  capsys.readouterr()
  rows = [{"step": 1, "split": "train", "loss_mean_steps": 1, "loss_last": 5.0},
          {"step": 2, "split": "train", "loss_mean_steps": 1, "loss_last": 4.5},
          {"step": 2, "split": "train", "loss_mean_steps": 2, "loss_last": 9.0},  # a window: skipped
          {"step": 2, "split": "eval", "loss": 4.75}]
  (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
  assert resume.losses(tmp_path) == ({1: 5.0, 2: 4.5}, 4.75)


def test_bench_layer_has_a_flag_for_every_linear_option():
  """bench_layer passes every linear ablation switch from its flags (a new switch without a
  flag broke its runs once); each flag's default is the library's choice."""
  from coat_jax.ops import linear_ablation
  layer = _load("bench_layer")
  args = layer.parse_args([])
  assert {k: getattr(args, k) for k in linear_ablation.CHOICES} == {
      k: v[0] for k, v in linear_ablation.CHOICES.items()}


def test_bench_loss_rows_and_the_accumulation_reading(capsys):
  """benchmarks/layer/bench_loss.py on CPU: a row per loss, all one value; the HLO reading of how the
  chunks' dW sums run tells a separate add from a GEMM that accumulates."""
  bench = _load("bench_loss")
  rows = bench.main(["--tokens", "96", "--hidden", "16", "--vocab", "40", "--chunks", "32,64",
                     "--iters", "1", "--untied"])
  assert [r["loss"] for r in rows] == ["logits", "fused 32", "fused 64"]
  assert all(math.isfinite(r["ms"]) and r["ms"] > 0 for r in rows)
  assert rows[1]["value"] == pytest.approx(rows[0]["value"], rel=1e-5)
  assert "fused 64" in capsys.readouterr().out
  added = "%loop_add_fusion.2 = f32[40,16]{1,0} fusion(%a, %b), kind=kLoop"
  gemm = "%custom-call.3 = f32[40,16]{1,0} custom-call(%x, %y, %acc), custom_call_target=\"__cublas$lt$matmul\""
  assert bench.accumulation(added, 40, 16) == "separate adds"
  assert bench.accumulation(gemm, 40, 16) == "in GEMM"
  with pytest.raises(SystemExit):
    bench.parse_args(["--chunks", "0"])


def test_attention_fp8_reference_and_its_error_off_the_gpu(rng, capsys):
  """benchmarks/kernels/bench_attention_fp8.py: its float32 reference is causal attention (jax.nn's, and
  its gradients) with dP = do v^T's causal amax; the FP8 operands round trip within FP8's step
  at the descales passed to cuDNN (o at max|v|, dq at its reference amax; the probe swaps o's and
  do's); on a CPU it stops with one line saying cuDNN needs a GPU."""
  bench = _load("bench_attention_fp8")
  q, k, v, do = (jnp.asarray(rng.normal(size=(2, 24, 2, 16)), jnp.bfloat16) for _ in range(4))
  o, grads, dp_amax = bench.reference(q, k, v, do, 0.25)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=0.25)
  o_jax, pullback = jax.vjp(attend, *f32[:3])
  np.testing.assert_allclose(o, o_jax, rtol=2e-5, atol=2e-6)
  for g, g_jax in zip(grads, pullback(f32[3])):
    assert bench.rel_l2(g, g_jax) < 1e-5 and bench.cosine(g, g_jax) > 0.99999
  dp = np.einsum("bqnh,bknh->bnqk", np.asarray(f32[3], np.float64), np.asarray(f32[2], np.float64))
  assert float(dp_amax) == pytest.approx(np.abs(np.tril(dp)).max(), rel=1e-5)
  ref_amax = (float(dp_amax), *(float(jnp.max(jnp.abs(g))) for g in grads))
  codes = bench.fp8_operands(q, k, v, do, ref_amax)
  params = codes[-1]
  for x, c, name in zip(f32, codes, ("q", "k", "v", "dO")):
    assert c.dtype == jnp.float8_e4m3fn
    descale = float(params[f"descale_{name}"].reshape(()))
    assert bench.rel_l2(c.astype(jnp.float32) * descale, x) < 0.04
  assert float(params["descale_o"].reshape(())) == pytest.approx(
      float(jnp.max(jnp.abs(f32[2]))) / 448.0, rel=1e-6)
  assert float(params["scale_dQ"].reshape(())) == pytest.approx(448.0 / ref_amax[1], rel=1e-6)
  swapped = bench.fp8_operands(q, k, v, do, ref_amax, swap_o_do=True)[-1]
  assert float(swapped["descale_o"].reshape(())) == float(params["descale_dO"].reshape(()))
  assert math.isnan(bench.rel_l2(np.full(3, np.nan), np.ones(3)))
  with pytest.raises(SystemExit):
    bench.main(["--shapes", "olmo-1b"])
  assert "needs a GPU" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    bench.main(["--shapes", "8x2048"])


def test_gemm_swiglu_bench_runs_every_path_and_prints_the_saving(capsys, monkeypatch):
  """bench_gemm_swiglu on the CPU (interpret mode, a small shape): every timed path runs once
  (the timer replaced by one call) and the table and saving line print; unknown shapes exit."""
  bench = _load("bench_gemm_swiglu")
  calls = []

  def once(fn, *args, iters=1):
    out = jax.block_until_ready(fn(*args))
    assert all(np.all(np.isfinite(np.asarray(a, np.float32))) for a in jax.tree.leaves(out))
    calls.append(fn)
    return 1.0 + len(calls)

  monkeypatch.setattr(bench, "median_ms_back_to_back", once)
  rows = bench.run_shape("small", 256, 128, 128, iters=1, interpret=True)
  assert [r[0] for r in rows] == ["fused s4", "fused s5", "unfused", "GEMMs", "weights: default",
                                  "weights: interleaved"] and len(calls) == 6
  assert "saved by the fused kernel: 2.000 ms per layer (50.0%)" in capsys.readouterr().out   # 4 - 2
  monkeypatch.setattr(sys, "argv", ["bench_gemm_swiglu", "--shapes", "olmo,9b"])
  with pytest.raises(SystemExit, match="unknown shape '9b'"):
    bench.main()


def test_remake_bench_runs_every_way_and_compares_codes(capsys, monkeypatch):
  """bench_remake on the CPU (a small shape, interpret mode): every way of remaking the codes
  runs (the timer replaced by one call), their codes agree with the unfused path's, and the
  floor's bytes are the fused pass's; unknown shapes exit."""
  bench = _load("bench_remake")
  def once(fn, *args, iters=1):
    jax.block_until_ready(fn(*args))
    return 1.0

  monkeypatch.setattr(bench, "median_ms_back_to_back", once)
  bench.run_shape("small", 128, 64, 128, iters=1, sweep=False)
  out = capsys.readouterr().out
  for kind in ("rmsnorm", "swiglu"):
    for how in ("fused", "kernel", "xla"):
      assert f"{kind} {how} " in out and f"{kind} {how}".ljust(34) in out
  assert out.count("1.0000") == 6, out
  assert bench.fused_bytes("swiglu", 128, 128) == 2 * (128 * 128 + 128 * 8 * 2) + 128 * 128
  monkeypatch.setattr(sys, "argv", ["bench_remake", "--shapes", "7b,9b"])
  with pytest.raises(SystemExit, match="unknown shape '9b'"):
    bench.main()
