"""Host memory of a checkpoint save: the process's resident memory while `Checkpointer` writes a
state held on the device, copied whole and streamed.

The state is a coat run's kind of state (bfloat16 leaves for the weights, float8_e4m3fn leaves for
the moments, in equal bytes) of `--gb` GB in `--leaves` arrays on the default device. Each mode
runs in a fresh process (a save's host buffers, pinned or not, may stay with the process after
it: a second save in the same process would start from them) and writes the state once into a
fresh directory under `--dir` (removed afterwards) while a thread samples /proc/self/statm every
2 ms:
  whole: the state copied to host memory at once (what a state under a quarter of the available
    host memory gets; the save is asynchronous, the time includes waiting for it);
  streamed: the copy and the write in batches (what a larger state gets), of the size the run
    would choose from this host's available memory (`storage.stream_bytes`);
  streamed/N: the same in batches of 1/N of the available host memory (at least the largest
    array), to measure how a save's host memory grows with its batch;
  a streamed mode with ':pinned' or ':unpinned': its device-to-host copies into pinned host
    memory or into ordinary host memory (default: orbax's choice, pinned on a GPU).
`--config` saves the state a run of that config checkpoints (its arrays' shapes and dtypes, random
values) instead.
The save's finiteness check is compiled before (once per run, as at a run's first save). The
table gives the state, the batch, the resident memory before the save, the most the save added,
that over the state and over the batch, what stayed resident after it, the save's seconds and
the checkpoint's bytes on disk. On the CPU the device's arrays are host memory already (the copy
to the host shares it), so every mode adds little there; the comparison is for a GPU.

  python -m benchmarks.step.checkpoint_memory --gb 8 --modes whole,streamed,streamed/32
  python -m benchmarks.step.checkpoint_memory --config configs/llama2-13b.yaml --modes streamed
  JAX_PLATFORMS=cpu python -m benchmarks.step.checkpoint_memory --gb 0.25 --leaves 8   # smoke
"""
from __future__ import annotations

import argparse
import contextlib
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp

from coat_jax.training import checkpoint, storage
from coat_jax.training.checkpoint import Checkpointer, flatten_state
from coat_jax.training.divergence import check_finite

MODES = ("whole", "streamed")


def resident_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * resource.getpagesize()


SEED = 20261128


def peak_resident_while(fn) -> tuple[int, int, float]:
  """Runs `fn` while a thread samples the resident memory every 2 ms: (resident before, the most
  seen, seconds)."""
  peak, done = [0], threading.Event()

  def sample():
    while not done.is_set():
      peak[0] = max(peak[0], resident_bytes())
      time.sleep(0.002)

  before = resident_bytes()
  sampler = threading.Thread(target=sample, daemon=True)
  sampler.start()
  t0 = time.perf_counter()
  try:
    fn()
  finally:
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
  return before, max(peak[0], resident_bytes()), seconds


def make_state(gb: float, leaves: int) -> dict:
  """`leaves` arrays of about gb / leaves GB each on the default device, half bfloat16 and half
  float8_e4m3fn by bytes, normal values (seed SEED: incompressible as trained weights are)."""
  per_leaf = int(gb * 1e9 / leaves)
  state, key = {}, jax.random.key(SEED)
  for i in range(leaves):
    dtype = jnp.bfloat16 if i % 2 == 0 else jnp.float8_e4m3fn
    n = per_leaf // jnp.dtype(dtype).itemsize
    state[f"leaf{i:03d}"] = jax.block_until_ready(
        random_leaf(jax.random.fold_in(key, i), (n,), dtype))
  return state


def random_leaf(key, shape, dtype) -> jax.Array:
  """Normal values (floats) or random bits (integers) of `shape` and `dtype` on the device."""
  if jnp.issubdtype(dtype, jnp.floating):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)
  return jax.random.bits(key, shape, jnp.uint32).astype(dtype)


def make_state_like(config: str, vocab_size: int | None = None) -> dict:
  """Random arrays of the shapes and dtypes a run of `config` checkpoints (its params, optimizer
  state and the rest, flattened as `Checkpointer` stores them; remat and microbatches do not
  change them; the vocabulary is the config's model's unless `vocab_size`), made one at a time on
  the default device (seed SEED)."""
  from coat_jax.training import mesh as mesh_lib, schema
  from coat_jax.training.build import build
  cfg = schema.load(config, ["model.remat=full", "optimizer.accumulate=1"])
  built = build(cfg, mesh_lib.make_mesh(cfg.mesh), vocab_size=vocab_size)
  abstract = flatten_state(jax.tree.map(checkpoint._abstract, built.abstract_state()))
  key, state = jax.random.key(SEED), {}
  for i, (name, a) in enumerate(abstract.items()):
    state[name] = jax.block_until_ready(random_leaf(jax.random.fold_in(key, i), a.shape, a.dtype))
  return state


def disk_bytes(path: Path) -> int:
  return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def parse_mode(mode: str) -> tuple[str, int | None, bool | None]:
  """'whole' | 'streamed' | 'streamed/N', optionally ':pinned' or ':unpinned' (the device-to-host
  copies into pinned host memory or not; default orbax's choice) -> (kind, N or None, pinned or
  None); ValueError for anything else."""
  head, _, host = mode.partition(":")
  kind, _, n = head.partition("/")
  if (kind in MODES and host in ("", "pinned", "unpinned")
      and (not n or (kind == "streamed" and n.isdigit() and int(n) >= 1))):
    return kind, int(n) if n else None, {"": None, "pinned": True, "unpinned": False}[host]
  raise ValueError(mode)


def measure(state: dict, mode: str, root: Path) -> dict:
  """One save of `state` in `mode` into a fresh directory under `root` (removed after)."""
  kind, parts, pinned = parse_mode(mode)
  total = storage.state_bytes(state)
  patches = [mock.patch.object(storage, "STREAM_FRACTION", 1e9 if kind == "whole" else 0.0),
             mock.patch.object(storage, "STREAM_PINNED_HOST", pinned)]
  if parts:
    patches.append(mock.patch.object(storage, "BATCH_FRACTION", 1 / parts))
  directory = Path(tempfile.mkdtemp(prefix=f"ckpt_{kind}_", dir=root))
  try:
    with contextlib.ExitStack() as stack:
      for patch in patches:
        stack.enter_context(patch)
      ck = Checkpointer(directory, every=0, keep=1, async_save=True, state_template=state)
    check_finite(flatten_state(state), "warm-up")  # compiled once per run, as a run's first save
    before, peak, seconds = peak_resident_while(
        lambda: (ck.save(1, state, {"step": 1}, force=True), ck.wait()))
    ck.close()
    return dict(mode=mode, state=total, batch=ck.stream_bytes, before=before,
                extra=max(0, peak - before), after=resident_bytes() - before, seconds=seconds,
                disk=disk_bytes(directory))
  finally:
    shutil.rmtree(directory, ignore_errors=True)


def measure_in_new_process(args, mode: str) -> dict:
  """`measure` in a fresh Python process (its own state), its row read back as JSON."""
  cmd = [sys.executable, "-m", "benchmarks.step.checkpoint_memory", "--gb", str(args.gb),
         "--leaves", str(args.leaves), "--modes", mode, "--dir", args.dir, "--row-json"]
  if args.config:
    cmd += ["--config", args.config]
  done = subprocess.run(cmd, capture_output=True, text=True)
  if done.returncode != 0:
    last = (done.stderr.strip().splitlines() or [""])[-1]
    raise SystemExit(f"checkpoint_memory: mode {mode} failed (exit {done.returncode}): {last}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def make(args) -> dict:
  return make_state_like(args.config) if args.config else make_state(args.gb, args.leaves)


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--gb", type=float, default=8.0, help="state size in GB (default 8)")
  p.add_argument("--leaves", type=int, default=32, help="arrays in the state (default 32)")
  p.add_argument("--config", default=None,
                 help="the state a run of this config checkpoints (its shapes and dtypes, random "
                      "values) instead of --gb in --leaves arrays")
  p.add_argument("--modes", default=",".join(MODES),
                 help="comma-separated of whole, streamed, streamed/N, each streamed one "
                      "optionally with :pinned or :unpinned (default whole,streamed)")
  p.add_argument("--dir", default=tempfile.gettempdir(),
                 help="where each save's own temporary directory is made (default: the system's)")
  p.add_argument("--same-process", action="store_true",
                 help="every mode in this process, one state (a smoke test's speed; each mode "
                      "then starts from what the previous left resident)")
  p.add_argument("--row-json", action="store_true", help=argparse.SUPPRESS)  # one mode's child
  args = p.parse_args(argv)
  modes = [m for m in args.modes.split(",") if m]
  bad = []
  for m in modes:
    try:
      parse_mode(m)
    except ValueError:
      bad.append(m)
  if bad or not modes or args.gb <= 0 or args.leaves < 1:
    p.error(f"--modes takes whole, streamed, streamed/N (N >= 1), a streamed one with :pinned or "
            f":unpinned; --gb > 0, --leaves >= 1 "
            f"(got {args.modes}, {args.gb}, {args.leaves})")
  if args.row_json:
    row = measure(make(args), modes[0], Path(args.dir))
    print(json.dumps(row))
    return [row]
  from importlib.metadata import version
  what = (f"the checkpoint of {args.config}" if args.config
          else f"{args.gb} GB in {args.leaves} arrays")
  print(f"device {jax.devices()[0].device_kind}; orbax-checkpoint {version('orbax-checkpoint')}, "
        f"tensorstore {version('tensorstore')}; seed {SEED}; host memory available "
        f"{(storage.host_available_bytes() or 0) / 2**30:.1f} GiB; "
        f"{'one process' if args.same_process else 'a fresh process per mode'}; state: {what}")
  if args.same_process:
    state = make(args)
    rows = [measure(state, mode, Path(args.dir)) for mode in modes]
  else:
    rows = [measure_in_new_process(args, mode) for mode in modes]
  gib = lambda n: f"{n / 2**30:.2f}" if n is not None else "-"
  print("| save | state GiB | batch GiB | resident before GiB | added GiB | added / state | "
        "added / batch | kept after GiB | seconds | on disk GiB |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    per_batch = f"{r['extra'] / r['batch']:.2f}" if r["batch"] else "-"
    print(f"| {r['mode']} | {gib(r['state'])} | {gib(r['batch'])} | {gib(r['before'])} | "
          f"{gib(r['extra'])} | {r['extra'] / r['state']:.2f} | {per_batch} | "
          f"{gib(max(0, r['after']))} | {r['seconds']:.1f} | {gib(r['disk'])} |")
  return rows


if __name__ == "__main__":
  main()
