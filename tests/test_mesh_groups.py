"""Llama-wide: the parameter splits of coat_jax.training.mesh (FSDP and tensor parallelism) never
cut an optimizer group of coat_adamw, for every parameter of every preset on the 8-device meshes;
where a split would (the rules without the group size, or a deliberately bad shape),
state_shardings names the parameter and the split. Shapes only (jax.eval_shape): no arrays."""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from coat_jax import kernels, optim
from coat_jax.formats import OPTIMIZER_GROUP_SIZE
from coat_jax.models.llama import Llama, LlamaConfig
from coat_jax.training import mesh as mesh_lib
from coat_jax.training.schema import MeshConfig

PRESETS = ["tiny", "llama-125m", "olmo-1b", "llama2-7b", "llama2-13b"]
MESHES = [MeshConfig(data=1, fsdp=8, tensor=1), MeshConfig(data=1, fsdp=4, tensor=2),
          MeshConfig(data=2, fsdp=2, tensor=2)]
G = OPTIMIZER_GROUP_SIZE


def _abstract_params(name):
  cfg = LlamaConfig.from_name(name, precision="coat")
  _, params, _ = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
  return nnx.to_pure_dict(params)


def _shards(mesh, entry):
  names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
  n = 1
  for a in names:
    n *= mesh.shape[a]
  return n


@pytest.mark.parametrize("name", PRESETS)
def test_llama_splits_keep_optimizer_groups_whole(name):
  params = _abstract_params(name)
  state = jax.eval_shape(optim.coat_adamw(1e-3, group_size=G, group_axis="last").init, params)
  quantized = 0
  for mesh_cfg in MESHES:
    mesh = mesh_lib.make_mesh(mesh_cfg)
    sh = mesh_lib.param_shardings(params, mesh, group_size=G)
    with kernels.backend("adam=triton"):   # the per-shard fused step: the group check is on
      s_sh = optim.state_shardings(sh, state)
    flat_p = jax.tree_util.tree_leaves_with_path(params)
    flat_s = jax.tree.leaves(sh, is_leaf=lambda x: isinstance(x, NamedSharding))
    flat_mu = jax.tree.leaves(state.mu, is_leaf=lambda x: isinstance(x, optim.ExpandedMoment))
    fsdp_or_tp = 0
    for (path, p), s, mu in zip(flat_p, flat_s, flat_mu):
      spec = tuple(s.spec) + (None,) * (p.ndim - len(s.spec))
      if isinstance(mu, optim.ExpandedMoment):   # quantized moments: groups along the last axis
        quantized += 1
        k = _shards(mesh, spec[-1])
        assert p.shape[-1] % G or (p.shape[-1] % k == 0 and (p.shape[-1] // k) % G == 0), \
            (name, mesh_cfg, jax.tree_util.keystr(path), spec)
      # every big matrix stays FSDP-split (its state is not silently replicated)
      if p.ndim >= 2 and p.size >= 2**20:
        fsdp_or_tp += 1
        used = [a for e in spec for a in (e if isinstance(e, tuple) else (e,)) if a]
        assert "fsdp" in used, (name, mesh_cfg, jax.tree_util.keystr(path), spec)
    assert s_sh.mu is not None and fsdp_or_tp > 0
  assert quantized > 0


def test_rules_without_group_size_cut_groups_and_the_error_names_them():
  """llama-125m (hidden 768 = 6 groups of 128) on fsdp 8: the plain rules split the embedding's
  last axis into 96-element shards; state_shardings names the parameter and the split. With the
  group size the rule moves fsdp to the vocab axis instead."""
  params = _abstract_params("llama-125m")
  state = jax.eval_shape(optim.coat_adamw(1e-3).init, params)
  mesh = mesh_lib.make_mesh(MESHES[0])
  plain = mesh_lib.param_shardings(params, mesh)
  assert plain["embed"]["embedding"].spec == P(None, "fsdp")
  with kernels.backend("adam=triton"), pytest.raises(
      ValueError, match=r"\['embed'\]\['embedding'\] of shape \(32000, 768\).*split 8 ways over "
                        r"mesh axes 'fsdp' \(768 / 8 = 96 per shard\).*groups of 128"):
    optim.state_shardings(plain, state)
  fixed = mesh_lib.param_shardings(params, mesh, group_size=G)
  assert fixed["embed"]["embedding"].spec == P("fsdp")


def test_bad_shape_is_named_when_no_split_keeps_groups():
  """A deliberately bad parameter: (3, 640) on fsdp 4 x tensor 2 ("fsdp", "tensor") -> 640 / 2 =
  320 cuts groups of 128 (640 = 5 groups) and the leading dim 3 takes neither axis: the rule
  replicates it (never a cut group); forced onto the split, the error names it."""
  mesh = mesh_lib.make_mesh(MESHES[1])
  params = {"blocks": {"w_bad": jax.ShapeDtypeStruct((3, 640), jnp.float32)}}
  assert mesh_lib.param_shardings(params, mesh, group_size=G)["blocks"]["w_bad"].spec == P()
  state = jax.eval_shape(optim.coat_adamw(1e-3, min_quantized_size=16).init, params)
  forced = {"blocks": {"w_bad": NamedSharding(mesh, P(None, "tensor"))}}
  with kernels.backend("adam=triton"), pytest.raises(
      ValueError, match=r"\['blocks'\]\['w_bad'\] of shape \(3, 640\).*split 2 ways over mesh "
                        r"axes 'tensor' \(640 / 2 = 320 per shard\)"):
    optim.state_shardings(forced, state)
