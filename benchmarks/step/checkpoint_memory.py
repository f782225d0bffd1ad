"""Host memory of a checkpoint save: the process's resident memory while `Checkpointer` writes a
state held on the device, copied whole and streamed.

The state is a coat run's kind of state (bfloat16 leaves for the weights, float8_e4m3fn leaves for
the moments, in equal bytes) of `--gb` GB in `--leaves` arrays on the default device. Each mode
writes it once into a fresh directory under `--dir` (removed afterwards) and a thread samples
/proc/self/statm every 2 ms:
  whole: the state copied to host memory at once (what a state under a quarter of the available
    host memory gets; the save is asynchronous, the time includes waiting for it);
  streamed: the copy and the write in batches of the largest array (what a larger state gets).
The save's finiteness check is compiled before (once per run, as at a run's first save). The
table gives the state, the batch, the resident memory before the save and the most the save
added, that over the state, the save's seconds and the checkpoint's bytes on disk. On the CPU
the device's arrays are host memory already (the copy to the host shares it), so both modes add
little there; the comparison is for a GPU.

  python -m benchmarks.step.checkpoint_memory --gb 8
  JAX_PLATFORMS=cpu python -m benchmarks.step.checkpoint_memory --gb 0.25 --leaves 8   # smoke
"""
from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp

from coat_jax.training import storage
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
    state[f"leaf{i:03d}"] = jax.random.normal(jax.random.fold_in(key, i), (n,), jnp.float32
                                              ).astype(dtype)
    jax.block_until_ready(state[f"leaf{i:03d}"])
  return state


def disk_bytes(path: Path) -> int:
  return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(state: dict, mode: str, root: Path) -> dict:
  """One save of `state` in `mode` into a fresh directory under `root` (removed after)."""
  total = storage.state_bytes(state)
  # whole: the host looks large enough; streamed: the state looks larger than a quarter of it.
  available = 100 * total if mode == "whole" else total
  directory = Path(tempfile.mkdtemp(prefix=f"ckpt_{mode}_", dir=root))
  try:
    with mock.patch.object(storage, "host_available_bytes", lambda: available):
      ck = Checkpointer(directory, every=0, keep=1, async_save=True, state_template=state)
    check_finite(flatten_state(state), "warm-up")  # compiled once per run, as a run's first save
    before, peak, seconds = peak_resident_while(
        lambda: (ck.save(1, state, {"step": 1}, force=True), ck.wait()))
    ck.close()
    return dict(mode=mode, state=total, batch=ck.stream_bytes, before=before,
                extra=max(0, peak - before), seconds=seconds, disk=disk_bytes(directory))
  finally:
    shutil.rmtree(directory, ignore_errors=True)


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--gb", type=float, default=8.0, help="state size in GB (default 8)")
  p.add_argument("--leaves", type=int, default=32, help="arrays in the state (default 32)")
  p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated of {MODES}")
  p.add_argument("--dir", default=tempfile.gettempdir(),
                 help="where each save's own temporary directory is made (default: the system's)")
  args = p.parse_args(argv)
  modes = [m for m in args.modes.split(",") if m]
  bad = [m for m in modes if m not in MODES]
  if bad or args.gb <= 0 or args.leaves < 1:
    p.error(f"--modes takes {MODES}, --gb > 0, --leaves >= 1 (got {args.modes}, {args.gb}, "
            f"{args.leaves})")
  from importlib.metadata import version
  print(f"device {jax.devices()[0].device_kind}; orbax-checkpoint {version('orbax-checkpoint')}, "
        f"tensorstore {version('tensorstore')}; seed {SEED}; host memory available "
        f"{(storage.host_available_bytes() or 0) / 2**30:.1f} GiB")
  state = make_state(args.gb, args.leaves)
  rows = [measure(state, mode, Path(args.dir)) for mode in modes]
  gib = lambda n: f"{n / 2**30:.2f}" if n is not None else "-"
  print("| save | state GiB | batch GiB | resident before GiB | added GiB | added / state | "
        "seconds | on disk GiB |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['mode']} | {gib(r['state'])} | {gib(r['batch'])} | {gib(r['before'])} | "
          f"{gib(r['extra'])} | {r['extra'] / r['state']:.2f} | {r['seconds']:.1f} | "
          f"{gib(r['disk'])} |")
  return rows


if __name__ == "__main__":
  main()
