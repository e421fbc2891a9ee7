"""spmd.models: the built-in models' contract (shapes, logical names, param paths), training, user models."""

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

from spmd import data, models
from spmd.models import LMConfig, Model, get, loss_fn, unbox

SMALL_OVERRIDES = {
    "mlp": {},
    "gpt-tiny": {"layers": 2},
    "gpt-tiny-nnx": {"layers": 2},
    "gpt-small": {"layers": 2},
    "gpt-small-nnx": {"layers": 2},
    "moe-tiny": {"layers": 2},
    "cnn-tiny": {"layers": 2},
}

GPT_PATHS = {
    "params/embed/embedding": ("vocab", "embed"),
    "params/pos_embed/embedding": ("position", "embed"),
    "params/layers/ln1/scale": ("layers", "embed"),
    "params/layers/ln1/bias": ("layers", "embed"),
    "params/layers/attn/query/kernel": ("layers", "embed", "heads", "head_dim"),
    "params/layers/attn/key/kernel": ("layers", "embed", "heads", "head_dim"),
    "params/layers/attn/value/kernel": ("layers", "embed", "heads", "head_dim"),
    "params/layers/attn/out/kernel": ("layers", "heads", "head_dim", "embed"),
    "params/layers/ln2/scale": ("layers", "embed"),
    "params/layers/ln2/bias": ("layers", "embed"),
    "params/layers/mlp/wi/kernel": ("layers", "embed", "mlp"),
    "params/layers/mlp/wo/kernel": ("layers", "mlp", "embed"),
    "params/ln_f/scale": ("embed",),
    "params/ln_f/bias": ("embed",),
    "params/lm_head/kernel": ("embed", "vocab"),
}
MLP_PATHS = {
    "params/embed/embedding": ("vocab", "embed"),
    "params/wi/kernel": ("embed", "mlp"),
    "params/wo/kernel": ("mlp", "embed"),
    "params/lm_head/kernel": ("embed", "vocab"),
}


MOE_PATHS = {k: v for k, v in GPT_PATHS.items() if "/mlp/" not in k} | {
    "params/layers/moe/router": ("layers", "embed", None),
    "params/layers/moe/wi": ("layers", "expert", "embed", "mlp"),
    "params/layers/moe/wo": ("layers", "expert", "mlp", "embed"),
}


CNN_PATHS = {
    "params/embed/embedding": ("vocab", "embed"),
    "params/layers/ln/scale": ("layers", "embed"),
    "params/layers/ln/bias": ("layers", "embed"),
    "params/layers/conv_in/kernel": ("layers", "width", "embed", "channels"),
    "params/layers/conv_out/kernel": ("layers", "width", "channels", "embed"),
    "params/ln_f/scale": ("embed",),
    "params/ln_f/bias": ("embed",),
    "params/lm_head/kernel": ("embed", "vocab"),
}


def flat(tree) -> dict:
    """{"params/a/b": leaf} with metadata boxes kept as leaves."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))[0]
    return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf for path, leaf in leaves}


def abstract(model: Model):
    return jax.eval_shape(model.init, jax.random.key(0))


@pytest.fixture(scope="module", params=sorted(SMALL_OVERRIDES))
def builtin(request) -> Model:
    return get(request.param, **SMALL_OVERRIDES[request.param])


def test_builtins_registered():
    assert set(models.BUILTIN) == set(SMALL_OVERRIDES)
    for name, overrides in SMALL_OVERRIDES.items():
        model = get(name, **overrides)
        assert model.name == name
        assert model.kind == ("nnx" if name.endswith("-nnx") else "linen")


def test_init_is_abstract_and_fully_annotated(builtin):
    leaves = flat(abstract(builtin))
    assert leaves
    for path, box in leaves.items():
        assert isinstance(box, nn.LogicallyPartitioned), path
        assert isinstance(box.value, jax.ShapeDtypeStruct), path  # eval_shape allocated nothing
        assert box.value.dtype == jnp.float32, path
        assert len(box.names) == len(box.value.shape), path
        if path.startswith("params/layers/"):
            assert box.names[0] == "layers" and box.value.shape[0] == builtin.config.layers, path
        else:
            assert "layers" not in box.names, path


def test_param_paths_and_names(builtin):
    expected = {"mlp": MLP_PATHS, "moe-tiny": MOE_PATHS, "cnn-tiny": CNN_PATHS}.get(builtin.name, GPT_PATHS)
    assert {path: box.names for path, box in flat(abstract(builtin)).items()} == expected


def test_logits_shape(builtin):
    c = builtin.config
    tokens = jax.ShapeDtypeStruct((4, c.seq_len), jnp.int32)
    logits = jax.eval_shape(builtin.apply, unbox(abstract(builtin)), tokens)
    assert logits.shape == (4, c.seq_len, c.vocab)
    assert logits.dtype == jnp.float32
    # Boxed params are accepted too.
    assert jax.eval_shape(builtin.apply, abstract(builtin), tokens).shape == logits.shape


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_linen_and_nnx_gpt_have_the_same_tree(size):
    def table(model):
        return {path: (box.value.shape, box.names) for path, box in flat(abstract(model)).items()}

    linen, nnx_model = get(f"gpt-{size}", layers=3), get(f"gpt-{size}-nnx", layers=3)
    assert table(linen) == table(nnx_model)
    # The same nesting too (a plan walks both the same way).
    linen_def = jax.tree.structure(unbox(abstract(linen)))
    assert linen_def == jax.tree.structure(unbox(abstract(nnx_model)))


def test_gpt_small_size_without_allocating():
    params = unbox(abstract(get("gpt-small")))
    sizes = {path: int(np.prod(leaf.shape)) for path, leaf in flat(params).items()}
    total = sum(sizes.values())
    in_blocks = sum(n for path, n in sizes.items() if path.startswith("params/layers/"))
    assert 30e6 < total < 60e6
    assert in_blocks > 0.6 * total


class Compiled:
    """A model with its jitted init and train step, made once per module: compiling dominates test time."""

    def __init__(self, model: Model, lr: float = 1e-2):
        self.model = model
        self.init = jax.jit(model.init)
        self.params = unbox(self.init(jax.random.key(0)))
        self.optimizer = optax.adam(lr)
        loss = loss_fn(model)

        @jax.jit
        def step(params, state, batch):
            value, grads = jax.value_and_grad(loss)(params, batch)
            updates, state = self.optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value, grads

        self.step = step

    def batch(self, step: int) -> dict:
        return data.batch(0, step, 32, self.model.config.seq_len, self.model.config.vocab)


_COMPILED: dict = {}


def compiled(name: str, **overrides) -> Compiled:
    key = (name, tuple(sorted(overrides.items())))
    if key not in _COMPILED:
        _COMPILED[key] = Compiled(get(name, **overrides))
    return _COMPILED[key]


# gpt-tiny-nnx trains with remat=True, so its one compiled step covers nnx, remat and training together.
TRAINED = [("mlp", {}), ("gpt-tiny", {"layers": 2}), ("gpt-tiny-nnx", {"layers": 2, "remat": True})]


@pytest.mark.parametrize("name, overrides", TRAINED, ids=[name for name, _ in TRAINED])
def test_training_reduces_loss(name, overrides):
    run = compiled(name, **overrides)
    params, state = run.params, run.optimizer.init(run.params)
    losses = []
    for i in range(30):
        params, state, value, _ = run.step(params, state, run.batch(i))
        losses.append(float(value))
    assert np.isfinite(losses).all()
    assert losses[0] == pytest.approx(np.log(256), abs=1.0)  # starts near uniform
    # Observed at 30 steps: mlp 5.5 -> 1.6, gpt-tiny (2 layers) 6.1 -> 2.5; 0.9 leaves a wide margin.
    assert losses[-1] < 0.9 * losses[0]


def _first_step(run: Compiled, params):
    _, _, loss, grads = run.step(params, run.optimizer.init(params), run.batch(0))
    return loss, grads


def _assert_same(a, b):
    np.testing.assert_allclose(a[0], b[0], rtol=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6), a[1], b[1])


def test_remat_gives_the_same_loss_and_grads():
    plain, remat = compiled("gpt-tiny", layers=2), compiled("gpt-tiny", layers=2, remat=True)
    # remat changes how the backward pass is computed, not the parameters.
    assert jax.tree.structure(plain.params) == jax.tree.structure(remat.params)
    _assert_same(_first_step(plain, plain.params), _first_step(remat, plain.params))


def test_nnx_gpt_computes_the_same_function_as_linen_gpt():
    linen = compiled("gpt-tiny", layers=2)
    # With linen's params, the nnx GPT (with remat) gives the same loss and grads as the linen GPT...
    _assert_same(
        _first_step(linen, linen.params),
        _first_step(compiled("gpt-tiny-nnx", layers=2, remat=True), linen.params),
    )
    # ...and without remat, the same logits.
    tokens = linen.batch(0)["tokens"]
    expected = jax.jit(linen.model.apply)(linen.params, tokens)
    got = jax.jit(get("gpt-tiny-nnx", layers=2).apply)(linen.params, tokens)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, overrides", TRAINED[1:], ids=[name for name, _ in TRAINED[1:]])
def test_init_is_deterministic_and_splits_layer_rngs(name, overrides):
    run = compiled(name, **overrides)  # the trained models': their init is compiled already
    again, other = unbox(run.init(jax.random.key(0))), unbox(run.init(jax.random.key(4)))
    jax.tree.map(np.testing.assert_array_equal, run.params, again)
    assert not np.allclose(run.params["params"]["embed"]["embedding"], other["params"]["embed"]["embedding"])
    # Stacked layers get different initial values: the rngs are split over the layers.
    wi = run.params["params"]["layers"]["mlp"]["wi"]["kernel"]
    assert not np.allclose(wi[0], wi[1])


def test_sequences_longer_than_seq_len_are_rejected():
    for name in ("gpt-tiny", "gpt-tiny-nnx"):
        model = get(name, layers=1, seq_len=8)
        with pytest.raises(ValueError, match="exceeds config.seq_len"):
            jax.eval_shape(model.apply, unbox(abstract(model)), jax.ShapeDtypeStruct((1, 9), jnp.int32))


def test_config_validation():
    assert LMConfig(d_model=96, heads=6).head_dim == 16
    with pytest.raises(ValueError, match="divisible"):
        LMConfig(d_model=64, heads=3)
    with pytest.raises(ValueError, match="layers"):
        get("gpt-tiny", layers=0)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['depth'\]"):
        get("gpt-tiny", depth=2)


def test_unbox_replaces_every_box():
    tree = {
        "a": nn.LogicallyPartitioned(jnp.ones(3), ("embed",)),
        "b": nn.Partitioned(jnp.zeros((2, 2)), ("data", None)),
        "c": {"d": jnp.arange(2)},
    }
    out = unbox(tree)
    assert not any(isinstance(x, nn.meta.AxisMetadata) for x in jax.tree.leaves(out, is_leaf=lambda x: True))
    np.testing.assert_array_equal(out["a"], jnp.ones(3))
    assert out["b"].shape == (2, 2) and out["c"]["d"].shape == (2,)


# --- get() errors and user models -------------------------------------------------------------------------


def test_unknown_name_lists_known_models():
    with pytest.raises(ValueError) as info:
        get("gpt-huge")
    for name in models.BUILTIN:
        assert name in str(info.value)


def test_unimportable_user_module():
    with pytest.raises(ValueError, match=r"could not import 'nope.mod' for --model 'nope.mod:fn': "):
        get("nope.mod:fn")


class Bigram(nn.Module):
    """An unannotated linen model: plain arrays as params."""

    vocab: int

    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(self.vocab)(nn.Embed(self.vocab, 16)(tokens))


class NnxBigram(nnx.Module):
    def __init__(self, vocab: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, 16, rngs=rngs)
        self.head = nnx.Linear(
            16,
            vocab,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "vocab")),
            rngs=rngs,
        )

    def __call__(self, tokens):
        return self.head(self.embed(tokens))


class NnxWithRngs(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(256, 256, rngs=rngs)
        self.rngs = rngs  # an rng stream as state: not supported

    def __call__(self, tokens):
        return self.embed(tokens)


@pytest.fixture
def user_module(monkeypatch):
    """A user module importable as 'spmd_user_models' (as if on PYTHONPATH)."""
    module = types.ModuleType("spmd_user_models")
    module.linen_factory = lambda vocab=256, **_: Bigram(vocab)
    module.nnx_factory = lambda vocab=256, **_: lambda rngs: NnxBigram(vocab, rngs=rngs)
    module.model_factory = lambda **overrides: get("mlp", **overrides)
    module.wrong_vocab = lambda **_: Bigram(100)
    module.nnx_with_rngs = lambda **_: NnxWithRngs
    monkeypatch.setitem(sys.modules, "spmd_user_models", module)
    return module


def test_user_linen_factory_with_plain_params(user_module):
    model = get("spmd_user_models:linen_factory", vocab=64, seq_len=16)
    assert (model.name, model.kind, model.config.vocab, model.config.seq_len) == (
        "spmd_user_models:linen_factory",
        "linen",
        64,
        16,
    )
    shapes = flat(abstract(model))
    assert shapes["params/Embed_0/embedding"].shape == (64, 16)  # plain ShapeDtypeStructs, no boxes
    params = unbox(jax.jit(model.init)(jax.random.key(0)))
    batch = data.batch(0, 0, 4, 16, 64)
    logits, loss = jax.jit(lambda p, b: (model.apply(p, b["tokens"]), loss_fn(model)(p, b)))(params, batch)
    assert logits.shape == (4, 16, 64) and np.isfinite(loss)


def test_user_nnx_constructor(user_module):
    model = get("spmd_user_models:nnx_factory", vocab=32, seq_len=8)
    assert model.kind == "nnx"
    leaves = flat(abstract(model))
    assert leaves["params/head/kernel"].names == ("embed", "vocab")
    assert isinstance(leaves["params/head/bias"], jax.ShapeDtypeStruct)  # unannotated: a plain leaf
    params = unbox(jax.jit(model.init)(jax.random.key(0)))
    batch = data.batch(0, 0, 4, 8, 32)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn(model)))(params, batch)
    assert np.isfinite(loss) and jax.tree.structure(grads) == jax.tree.structure(params)


def test_user_factory_returning_a_model(user_module):
    model = get("spmd_user_models:model_factory", layers=2)
    assert model.name == "mlp"


def test_user_factory_errors(user_module):
    with pytest.raises(ValueError, match=r"has no attribute 'missing'"):
        get("spmd_user_models:missing")
    with pytest.raises(ValueError, match=r"expected float logits of shape \(2, 32, 256\)"):
        get("spmd_user_models:wrong_vocab")
    with pytest.raises(ValueError, match="only nnx.Param state"):
        get("spmd_user_models:nnx_with_rngs")
    with pytest.raises(TypeError, match="constructor"):
        models.from_module(NnxWithRngs(nnx.Rngs(0)), name="built", config=LMConfig())
