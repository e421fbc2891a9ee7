"""spmd._hlo: collectives read from compiled HLO text, checked on small real programs over 8 CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmd._hlo import (
    Collective,
    _iota_groups,
    _mesh_axes_groups,
    _parse_groups,
    _shape_bytes,
    collectives,
    matmul_flops,
)

AXES = ("data", "fsdp", "tensor")
F32_16x32 = 16 * 32 * 4


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py emulates them on CPU)")
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), AXES)


def _hlo(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def _shard_map(mesh: Mesh, f, in_specs, out_specs):
    # check_vma off: the tests want the exact collective written, not replication inference.
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _ops(mesh: Mesh, f, in_specs, out_specs, *args) -> list[Collective]:
    return collectives(_hlo(_shard_map(mesh, f, in_specs, out_specs), *args), mesh)


# ----------------------------------------------------------------------------------- real programs


def test_psum_axes_are_the_ones_named(mesh: Mesh) -> None:
    x = jnp.ones((16, 32), jnp.float32)
    over_data = _ops(mesh, lambda a: lax.psum(a, "data"), P(), P(), x)
    over_two = _ops(mesh, lambda a: lax.psum(a, ("fsdp", "tensor")), P(), P(), x)
    assert over_data == [Collective("all-reduce", ("data",), 2, 1, F32_16x32, F32_16x32)]
    # Ring all-reduce over 4 devices sends 2*(4-1)/4 of the buffer.
    assert over_two == [Collective("all-reduce", ("fsdp", "tensor"), 4, 1, F32_16x32, F32_16x32 * 3 // 2)]


def test_each_kind_from_shard_map(mesh: Mesh) -> None:
    x = jnp.ones((16, 32), jnp.float32)
    gather = _ops(mesh, lambda a: lax.all_gather(a, "tensor", tiled=True), P("tensor"), P(), x)
    scatter = _ops(mesh, lambda a: lax.psum_scatter(a, "fsdp", tiled=True), P(), P("fsdp"), x)
    to_all = _ops(mesh, lambda a: lax.all_to_all(a, "data", 0, 1, tiled=True), P(), P(), x)
    swap = _ops(mesh, lambda a: lax.ppermute(a, "data", [(0, 1), (1, 0)]), P(), P(), x)
    ring = [(i, (i + 1) % 4) for i in range(4)]
    ring_ops = _ops(mesh, lambda a: lax.ppermute(a, ("data", "fsdp"), ring), P(), P(), x)
    # all-gather: S is the gathered result (16x32 here); reduce-scatter: the full input.
    assert gather == [Collective("all-gather", ("tensor",), 2, 1, F32_16x32, F32_16x32 // 2)]
    assert scatter == [Collective("reduce-scatter", ("fsdp",), 2, 1, F32_16x32, F32_16x32 // 2)]
    # XLA splits the all-to-all operand into a 2-tuple; both halves count.
    assert to_all == [Collective("all-to-all", ("data",), 2, 1, F32_16x32, F32_16x32 // 2)]
    assert swap == [Collective("collective-permute", ("data",), 2, 1, F32_16x32, F32_16x32)]
    assert ring_ops == [Collective("collective-permute", ("data", "fsdp"), 4, 1, F32_16x32, F32_16x32)]


def test_all_gather_in_scan_runs_once_per_iteration(mesh: Mesh) -> None:
    def f(xs):
        # Gathering the scanned slice keeps the collective loop-variant, so XLA cannot hoist it.
        def body(carry, x):
            return carry + lax.all_gather(x, "tensor", tiled=True).sum(), None

        return lax.scan(body, jnp.float32(0), xs.reshape(5, 4, 8))[0]

    text = _hlo(_shard_map(mesh, f, P(None, "tensor"), P()), jnp.ones((5, 64), jnp.float32))
    assert '"known_trip_count":{"n":"5"}' in text
    one = 8 * 8 * 4  # gathered f32[8,8]
    assert collectives(text, mesh) == [Collective("all-gather", ("tensor",), 2, 5, 5 * one, 5 * one // 2)]


def test_nested_fori_loops_multiply(mesh: Mesh) -> None:
    def f(a):
        inner = lambda j, c: lax.psum(c, "data") * 0.5
        return lax.fori_loop(0, 3, lambda i, c: lax.fori_loop(0, 4, inner, c), a)

    ops = _ops(mesh, f, P(), P(), jnp.ones((16, 32), jnp.float32))
    assert ops == [Collective("all-reduce", ("data",), 2, 12, 12 * F32_16x32, 12 * F32_16x32)]


def test_a_named_loop_with_each_devices_own_bound_weighs_by_its_given_trip_count(mesh: Mesh) -> None:
    """A loop whose bound each device reads from a table (uneven shares) has no known trip count; its named
    scope's one weight stands for the busiest device's, for its collectives and its matmuls alike."""

    def f(a, b):
        bound = jnp.asarray([3, 1])[lax.axis_index("data")]
        with jax.named_scope("my_loop"):
            return lax.fori_loop(0, bound, lambda i, c: lax.psum(c @ b, "tensor"), a)

    text = _hlo(_shard_map(mesh, f, (P(), P()), P()), jnp.ones((16, 32)), jnp.ones((32, 32)))
    assert "known_trip_count" not in text
    once = collectives(text, mesh)
    weighed = collectives(text, mesh, branch_weights={"my_loop": (3.0,)})
    assert [c.count for c in once] == [1] and [c.count for c in weighed] == [3]
    assert matmul_flops(text, branch_weights={"my_loop": (3.0,)}) == 3 * matmul_flops(text) == 3 * 2 * 16 * 32 * 32


def test_combined_all_reduce_sums_tuple_elements(mesh: Mesh) -> None:
    def loss(params, x):
        w, b = params
        return jnp.mean(jnp.tanh(x @ w + b) ** 2)

    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXES))
    grad = jax.jit(jax.grad(loss), in_shardings=((replicated, replicated), batch), out_shardings=replicated)
    params = (jnp.ones((64, 256), jnp.float32), jnp.ones((256,), jnp.float32))
    text = grad.lower(params, jnp.ones((32, 64), jnp.float32)).compile().as_text()
    assert "(f32[256,64]{1,0}, f32[256]{0}) all-reduce(" in text  # both grads in one op
    assert "replica_groups=mesh[" in text  # and its groups in the mesh-axes spelling
    size = (64 * 256 + 256) * 4
    assert collectives(text, mesh) == [Collective("all-reduce", AXES, 8, 1, size, size * 7 // 4)]


def test_mesh_axes_groups_with_transposed_device_ids(mesh: Mesh) -> None:
    x = jnp.ones((32, 64), jnp.float32)
    named = lambda *spec: NamedSharding(mesh, P(*spec))
    row_sum = jax.jit(lambda a: jnp.tanh(a).sum(1), in_shardings=named("data", "tensor"), out_shardings=named("data"))
    col_sum = jax.jit(
        lambda a: jnp.tanh(a).sum(0),
        in_shardings=named(("fsdp", "tensor"), "data"),
        out_shardings=named("data"),
    )
    row_text = row_sum.lower(x).compile().as_text()
    col_text = col_sum.lower(x).compile().as_text()
    assert "device_ids=([2,2,2]T(0,2,1)) {'axis_1'}" in row_text
    assert "device_ids=([2,4]T(1,0)) {'axis_0'}" in col_text
    assert collectives(row_text, mesh) == [Collective("all-reduce", ("tensor",), 2, 1, 64, 64)]
    assert collectives(col_text, mesh) == [Collective("all-reduce", ("fsdp", "tensor"), 4, 1, 128, 192)]


def test_device_numbers_are_mesh_positions_not_device_ids(mesh: Mesh) -> None:
    permuted = Mesh(np.array(jax.devices()[:8])[[3, 6, 0, 5, 1, 7, 2, 4]].reshape(2, 2, 2), AXES)
    f = jax.jit(_shard_map(permuted, lambda a: lax.psum(a, "fsdp"), P(), P()))
    compiled = f.lower(jnp.ones((16, 32), jnp.float32)).compile()
    assert compiled.runtime_executable().local_devices() == list(permuted.devices.flat)
    # Read as Device.id, group {0,2} would be mesh positions 2 and 6, which differ along data, not fsdp.
    assert "replica_groups={{0,2},{1,3},{4,6},{5,7}}" in compiled.as_text()
    assert [c.axes for c in collectives(compiled.as_text(), permuted)] == [("fsdp",)]


def test_without_mesh_axes_are_empty(mesh: Mesh) -> None:
    ops = collectives(_hlo(_shard_map(mesh, lambda a: lax.psum(a, "data"), P(), P()), jnp.ones(8)))
    assert ops == [Collective("all-reduce", (), 2, 1, 32, 32)]
    assert ops[0].to_dict() == {
        "kind": "all-reduce",
        "raw_kind": "all-reduce",
        "count": 1,
        "bytes": 32,
        "traffic_bytes": 32,
        "axes": [],
        "group_size": 2,
        "spans": [],
        "dtype": "f32",
        "wire_bytes": 32,
    }


def test_a_bf16_gather_counts_at_its_program_width(mesh: Mesh) -> None:
    # XLA:CPU widens a bf16 all-gather to f32 (rounding its operand through bf16 first); GPU and TPU send bf16.
    x = jnp.ones((16, 32), jnp.bfloat16)
    gather = lambda a: lax.all_gather(a, "data", tiled=True)  # noqa: E731
    (op,) = collectives(_hlo(_shard_map(mesh, gather, P("data"), P()), x), mesh)
    assert (op.kind, op.dtype, op.bytes, op.wire_bytes) == ("all-gather", "bf16", 16 * 32 * 2, 16 * 32 * 4)
    assert op.traffic_bytes == op.bytes // 2 and op.widened
    (f32,) = collectives(_hlo(_shard_map(mesh, gather, P("data"), P()), x.astype(jnp.float32)), mesh)
    assert (f32.dtype, f32.bytes, f32.wire_bytes) == ("f32", 16 * 32 * 4, 16 * 32 * 4) and not f32.widened


# ------------------------------------------------------------- all-reduce + dynamic-slice = reduce-scatter

W_GRAD, B_GRAD = 64 * 256 * 4, 256 * 4


@pytest.fixture(scope="module")
def data_mesh() -> Mesh:
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py emulates them on CPU)")
    return Mesh(np.array(jax.devices()[:8]), ("data",))


def _loss(params, x):
    w, b = params
    return jnp.mean(jnp.tanh(x @ w + b) ** 2)


def _grad_text(mesh: Mesh, grad_specs) -> str:
    """Replicated params, a batch split over ``data``, and the grads constrained to ``grad_specs``."""
    named = lambda spec: NamedSharding(mesh, spec)

    def grads(params, x):
        return lax.with_sharding_constraint(jax.grad(_loss)(params, x), tuple(map(named, grad_specs)))

    params = (jnp.ones((64, 256), jnp.float32), jnp.ones((256,), jnp.float32))
    step = jax.jit(grads, in_shardings=((named(P()), named(P())), named(P("data"))))
    return step.lower(params, jnp.ones((32, 64), jnp.float32)).compile().as_text()


def test_zero2_sharded_gradients_count_as_reduce_scatter(data_mesh: Mesh) -> None:
    text = _grad_text(data_mesh, (P("data", None), P("data")))
    # What the CPU program runs: one combined all-reduce of both grads, each then dynamic-sliced to its 1/8
    # (inside a fusion, at an offset computed from partition-id).
    assert "(f32[256,64]{1,0}, f32[256]{0}) all-reduce(" in text and "reduce-scatter" not in text
    assert "f32[32]{0} dynamic-slice(" in text and "f32[256,8]{1,0} dynamic-slice(" in text
    size = W_GRAD + B_GRAD
    # Reduce-scatter ring traffic: (8-1)/8 of the full buffer, half the all-reduce's.
    assert collectives(text, data_mesh) == [
        Collective("reduce-scatter", ("data",), 8, 1, size, size * 7 // 8, raw_kind="all-reduce")
    ]


def test_replicated_gradients_stay_all_reduce(data_mesh: Mesh) -> None:
    size = W_GRAD + B_GRAD
    ops = collectives(_grad_text(data_mesh, (P(), P())), data_mesh)
    assert ops == [Collective("all-reduce", ("data",), 8, 1, size, size * 7 // 4)]
    assert ops[0].raw_kind == "all-reduce"


def test_combined_all_reduce_splits_between_kinds(data_mesh: Mesh) -> None:
    # Only the weight's grad is sharded: its tuple element is sliced, the bias's is returned whole.
    text = _grad_text(data_mesh, (P("data", None), P()))
    assert "(f32[256,64]{1,0}, f32[256]{0}) all-reduce(" in text
    assert collectives(text, data_mesh) == [
        Collective("reduce-scatter", ("data",), 8, 1, W_GRAD, W_GRAD * 7 // 8, raw_kind="all-reduce"),
        Collective("all-reduce", ("data",), 8, 1, B_GRAD, B_GRAD * 7 // 4),
    ]


def test_fsdp_gradient_reduction_counts_as_reduce_scatter(data_mesh: Mesh) -> None:
    named = lambda *spec: NamedSharding(data_mesh, P(*spec))
    loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)
    grad = jax.jit(jax.grad(loss), in_shardings=(named("data", None), named("data")), out_shardings=named("data"))
    text = grad.lower(jnp.ones((64, 256), jnp.float32), jnp.ones((32, 64), jnp.float32)).compile().as_text()
    # The all-reduce's only user is a fusion that dynamic-slices its parameter and transposes the slice.
    assert "f32[256,64]{1,0} all-reduce(" in text and "f32[256,8]{1,0} dynamic-slice(" in text
    assert collectives(text, data_mesh) == [
        Collective("all-gather", ("data",), 8, 1, W_GRAD, W_GRAD * 7 // 8),
        Collective("reduce-scatter", ("data",), 8, 1, W_GRAD, W_GRAD * 7 // 8, raw_kind="all-reduce"),
    ]


def test_table_lookup_offsets_and_permuted_elements(mesh: Mesh) -> None:
    # Over (data, fsdp, tensor) = (2, 2, 2) XLA all-reduces the weight's grad over data, then collective-permutes
    # it (not a slice: stays all-reduce); the bias's grad is dynamic-sliced at an offset read from a per-device
    # table indexed by partition-id (a slice all the same).
    text = _grad_text(mesh, (P("data", None), P("data")))
    assert "collective-permute(%get-tuple-element" in text and "u32[8]{0} constant({0, 0, 0, 0, 1, 1, 1, 1})" in text
    half_w = W_GRAD // 2
    assert collectives(text, mesh) == [
        Collective("all-reduce", ("data",), 2, 1, half_w, half_w),
        Collective("collective-permute", ("data", "fsdp"), 2, 1, half_w, half_w),
        Collective("reduce-scatter", ("data",), 2, 1, B_GRAD, B_GRAD // 2, raw_kind="all-reduce"),
    ]


# --------------------------------------------------------------------------------- literal HLO text

# Async pairs as GPU backends print them, a while loop calling one computation twice, a conditional and an
# async-start wrapper; numbers are over a (2, 2, 2) mesh.
ASYNC_HLO = """\
HloModule async_test, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%a2a_body (p: f32[16,32]) -> f32[16,32] {
  %p = f32[16,32]{1,0} parameter(0)
  ROOT %a2a = f32[16,32]{1,0} all-to-all(%p), channel_id=5, replica_groups={{0,1,2,3},{4,5,6,7}}, \
dimensions={0}
}

%step (x: f32[8,32]) -> f32[16,32] {
  %x = f32[8,32]{1,0} parameter(0)
  %ags = (f32[8,32]{1,0}, f32[16,32]{1,0}) all-gather-start(%x), channel_id=1, replica_groups=[4,2]<=[8], \
dimensions={0}, use_global_device_ids=true
  ROOT %agd = f32[16,32]{1,0} all-gather-done(%ags)
}

%body (t: (s32[], f32[8,32])) -> (s32[], f32[8,32]) {
  %t = (s32[], f32[8,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x.1 = f32[8,32]{1,0} get-tuple-element(%t), index=1
  %g = f32[16,32]{1,0} call(%x.1), to_apply=%step
  %g.2 = f32[16,32]{1,0} call(%x.1), to_apply=%step
  ROOT %out = (s32[], f32[8,32]{1,0}) tuple(%i, %x.1)
}

%cond (t.1: (s32[], f32[8,32])) -> pred[] {
  %t.1 = (s32[], f32[8,32]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%t.1), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

%branch_a (y: f32[16,32]) -> f32[16,32] {
  %y = f32[16,32]{1,0} parameter(0)
  %ars = f32[16,32]{1,0} all-reduce-start(%y), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, \
use_global_device_ids=true, to_apply=%add
  ROOT %ard = f32[16,32]{1,0} all-reduce-done(%ars)
}

%branch_b (z: f32[16,32]) -> f32[16,32] {
  %z = f32[16,32]{1,0} parameter(0)
  %cps = (f32[16,32]{1,0}, f32[16,32]{1,0}, u32[], u32[]) collective-permute-start(%z), channel_id=3, \
source_target_pairs={{0,1},{1,0},{2,3},{3,2},{4,5},{5,4},{6,7},{7,6}}
  ROOT %cpd = f32[16,32]{1,0} collective-permute-done(%cps)
}

ENTRY %main (x.2: f32[8,32], y.2: f32[16,32], p.2: s32[]) -> f32[16,32] {
  %x.2 = f32[8,32]{1,0} parameter(0)
  %y.2 = f32[16,32]{1,0} parameter(1)
  %p.2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,32]{1,0}) tuple(%zero, %x.2)
  %loop = (s32[], f32[8,32]{1,0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"3"}}
  %c = f32[16,32]{1,0} conditional(%p.2, %y.2, %y.2), branch_computations={%branch_a, %branch_b}
  %rss = ((f32[16,32]{1,0}), f32[4,32]{1,0}) reduce-scatter-start(%c), channel_id=4, \
replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true, to_apply=%add
  %rsd = f32[4,32]{1,0} reduce-scatter-done(%rss)
  %as = ((f32[16,32]{1,0}), f32[16,32]{1,0}, s32[]) async-start(%y.2), calls=%a2a_body
  %ad = f32[16,32]{1,0} async-done(%as), calls=%a2a_body
  ROOT %r = f32[16,32]{1,0} add(%c, %ad)
}
"""


def test_async_pairs_call_graph_and_traffic(mesh: Mesh) -> None:
    s = F32_16x32
    assert collectives(ASYNC_HLO, mesh) == [
        # 3 iterations x 2 calls of %step; S is the gathered f32[16,32], computed from the operand.
        Collective("all-gather", ("tensor",), 2, 6, 6 * s, 3 * s),
        # Both conditional branches count once each.
        Collective("all-reduce", ("data",), 2, 1, s, s),
        Collective("collective-permute", ("tensor",), 2, 1, s, s),
        # The async-start wrapper's inner op counts once although async-done names it too.
        Collective("all-to-all", ("fsdp", "tensor"), 4, 1, s, s * 3 // 4),
        # reduce-scatter: S is the full input, not the f32[4,32] result.
        Collective("reduce-scatter", ("fsdp", "tensor"), 4, 1, s, s * 3 // 4),
    ]


def test_trip_count_spellings_and_degenerate_groups() -> None:
    trip = 'backend_config={"known_trip_count":{"n":"3"}}'
    escaped = ASYNC_HLO.replace(trip, 'backend_config="{\\"known_trip_count\\":{\\"n\\":\\"7\\"}}"')
    assert {c.kind: c.count for c in collectives(escaped)}["all-gather"] == 14
    # Without a known trip count the body is counted once (a lower bound).
    assert {c.kind: c.count for c in collectives(ASYNC_HLO.replace(", " + trip, ""))}["all-gather"] == 2
    degenerate = ASYNC_HLO.replace("{{0,4},{1,5},{2,6},{3,7}}", "{{0},{1},{2},{3},{4},{5},{6},{7}}")
    degenerate = degenerate.replace("{{0,1},{1,0},{2,3},{3,2},{4,5},{5,4},{6,7},{7,6}}", "{{0,0},{1,1}}")
    assert {c.kind for c in collectives(degenerate)} == {"all-gather", "all-to-all", "reduce-scatter"}
    assert collectives("HloModule empty") == []


def test_iota_replica_groups() -> None:
    assert _iota_groups("[2,4]<=[8]") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _iota_groups("[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Seen in a jit program: all-gather over `fsdp` of a (2, 2, 2) mesh.
    assert _iota_groups("[4,2]<=[2,2,2]T(0,2,1)") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _parse_groups("replica_groups=[1,8]<=[8], dimensions={0}", 8) == [list(range(8))]
    assert _parse_groups("replica_groups={}, to_apply=%add", 4) == [[0, 1, 2, 3]]
    assert _parse_groups("channel_id=1, to_apply=%add", 2) == [[0, 1]]


def test_mesh_axes_replica_groups() -> None:
    assert _mesh_axes_groups("mesh['axis_0'=8,'axis_1'=1] {'axis_0'}") == [list(range(8))]
    transposed = "mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_1'}"
    assert _mesh_axes_groups(transposed) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _mesh_axes_groups("mesh['a'=2,'b'=4] {'b','a'}") == [[0, 4, 1, 5, 2, 6, 3, 7]]
    # Sub-axes split an axis major-to-minor as [pre, size, rest], as XLA's MeshAxesReplicaGroupList does.
    assert _mesh_axes_groups("mesh['a'=8] {'a':(1)2}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _mesh_axes_groups("mesh['a'=8] {'a':(2)2}") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _mesh_axes_groups("mesh['a'=8] {'a':(1)2,'a':(4)2}") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert _mesh_axes_groups("mesh[a=2,b=2], device_ids=(3,1,2,0) {b}") == [[3, 1], [2, 0]]
    assert _parse_groups("replica_groups=maximal_mesh[device_id=3] {}", 8) is None


def test_shape_bytes() -> None:
    assert _shape_bytes("(f32[64,256]{1,0}, f32[256]{0})") == (64 * 256 + 256) * 4
    assert _shape_bytes("f32[]") == 4
    assert _shape_bytes("pred[7]{0}") == 7
    assert _shape_bytes("bf16[3,5]{1,0}") == 30
    assert _shape_bytes("c128[2]") == 32
    assert _shape_bytes("f8e4m3fn[10]") == 10
    assert _shape_bytes("s4[3]") == 2
    assert _shape_bytes("f32[8,128]{1,0:T(8,128)S(1)}") == 4096
    assert _shape_bytes("((f32[2]{0}, s64[2]{0}), u8[5], token[])") == 8 + 16 + 5
    assert _shape_bytes("f32[<=16,4]") == 256


SLICED_HLO = """\
HloModule sliced, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused (p0: f32[16,32], p1: s32[]) -> f32[8,16] {
  %p0 = f32[16,32]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = f32[16,8]{1,0} dynamic-slice(%p0, %zero, %p1), dynamic_slice_sizes={16,8}
  ROOT %t = f32[8,16]{0,1} transpose(%ds), dimensions={1,0}
}

ENTRY %main (x: f32[16,32], i: s32[]) -> (f32[4,32], f32[8,16], f32[16,16], f32[8,16], f32[4,32], f32[16,32]) {
  %x = f32[16,32]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %zero.1 = s32[] constant(0)
  %ar.1 = f32[16,32]{1,0} all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  %bc = f32[512]{0} bitcast(%ar.1)
  %cp = f32[512]{0} copy(%bc)
  %s1 = f32[128]{0} slice(%cp), slice={[0:128]}
  %ar.2 = f32[16,32]{1,0} all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  %f2 = f32[8,16]{0,1} fusion(%ar.2, %i), kind=kLoop, calls=%fused
  %ar.3 = f32[16,32]{1,0} all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  %s3 = f32[16,16]{1,0} dynamic-slice(%ar.3, %zero.1, %i), dynamic_slice_sizes={16,16}
  %ar.4 = f32[16,32]{1,0} all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  %s4 = f32[8,16]{1,0} dynamic-slice(%ar.4, %i, %i), dynamic_slice_sizes={8,16}
  %ar.5 = f32[16,32]{1,0} all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  %s5 = f32[4,32]{1,0} dynamic-slice(%ar.5, %i, %zero.1), dynamic_slice_sizes={4,32}
  %n5 = f32[16,32]{1,0} negate(%ar.5)
  %ars = f32[16,32]{1,0} all-reduce-start(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  %ard = f32[16,32]{1,0} all-reduce-done(%ars)
  %s6 = f32[4,32]{1,0} dynamic-slice(%ard, %i, %zero.1), dynamic_slice_sizes={4,32}
  ROOT %out = (f32[4,32]{1,0}, f32[8,16]{0,1}, f32[16,16]{1,0}, f32[8,16]{1,0}, f32[4,32]{1,0}, f32[16,32]{1,0}) \
tuple(%s6, %f2, %s3, %s4, %s5, %n5)
}
"""


def test_which_slices_make_a_reduce_scatter() -> None:
    s = F32_16x32
    # Recognised: a static slice behind bitcast + copy (%ar.1), a fused dynamic-slice (%ar.2), an async pair
    # (%ars). Not: half instead of a quarter (%ar.3), a quarter split over two dims (%ar.4), a slice next to
    # another use (%ar.5).
    assert collectives(SLICED_HLO) == [
        Collective("all-reduce", (), 4, 3, 3 * s, 3 * s * 3 // 2),
        Collective("reduce-scatter", (), 4, 3, 3 * s, 3 * s * 3 // 4, raw_kind="all-reduce"),
    ]
    # The same ops in a while body count once per iteration; a value the body returns is not only sliced.
    body = SLICED_HLO.replace("ENTRY %main", "%body").replace("HloModule sliced, num_partitions=4", "")
    looped = f"""HloModule looped, num_partitions=4
{body}
%cond (t: (f32[16,32], s32[])) -> pred[] {{
  %t = (f32[16,32]{{1,0}}, s32[]) parameter(0)
  ROOT %p = pred[] constant(true)
}}

%loop_body (t.1: (f32[16,32], s32[])) -> (f32[16,32], s32[]) {{
  %t.1 = (f32[16,32]{{1,0}}, s32[]) parameter(0)
  %x.1 = f32[16,32]{{1,0}} get-tuple-element(%t.1), index=0
  %i.1 = s32[] get-tuple-element(%t.1), index=1
  %c = (f32[4,32]{{1,0}}, f32[8,16]{{0,1}}, f32[16,16]{{1,0}}, f32[8,16]{{1,0}}, f32[4,32]{{1,0}}, f32[16,32]{{1,0}}) \
call(%x.1, %i.1), to_apply=%body
  %r = f32[16,32]{{1,0}} all-reduce(%x.1), replica_groups={{{{0,1,2,3}}}}, to_apply=%add
  ROOT %o = (f32[16,32]{{1,0}}, s32[]) tuple(%r, %i.1)
}}

ENTRY %main.2 (x.2: f32[16,32]) -> (f32[16,32], s32[]) {{
  %x.2 = f32[16,32]{{1,0}} parameter(0)
  %zero.2 = s32[] constant(0)
  %init = (f32[16,32]{{1,0}}, s32[]) tuple(%x.2, %zero.2)
  ROOT %w = (f32[16,32]{{1,0}}, s32[]) while(%init), condition=%cond, body=%loop_body, \
backend_config={{"known_trip_count":{{"n":"5"}}}}
}}
"""
    assert collectives(looped) == [
        Collective("all-reduce", (), 4, 20, 20 * s, 20 * s * 3 // 2),
        Collective("reduce-scatter", (), 4, 15, 15 * s, 15 * s * 3 // 4, raw_kind="all-reduce"),
    ]


def test_real_reduce_scatter_keeps_its_raw_kind(mesh: Mesh) -> None:
    ops = collectives(ASYNC_HLO, mesh)
    assert {(c.kind, c.raw_kind) for c in ops if "reduce" in c.kind} == {
        ("all-reduce", "all-reduce"),
        ("reduce-scatter", "reduce-scatter"),
    }


def test_groups_over_part_of_an_axis_say_how_much_of_it_they_span() -> None:
    # Read from the program XLA makes for an embedding lookup from a table split over fsdp, the tokens split over
    # fsdp too, on fsdp=4 × tensor=2: an all-gather over pairs of devices 2 apart on fsdp (its major half), and
    # collective-permutes that move shards between two device orders, x -> 2x mod 7: cycles of 3 devices.
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))
    text = """HloModule m, num_partitions=8
ENTRY %main (p: f32[16,32]) -> f32[32,32] {
  %p = f32[16,32]{1,0} parameter(0)
  %g = f32[32,32]{1,0} all-gather(%p), channel_id=1, replica_groups=[4,2]<=[2,2,2]T(2,1,0), dimensions={0}
  %w = f32[64,32]{1,0} all-gather(%g), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}
  ROOT %c = f32[16,32]{1,0} collective-permute(%p), channel_id=3, \
source_target_pairs={{0,0},{1,2},{2,4},{3,6},{4,1},{5,3},{6,5},{7,7}}
}"""
    assert _parse_groups("replica_groups=[4,2]<=[2,2,2]T(2,1,0)", 8) == [[0, 4], [2, 6], [1, 5], [3, 7]]
    ops = {(c.kind, c.group_size): c for c in collectives(text, mesh)}
    part, whole = ops["all-gather", 2], ops["all-gather", 4]
    assert (part.axes, part.spans) == (("fsdp",), (2,))  # 2 of fsdp's 4 coordinates
    assert (whole.axes, whole.spans) == (("fsdp",), ())  # the whole axis
    assert part.to_dict()["spans"] == [2]
    permute = ops["collective-permute", 3]  # the longest cycle: 1 -> 2 -> 4 -> 1
    assert permute.axes == ("fsdp", "tensor") and permute.traffic_bytes == F32_16x32


def test_matmul_flops_count_contractions_batch_dimensions_and_loops() -> None:
    from spmd._hlo import matmul_flops

    def f(a, b):
        return lax.fori_loop(0, 5, lambda i, x: jnp.tanh(jnp.einsum("bij,bjk->bik", x, b)), a)

    text = _hlo(f, jnp.ones((3, 4, 8)), jnp.ones((3, 8, 8)))
    assert matmul_flops(text) == 5 * 2 * 3 * 4 * 8 * 8
    assert matmul_flops(_hlo(lambda a: jnp.tanh(a) + 1, jnp.ones(4))) == 0
