"""The training library and train.py end to end on CPU: loss falls, exact resume, 8 devices = 1,
configs, signals. train.py itself runs as a script (subprocess), never imported."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from coat_jax.training import build as build_lib
from coat_jax.training import checkpoint as ckpt_lib
from coat_jax.training import mesh as sharding_lib
from coat_jax.training import schema as config_lib
from coat_jax.training.loop import run
from coat_jax.training.step_log import summary_line

REPO = Path(__file__).resolve().parents[1]

# A minuscule Llama on a 150 kB slice of the stdlib with a 512-token BPE: seconds per run.
MINI = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2", "model.num_heads=4",
    "model.num_kv_heads=2", "model.max_seq_len=32", "model.dtype=float32", "model.tie_embeddings=false",
    "data.vocab_size=512", "data.corpus_max_bytes=150000", "data.seq_len=32", "data.batch_size=8",
    "data.eval_batches=2", "optimizer.warmup=2", "optimizer.lr=1e-2", "run.progress=false",
    "run.log_every=5", "run.eval_every=0", "run.tensorboard=false", "run.plot=false",
    "mesh.data=1", "checkpoint.async_save=false", 'run.compile_cache=""',
]
QUIET = lambda _: None


def mini(cache, out_dir, *extra):
  return config_lib.load(REPO / "configs" / "tiny.yaml",
                         MINI + [f"data.cache_dir={cache}", f"run.out_dir={out_dir}", *extra])


def test_tiny_default_loss_falls_and_writes_outputs(cache, tmp_path):
  cfg = mini(cache, tmp_path, "run.steps=40", "run.eval_every=20", "run.tensorboard=true",
             "run.plot=true", "checkpoint.every=20")
  s = run(cfg, log=QUIET)
  assert s["step"] == 40 and not s["interrupted"]
  losses = [s["losses"][k] for k in sorted(s["losses"])]
  assert len(losses) == 40 and all(np.isfinite(losses))
  assert abs(losses[0] - np.log(512)) < 0.5  # starts near uniform
  assert np.mean(losses[-5:]) < losses[0] - 0.6, losses
  assert s["final_eval_loss"] < losses[0] - 0.6
  assert set(s["eval_losses"]) == {20, 40}
  assert s["tokens_per_s"] > 0 and s["mfu"] is None  # no MFU on CPU
  assert s["peak_memory_bytes"] > 0
  records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if r["split"] == "train"] == [1] + list(range(5, 41, 5))
  assert [r["step"] for r in records if r["split"] == "eval"] == [20, 40]
  assert (tmp_path / "loss.png").stat().st_size > 1000
  assert list((tmp_path / "tb").iterdir())
  assert json.loads((tmp_path / "summary.json").read_text())["step"] == 40
  assert config_lib.load(tmp_path / "config.yaml") == cfg
  assert ckpt_lib.Checkpointer(tmp_path / "checkpoints", 0, 3, False).all_steps() == [20, 40]
  assert "train loss" in summary_line(s) and "tokens/s" in summary_line(s)
  # the first step (trace, compile, run) timed apart, and it is part of the run's wall time
  assert 0 < s["first_step_s"] < s["wall_s"] and "first step" in summary_line(s)
  # a stop by a signal suggests --resume only with steps left and a checkpoint to resume from
  hint = lambda **kw: "continue with --resume" in summary_line({**s, "interrupted": "SIGTERM",
                                                               **kw})
  assert hint(step=20) and not hint(step=40) and not hint(step=20, checkpoint_dir=None)
  assert "stopped by SIGTERM" in summary_line({**s, "interrupted": "SIGTERM"})
  # the host memory the run held, for a save or compile that needs too much of it: more than
  # the training state this process holds on CPU
  assert s["host_max_rss_bytes"] > s["num_params"] * 4


def test_checkpoints_disabled_writes_none(cache, tmp_path):
  lines = []
  s = run(mini(cache, tmp_path, "run.steps=4", "checkpoint.every=2", "checkpoint.enabled=false",
               "run.log_every=1"), log=lines.append)
  assert s["step"] == 4 and np.isfinite(s["train_loss_last"])
  # the step log (progress bar off): no rate before one is timed, then a positive one
  steps = [l for l in lines if l.startswith("[step ")]
  assert len(steps) == 4 and "tok/s n/a" in steps[0], steps
  assert all(float(l.split("tok/s ")[1].split()[0].replace(",", "")) > 0 for l in steps[1:]), steps
  assert ckpt_lib.Checkpointer(tmp_path / "checkpoints", 0, 3, False).all_steps() == []
  assert any("writes no checkpoint" in l for l in lines)
  assert s["checkpoint_dir"] is None   # nothing to resume from (the summary suggests no --resume)


@pytest.mark.parametrize("optimizer,precision", [  # CI time: bf16 runs with --slow
    pytest.param("adamw", "bf16", marks=pytest.mark.slow), ("coat_adamw", "coat")])
def test_resume_is_exact(cache, tmp_path, optimizer, precision):
  extra = [f"optimizer.name={optimizer}", f"precision={precision}", "run.steps=20",
           "optimizer.min_quantized_size=256", "optimizer.group_size=32",
           "checkpoint.every=0", "run.eval_every=10"]
  straight = run(mini(cache, tmp_path / "a", *extra), log=QUIET)
  first = run(mini(cache, tmp_path / "b", *extra), stop_after=10, log=QUIET)
  assert first["step"] == 10 and sorted(first["losses"]) == list(range(1, 11))
  # A save killed half-way leaves a temporary directory: it must be ignored, not restored.
  partial = tmp_path / "b" / "checkpoints" / "15.orbax-checkpoint-tmp-1700000000"
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "junk").write_bytes(os.urandom(64))
  second = run(mini(cache, tmp_path / "b", *extra), resume=True, log=QUIET)
  assert sorted(second["losses"]) == list(range(11, 21))
  resumed = {**first["losses"], **second["losses"]}
  assert resumed == straight["losses"]  # bit-exact, every step
  assert second["final_eval_loss"] == straight["final_eval_loss"]
  assert not partial.exists()
  # The metrics log of the resumed run reads like the straight one.
  steps = lambda d: [json.loads(l)["step"] for l in (d / "metrics.jsonl").read_text().splitlines()]
  assert steps(tmp_path / "b") == steps(tmp_path / "a")


def test_eight_devices_match_one(cache, tmp_path):
  assert len(jax.devices()) >= 8
  extra = ["run.steps=4", "run.log_every=1"]
  one = run(mini(cache, tmp_path / "one", *extra), devices=jax.devices()[:1], log=QUIET)
  cfg8 = mini(cache, tmp_path / "eight", *extra, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
  eight = run(cfg8, log=QUIET)
  a = np.array([one["losses"][k] for k in sorted(one["losses"])])
  b = np.array([eight["losses"][k] for k in sorted(eight["losses"])])
  assert len(a) == 4 and not np.array_equal(a[0], a[-1])
  np.testing.assert_allclose(b, a, rtol=1e-4)
  np.testing.assert_allclose(eight["final_eval_loss"], one["final_eval_loss"], rtol=1e-4)


def test_fused_loss_trains_as_the_logits_loss_on_a_mesh(cache, tmp_path):
  """model.loss_impl=fused (ops.lm_head_loss) on an 8-device mesh (batch split 4 ways, so "auto"
  would take the logits path there) gives the logits path's losses and evaluation."""
  extra = ["run.steps=3", "run.log_every=1", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
  out = {impl: run(mini(cache, tmp_path / impl, *extra, f"model.loss_impl={impl}",
                        "model.loss_chunk_tokens=40"), log=QUIET) for impl in ("fused", "logits")}
  a, b = (np.array([out[i]["losses"][k] for k in sorted(out[i]["losses"])]) for i in ("fused", "logits"))
  assert len(a) == 3 and np.isfinite(a).all() and not np.array_equal(a[0], a[-1])
  np.testing.assert_allclose(a, b, rtol=1e-5)
  np.testing.assert_allclose(out["fused"]["final_eval_loss"], out["logits"]["final_eval_loss"], rtol=1e-5)


@pytest.mark.parametrize("name,clip", [("coat_adamw", 0.05), ("coat_adamw", 0.0), ("adamw", 0.05)])
def test_build_apply_equals_update_then_apply_updates(rng, name, clip):
  """build.py's fused step (coat_adamw_apply for coat_adamw) gives tx.update + apply_updates:
  same state structure, params within float32 rounding of the step, over 4 steps with clipping."""
  opt = config_lib.OptimizerConfig(name=name, lr=1e-2, warmup=1, clip=clip, min_quantized_size=256)
  tx, schedule = build_lib.build_optimizer(opt, total_steps=10)
  apply = jax.jit(build_lib.build_apply(opt, tx, schedule))

  @jax.jit
  def reference(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return jax.tree.map(lambda p, u: p + u, params, updates), state

  params = {"w": jnp.asarray(rng.standard_normal((8, 256)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal((5,)), jnp.float32)}
  state = tx.init(params)
  for i in range(4):   # the warmup schedule's lr is 0 at the first step
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
    got_p, got_s = apply(grads, state, params)
    want_p, want_s = reference(grads, state, params)
    assert jax.tree.structure(got_s) == jax.tree.structure(want_s)
    for g, w, p in zip(jax.tree.leaves(got_p), jax.tree.leaves(want_p), jax.tree.leaves(params)):
      step = np.asarray(w) - np.asarray(p)
      assert i == 0 or np.abs(step).max() > 1e-4    # the params moved
      np.testing.assert_allclose(np.asarray(g) - np.asarray(p), step, rtol=1e-4,
                                 atol=1e-5 * np.abs(step).max())
    params, state = want_p, want_s


def test_compile_cache_setting(tmp_path):
  """run.compile_cache points JAX's persistent cache at the directory (made if missing), caching
  programs of any compile time; "" is off. A small program (under a second) lands there."""
  code = ("import sys, jax; from coat_jax.training.compile_cache import use_compile_cache; "
          "use_compile_cache(sys.argv[1], print); "
          "print('DIR', jax.config.jax_compilation_cache_dir); "
          "print('MIN', jax.config.jax_persistent_cache_min_compile_time_secs); "
          "jax.jit(lambda x: x * 3 + 1)(jax.numpy.ones(5)).block_until_ready()")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  for arg, want, min_s in ((str(tmp_path / "xla"), str(tmp_path / "xla"), "0"), ("", "None", "1")):
    out = subprocess.run([sys.executable, "-c", code, arg], cwd=REPO, env=env, check=True,
                         capture_output=True, text=True).stdout
    assert f"DIR {want}" in out and f"MIN {min_s}" in out, out
  assert [p for p in (tmp_path / "xla").iterdir() if "jit__lambda" in p.name], "not cached"


def test_param_sharding_rules():
  mesh = sharding_lib.make_mesh(config_lib.MeshConfig(data=2, fsdp=2, tensor=2))
  params = {"embed": {"embedding": jax.ShapeDtypeStruct((512, 32), jnp.float32)},
            "lm_head": {"kernel": jax.ShapeDtypeStruct((32, 512), jnp.float32)},
            "layers": {0: {"self_attn": {"q_proj": {"kernel": jax.ShapeDtypeStruct((32, 32), jnp.float32)},
                                         "o_proj": {"kernel": jax.ShapeDtypeStruct((32, 32), jnp.float32)},
                                         "k_proj": {"kernel": jax.ShapeDtypeStruct((32, 3), jnp.float32)}},
                           "mlp": {"down_proj": {"kernel": jax.ShapeDtypeStruct((64, 32), jnp.float32)}},
                           "input_layernorm": {"scale": jax.ShapeDtypeStruct((32,), jnp.float32)}}}}
  sh = sharding_lib.param_shardings(params, mesh)
  layer = sh["layers"][0]
  assert sh["embed"]["embedding"].spec == P("tensor", "fsdp")
  assert sh["lm_head"]["kernel"].spec == P("fsdp", "tensor")
  assert layer["self_attn"]["q_proj"]["kernel"].spec == P("fsdp", "tensor")
  assert layer["self_attn"]["o_proj"]["kernel"].spec == P("tensor", "fsdp")
  assert layer["self_attn"]["k_proj"]["kernel"].spec == P("fsdp")  # 3 % 2: replicated
  assert layer["mlp"]["down_proj"]["kernel"].spec == P("tensor", "fsdp")
  assert layer["input_layernorm"]["scale"].spec == P()
  assert sharding_lib.batch_sharding(mesh).spec == P(("data", "fsdp"), None)
  with pytest.raises(ValueError, match="needs 16 devices"):
    sharding_lib.make_mesh(config_lib.MeshConfig(data=4, fsdp=2, tensor=2))
  with pytest.raises(ValueError, match="do not divide"):
    sharding_lib.make_mesh(config_lib.MeshConfig(data=-1, fsdp=3, tensor=1))


def test_checkpoint_round_trips_fp8_sharded_state_exactly(tmp_path, rng):
  mesh = sharding_lib.make_mesh(config_lib.MeshConfig(data=1, fsdp=4, tensor=2))
  sh = NamedSharding(mesh, P("fsdp", "tensor"))
  host = {"m": rng.normal(size=(8, 16)) * 100, "v": rng.normal(size=(8, 16)) * 1e-3}
  state = {"params": {"w": jax.device_put(jnp.asarray(rng.normal(size=(8, 16)), jnp.float32), sh)},
           "opt": {"m": jax.device_put(jnp.asarray(host["m"]).astype(jnp.float8_e4m3fn), sh),
                   "v": jax.device_put(jnp.asarray(host["v"]).astype(jnp.float8_e5m2), sh),
                   "scale": jnp.asarray(rng.uniform(size=(8,)), jnp.bfloat16),
                   "count": jnp.asarray(7, jnp.int32)},
           "key": jax.random.key(int(rng.integers(0, 2**31)))}
  ck = ckpt_lib.Checkpointer(tmp_path, every=5, keep=2, async_save=True)
  assert not ck.save(3, state, {"step": 3})  # not due
  assert ck.save(5, state, {"step": 5, "note": "x"})
  ck.wait()
  template = jax.tree.map(jnp.zeros_like, state)
  restored, meta, step = ck.restore(template)
  assert step == 5 and meta == {"step": 5, "note": "x"}
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.atleast_1d(np.asarray(a)).view(np.uint8),
                                  np.atleast_1d(np.asarray(b)).view(np.uint8))
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
  bad = dict(template, params={"w": jnp.zeros((8, 15), jnp.float32)})
  with pytest.raises(ValueError, match="params.w has shape"):
    ck.restore(bad)
  ck.close()


def test_missing_and_out_of_vocab_data_files_give_clear_errors(cache, tmp_path):
  missing = tmp_path / "shard-0.bin"
  with pytest.raises(ValueError, match=f"data file not found: {missing}"):
    run(mini(cache, tmp_path, "data.kind=tokens", f"data.paths=[{missing}]"), log=QUIET)
  oov = tmp_path / "oov.bin"
  np.full(4096, 600, np.uint16).tofile(oov)
  with pytest.raises(ValueError, match="oov.bin is out of range for the model's vocab_size=512"):
    run(mini(cache, tmp_path, "data.kind=tokens", f"data.paths=[{oov}]", "model.vocab_size=512"),
              log=QUIET)


def test_sigint_mid_run_leaves_a_checkpoint_to_resume(cache, tmp_path):
  run(mini(cache, tmp_path / "warm", "run.steps=1"), log=QUIET)  # tokenizer cached already
  out = tmp_path / "sig"
  args = [sys.executable, str(REPO / "train.py"), "--no-progress", "--steps", "100000"]
  for item in MINI + [f"data.cache_dir={cache}", f"run.out_dir={out}", "run.log_every=1"]:
    args += ["--set", item]
  env = dict(os.environ, XLA_FLAGS="", PYTHONUNBUFFERED="1")
  proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  try:
    deadline = time.time() + 120
    metrics = out / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
      if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
        break
      time.sleep(0.2)
    assert proc.poll() is None, proc.stdout.read()
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 128 + signal.SIGINT == 130, output
  assert "stopped by SIGINT" in output
  done = json.loads((out / "summary.json").read_text())
  assert done["interrupted"] == "SIGINT" and 3 <= done["step"] < 100000
  assert ckpt_lib.Checkpointer(out / "checkpoints", 0, 3, False).latest_step() == done["step"]
  resumed = run(mini(cache, out, f"run.steps={done['step'] + 2}"), resume=True, log=QUIET,
                allow_steps_change=True)
  assert sorted(resumed["losses"]) == [done["step"] + 1, done["step"] + 2]
  assert np.isfinite(resumed["train_loss_last"])


def test_run_log_names_a_resized_preset():
  """The run log's model name: the preset as shipped, or with the shape the config gave it."""
  from coat_jax.training.loop import _model_name
  named = {}
  for name in ("llama2-13b", "llama-20b"):
    cfg = config_lib.load(REPO / "configs" / f"{name}.yaml",
                          ["data.kind=stdlib", "data.paths=[]", "model.remat=full"])
    named[name] = _model_name(cfg, build_lib.model_config(cfg, 32000))
  assert named["llama2-13b"] == "llama2-13b"
  assert named["llama-20b"] == "llama2-13b resized to 6144 x 48 layers, MLP 16384, 48 heads"
