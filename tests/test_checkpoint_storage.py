"""Checkpoints on an ordinary host (coat_jax/training/storage.py): a state larger than a quarter of
the available host memory is saved in batches, each copied to the host and written before the
next (the copies counted; the process's resident memory measured while saving float32 leaves), a
save that does not fit the free disk space is refused, and a write that fails on the disk
(RLIMIT_FSIZE) removes its partial directory; both raise StorageError in one line and leave the
previous checkpoint restorable."""
import resource

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.step import checkpoint_memory
from coat_jax.training import storage
from coat_jax.training.checkpoint import Checkpointer
from coat_jax.errors import StorageError


def make_state(leaves: int, elements: int, offset: float = 1.0) -> dict:
  """Distinct non-zero float32 leaves (no RNG needed: every element is its index + offset)."""
  base = jnp.arange(elements, dtype=jnp.float32) + offset
  return {f"w{i}": base * (i + 2) for i in range(leaves)}


def same(a: dict, b: dict) -> bool:
  return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def test_a_state_larger_than_a_quarter_of_the_host_memory_streams(tmp_path, monkeypatch):
  state = jax.block_until_ready(make_state(8, 8 << 20))  # 8 leaves x 32 MiB = 256 MiB
  total = storage.state_bytes(state)
  # The host has as much memory available as the state: more than a quarter of it, so it streams.
  monkeypatch.setattr(storage, "host_available_bytes", lambda: total)
  ck = Checkpointer(tmp_path, every=0, keep=2, async_save=True, state_template=state)
  assert ck.stream_bytes == storage.largest_leaf_bytes(state) + 1   # one array at a time
  from orbax.checkpoint._src.serialization import replica_slices
  copied, to_host = [], replica_slices.transfer_arrays_to_host

  def counting(arrays, *args, **kwargs):  # each device-to-host copy's arrays
    copied.append(len(arrays))
    return to_host(arrays, *args, **kwargs)

  monkeypatch.setattr(replica_slices, "transfer_arrays_to_host", counting)
  before, peak, _ = checkpoint_memory.peak_resident_while(
      lambda: ck.save(1, state, {"step": 1}, force=True))
  assert copied == [1] * len(state), copied   # one array at a time, not all before any write
  extra = peak - before
  # On the CPU the copies share the device's memory; what the save adds stays well under the state.
  assert extra < total / 2, f"{extra / 2**20:.0f} MiB held while saving {total / 2**20:.0f} MiB"
  restored, meta, step = ck.restore(state)
  ck.close()
  assert step == 1 and meta == {"step": 1} and same(restored, state)


def test_a_streamed_save_of_a_sharded_state_restores_to_another_mesh(tmp_path, monkeypatch):
  """Streamed (batches of one array), a state sharded over 8 devices (FSDP-like rows, and a
  replicated leaf) restores bit for bit onto a 2-device layout and onto one device."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh8 = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
  base = make_state(3, 1 << 16)
  state = {k: v.reshape(256, 256) for k, v in base.items()}
  state["w0"] = jax.device_put(state["w0"], NamedSharding(mesh8, P("fsdp", None)))
  state["w1"] = jax.device_put(state["w1"].astype(jnp.bfloat16), NamedSharding(mesh8, P(None, "fsdp")))
  state["w2"] = jax.device_put(state["w2"], NamedSharding(mesh8, P()))   # replicated
  monkeypatch.setattr(storage, "host_available_bytes", lambda: storage.state_bytes(state))
  ck = Checkpointer(tmp_path, every=0, keep=1, async_save=True, state_template=state)
  assert ck.stream_bytes is not None
  assert ck.save(1, state, {"step": 1}, force=True)
  ck.close()
  mesh2 = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
  for target in (NamedSharding(mesh2, P("fsdp", None)),
                 jax.sharding.SingleDeviceSharding(jax.devices()[0])):
    template = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=target) for k, v in state.items()}
    ck = Checkpointer(tmp_path, every=0, keep=1, async_save=True)
    restored, _, step = ck.restore(template)
    ck.close()
    assert step == 1 and same(restored, state)
    assert all(r.sharding == target for r in restored.values())


def test_a_save_larger_than_the_free_disk_is_refused(tmp_path, monkeypatch):
  state = make_state(2, 1 << 16)
  ck = Checkpointer(tmp_path, every=0, keep=2, async_save=True, state_template=state)
  assert ck.save(1, state, {"step": 1}, force=True)
  ck.wait()
  need = storage.needed_bytes(storage.state_bytes(state))
  monkeypatch.setattr(storage, "free_bytes", lambda _: need - 1)
  with pytest.raises(StorageError) as e:
    ck.save(2, make_state(2, 1 << 16, offset=5.0), {"step": 2}, force=True)
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith("checkpoint of step 2 not written"), msg
  assert "checkpoint of step 1 is intact" in msg and "checkpoint.dir" in msg
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]
  restored, _, step = ck.restore(state)
  ck.close()
  assert step == 1 and same(restored, state)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax threads
@pytest.mark.parametrize("async_save", [True, False])
def test_a_write_that_fails_on_the_disk_removes_only_its_partial_save(tmp_path, async_save):
  state = make_state(2, 1 << 20)  # 4 MiB leaves
  ck = Checkpointer(tmp_path, every=0, keep=2, async_save=async_save, state_template=state)
  assert ck.save(1, state, {"step": 1}, force=True)
  ck.wait()
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # files of at most 1 MiB
  try:
    with pytest.raises(StorageError) as e:
      ck.save(2, make_state(2, 1 << 20, offset=5.0), {"step": 2}, force=True)
      ck.wait()
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
  msg = str(e.value)
  assert "\n" not in msg and "checkpoint of step 2" in msg and "File too large" in msg, msg
  assert "partial directory was removed (2.orbax-checkpoint-tmp" in msg, msg
  assert "checkpoint of step 1 is intact" in msg
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]
  restored, _, step = ck.restore(state)
  ck.close()
  assert step == 1 and same(restored, state)


def test_checkpoint_memory_benchmark_prints_its_table(tmp_path, capsys):
  rows = checkpoint_memory.main(["--gb", "0.02", "--leaves", "4", "--dir", str(tmp_path),
                                 "--same-process", "--modes", "whole,streamed/64:unpinned"])
  out = capsys.readouterr().out
  assert [r["mode"] for r in rows] == ["whole", "streamed/64:unpinned"]
  assert "| streamed/64:unpinned | 0.02 |" in out
  # 1/64 of the host's memory is more than this state: the batch is that, not one array
  assert rows[0]["batch"] is None and rows[1]["batch"] > rows[1]["state"]
  assert all(r["disk"] > 0 and r["seconds"] > 0 for r in rows)
  assert list(tmp_path.iterdir()) == []   # each save's own directory removed
  for bad in ("halfway", "whole/2", "streamed/0", "streamed:warm"):
    with pytest.raises(SystemExit):
      checkpoint_memory.main(["--modes", bad])


def test_checkpoint_memory_benchmark_measures_each_mode_in_a_new_process(tmp_path):
  rows = checkpoint_memory.main(["--gb", "0.01", "--leaves", "2", "--dir", str(tmp_path),
                                 "--modes", "streamed"])
  assert [r["mode"] for r in rows] == ["streamed"] and rows[0]["state"] > 0.009e9
  assert rows[0]["batch"] > 0 and rows[0]["disk"] > 0


def test_the_streamed_batch_is_a_32nd_of_the_host_memory_or_the_largest_array(monkeypatch):
  monkeypatch.setattr(storage, "host_available_bytes", lambda: 64 << 30)
  assert storage.stream_bytes(8 << 30, 1 << 30) is None               # under a quarter: whole
  assert storage.stream_bytes(32 << 30, 1 << 30) == 2 << 30           # 64 GiB / 32
  assert storage.stream_bytes(32 << 30, 5 << 30) == (5 << 30) + 1     # the largest array whole
