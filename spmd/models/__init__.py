"""Language models for spmd, behind one handle: :class:`Model` maps int32 tokens to logits.

Every model maps int32 tokens ``[batch, seq]`` to float logits ``[batch, seq, vocab]`` and is handled
through a :class:`Model`:

- ``model.init(key)`` -> the *annotated* parameter tree: a plain nested dict ``{"params": {...}}`` whose
  annotated leaves are flax ``nn.LogicallyPartitioned(value, names)`` boxes (one logical axis name per
  dimension, e.g. ``("embed", "mlp")``; stacked layers start with ``"layers"``) and whose other leaves are
  plain arrays. ``init`` is pure, so ``jax.eval_shape(model.init, key)`` gives shapes and names without
  allocating anything, and ``jax.jit(model.init, out_shardings=...)`` creates parameters already in place.
  nnx models are converted to this same form (names from each Variable's ``out_sharding`` metadata).
- ``model.apply(params, tokens)`` -> logits, with ``params`` the same tree with boxes replaced by their
  values (:func:`unbox`); boxed trees are accepted too.
- :func:`loss_fn` gives the mean next-token cross-entropy in float32.

Built-in models (:data:`BUILTIN`, by name through :func:`get`; keyword overrides are :class:`LMConfig`
fields): ``"mlp"`` (per-token MLP), ``"gpt-tiny"`` / ``"gpt-tiny-nnx"`` (8 layers, d_model 64, 4 heads,
mlp 256, vocab 256, seq 32) and ``"gpt-small"`` / ``"gpt-small-nnx"`` (8 layers, d_model 512, 8 heads,
mlp 2048, vocab 8192, seq 128; about 34M parameters, three quarters of them in the blocks), ``"cnn-tiny"``
(a causal convolutional LM: 8 residual blocks of width-3 convolutions into 256 channels, :mod:`spmd.models.conv`)
and ``"moe-tiny"``.

Your own model: ``get("package.module:factory", **overrides)`` (the CLI's ``--model package.module:factory``)
imports ``package.module`` and calls ``factory(**overrides)``, which returns one of

1. a :class:`spmd.models.Model` - used as is;
2. a flax linen ``nn.Module`` instance mapping int32 tokens ``[batch, seq]`` to logits
   ``[batch, seq, vocab]``; its params may be annotated (``nn.with_logical_partitioning``) or plain arrays
   (a plan then decides their layout by shape alone). It must need no collection and no rng but
   ``"params"``;
3. a callable ``(rngs: nnx.Rngs) -> nnx.Module`` (e.g. the module class, or ``lambda rngs: MyLM(cfg,
   rngs=rngs)``) building an nnx module with the same token -> logits contract, whose state is all
   ``nnx.Param`` (annotate with ``nnx.with_partitioning``). It is built under
   ``nnx.use_eager_sharding(False)`` and must be traceable (``nnx.eval_shape``): no Python decisions on
   random values.

Cases 2 and 3 are wrapped with :func:`from_module`, which reads ``vocab`` and ``seq_len`` (used to check
the output shape and to make example tokens) from the overrides, else from :class:`LMConfig`'s defaults.

>>> import jax
>>> model = get("gpt-tiny", layers=2)
>>> params = jax.eval_shape(model.init, jax.random.key(0))  # shapes and names, nothing allocated
>>> params["params"]["layers"]["mlp"]["wi"]["kernel"].names
('layers', 'embed', 'mlp')
>>> tokens = jax.ShapeDtypeStruct((4, 32), jax.numpy.int32)
>>> jax.eval_shape(model.apply, unbox(params), tokens).shape
(4, 32, 256)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import nnx

from spmd import axes as A
from spmd._context import constrain
from spmd._pipeline import StagedModel
from spmd._remat import NAMES as REMAT_NAMES
from spmd._remat import Remat
from spmd._tree import unbox
from spmd.models.config import LMConfig
from spmd.models.nnx_module import nnx_module, split_params

__all__ = [
    "BUILTIN",
    "LMConfig",
    "NeedsMesh",
    "Model",
    "from_module",
    "get",
    "loss_fn",
    "narrowed",
    "next_token_loss",
    "rematerialised",
    "unbox",
]


@dataclasses.dataclass(frozen=True)
class Model:
    """A language model: int32 tokens ``[batch, seq]`` -> logits ``[batch, seq, vocab]``.

    Attributes:
        name: registry name (or ``"package.module:factory"`` for a user model).
        kind: ``"linen"`` or ``"nnx"``: which flax API the model is written in.
        config: sizes; for user modules only ``vocab`` and ``seq_len`` are meaningful.
        init: rng key -> annotated params tree (see the module docstring); pure and ``eval_shape``-able.
        apply: (params, tokens) -> logits; params unboxed (boxed also accepted).
        staged: the model cut for pipeline parallelism (embeddings, one stacked layer, head and loss), for
            models that have one (the built-in GPTs, linen and nnx); None otherwise.

    >>> model = get("gpt-tiny", layers=2)
    >>> model.kind, model.config.vocab, model.staged is not None
    ('linen', 256, True)
    """

    name: str
    kind: str
    config: LMConfig
    init: Callable[[jax.Array], Any]
    apply: Callable[[Any, jax.Array], jax.Array]
    staged: StagedModel | None = None


def loss_fn(model: Model) -> Callable[[Any, Mapping[str, jax.Array]], jax.Array]:
    """``loss(params, batch)``: mean next-token cross-entropy of ``model`` in float32.

    ``batch["tokens"]`` is int32 ``[batch, seq]``; logits at positions ``0..seq-2`` are scored against the
    tokens at ``1..seq-1``.

    >>> import numpy as np
    >>> from spmd import data
    >>> model = get("mlp")
    >>> params = unbox(jax.jit(model.init)(jax.random.key(0)))
    >>> loss = jax.jit(loss_fn(model))(params, data.batch(0, 0, 8, 32, 256))
    >>> bool(abs(loss - np.log(256)) < 0.5)  # untrained: close to uniform over the vocabulary
    True
    """

    def loss(params: Any, batch: Mapping[str, jax.Array]) -> jax.Array:
        return next_token_loss(model.apply(params, batch["tokens"]), batch["tokens"])

    return loss


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits[:, t]`` against ``tokens[:, t + 1]``, in float32. A token id outside
    the vocabulary (``[0, logits.shape[-1])``) makes the loss NaN: embedding lookups and labels clamp such ids
    to a plausible loss, which a non-finite guard (``--on-nan``, ``TrainStep(skip_nonfinite=True)``) catches.

    >>> loss = jax.jit(next_token_loss)(jnp.zeros((2, 5, 4)), jnp.zeros((2, 5), jnp.int32))
    >>> round(float(loss), 4)  # uniform logits over a vocabulary of 4: log 4
    1.3863
    >>> float(next_token_loss(jnp.zeros((1, 2, 4)), jnp.array([[0, 4]])))  # id 4 of a vocabulary of 4
    nan
    """
    # The full sequence goes through the model and is scored whole (so seq keeps its size for sharding): each
    # position against the next token, the last position (no target) weighed zero. The tokens are whole along
    # the sequence here (small integers), so the shift is local even where the plan splits the sequence: a
    # shifted slice of a split sequence would be a collective-permute inside the pipeline's per-device branch.
    tokens = constrain(tokens, (A.BATCH, None))
    targets = constrain(jnp.roll(tokens, -1, axis=1), (A.BATCH, None))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    outside = lambda t: (t < 0) | (t >= logits.shape[-1])  # noqa: E731
    last = jnp.arange(tokens.shape[1]) == tokens.shape[1] - 1
    # Marked per position, so the NaN travels through the sum's own reduction: no collective of its own.
    losses = jnp.where(last, 0.0, jnp.where(outside(tokens) | outside(targets), jnp.nan, losses))
    return losses.sum() / float(tokens.shape[0] * (tokens.shape[1] - 1))  # a float: a count may pass int32


def _example_tokens(config: LMConfig) -> jax.Array:
    return jnp.zeros((1, config.seq_len), jnp.int32)


def _from_linen(module: nn.Module, name: str, config: LMConfig) -> Model:
    def init(rng: jax.Array) -> Any:
        variables = flax.core.unfreeze(module.init({"params": rng}, _example_tokens(config)))
        extra = sorted(set(variables) - {"params"})
        if extra:
            raise ValueError(
                f"model {name!r}: init created variable collections {extra} besides 'params'; spmd models "
                "must be stateless apart from their params (no batch_stats, caches, ...)"
            )
        return dict(variables)

    def apply(params: Any, tokens: jax.Array) -> jax.Array:
        # Unbox first: linen would otherwise unbox through nn.meta.unbox and add sharding constraints.
        return module.apply(unbox(params), tokens)

    return Model(name=name, kind="linen", config=config, init=init, apply=apply)


def _names(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    metadata = variable.get_metadata()
    # flax 0.12 stores nnx.with_partitioning's names as out_sharding; older releases used sharding(_names).
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = metadata.get(key)
        if names:
            return tuple(names)
    return None


def _from_nnx(build: Callable[[nnx.Rngs], nnx.Module], name: str, config: LMConfig) -> Model:
    def construct(rng: jax.Array) -> nnx.Module:
        # A default stream serves every stream name a module may ask for (params, dropout, ...).
        with nnx.use_eager_sharding(False):
            module = build(nnx.Rngs(rng))
        if not isinstance(module, nnx.Module):
            raise TypeError(f"model {name!r}: the nnx constructor returned {type(module).__name__}, not an nnx.Module")
        return module

    # Graph structure and abstract params once, from shapes only; init and apply reuse them.
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: construct(jax.random.key(0)))
    graphdef, abstract_params = split_params(
        abstract, f"model {name!r}", "spmd nnx models must hold only nnx.Param state"
    )
    abstract_flat = list(nnx.to_flat_state(abstract_params))

    def init(rng: jax.Array) -> Any:
        params = nnx.state(construct(rng), nnx.Param)
        tree: dict = {}
        for path, variable in nnx.to_flat_state(params):
            value = variable.get_value()
            names = _names(variable)
            node = tree
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = nn.LogicallyPartitioned(value, names) if names is not None else value
        return {"params": tree}

    def apply(params: Any, tokens: jax.Array) -> jax.Array:
        return nnx_module(graphdef, abstract_flat, unbox(params)["params"])(tokens)

    return Model(name=name, kind="nnx", config=config, init=init, apply=apply)


class NeedsMesh(ValueError):
    """A model constrains a layout by a bare ``PartitionSpec`` and was traced without a context mesh.

    >>> issubclass(NeedsMesh, ValueError)
    True
    """


def _check_contract(model: Model) -> None:
    """Traces (never runs) init and apply: a user model that breaks the contract fails early and clearly."""
    c = model.config
    tokens = jax.ShapeDtypeStruct((2, c.seq_len), jnp.int32)
    try:
        params = jax.eval_shape(model.init, jax.random.key(0))
        logits = jax.eval_shape(model.apply, unbox(params), tokens)
    except RuntimeError as e:
        if "non-empty mesh" not in str(e) or not jax.sharding.get_abstract_mesh().empty:
            raise
        raise NeedsMesh(
            f"model {model.name!r} constrains a layout by a bare PartitionSpec, which needs a context mesh to be "
            "traced: build it under spmd.activate(plan, mesh) (or jax.set_mesh(mesh)), or pass check=False"
        ) from e
    expected = (2, c.seq_len, c.vocab)
    if getattr(logits, "shape", None) != expected or not jnp.issubdtype(logits.dtype, jnp.floating):
        got = getattr(logits, "shape", type(logits).__name__)
        raise ValueError(
            f"model {model.name!r}: int32 tokens of shape {tokens.shape} gave {got}, expected float logits "
            f"of shape {expected} (vocab={c.vocab}, seq_len={c.seq_len}; override them if yours differ)"
        )


def from_module(module: Any, *, name: str, config: LMConfig, check: bool = True) -> Model:
    """Wraps a linen module instance, or an nnx constructor ``(rngs) -> nnx.Module``, as a :class:`Model`.

    ``config.seq_len`` sets the example tokens used for init and ``config.vocab`` the logits width that
    ``check`` (tracing init and apply on shapes only) verifies.

    >>> class Bigram(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, tokens):
    ...         return nn.Embed(256, 256)(tokens)
    >>> model = from_module(Bigram(), name="bigram", config=LMConfig())
    >>> model.kind, jax.eval_shape(model.init, jax.random.key(0))["params"]["Embed_0"]["embedding"].shape
    ('linen', (256, 256))
    """
    if isinstance(module, nn.Module):
        model = _from_linen(module, name, config)
    elif isinstance(module, nnx.Module):
        raise TypeError(
            f"model {name!r}: got a built nnx.Module; give a constructor instead, e.g. "
            f"`lambda rngs: {type(module).__name__}(..., rngs=rngs)`, so spmd can create (and place) fresh "
            "parameters from a key"
        )
    elif callable(module):
        model = _from_nnx(module, name, config)
    else:
        raise TypeError(
            f"model {name!r}: expected a flax linen nn.Module instance or a callable (rngs) -> nnx.Module, "
            f"got {type(module).__name__}"
        )
    if check:
        _check_contract(model)
    return model


_FIELDS = tuple(f.name for f in dataclasses.fields(LMConfig))


def _config(name: str, defaults: LMConfig, overrides: Mapping[str, Any]) -> LMConfig:
    unknown = sorted(set(overrides) - set(_FIELDS))
    if unknown:
        raise ValueError(f"model {name!r}: unknown option(s) {unknown}; LMConfig fields are {list(_FIELDS)}")
    return dataclasses.replace(defaults, **overrides)


TINY = LMConfig()
SMALL = LMConfig(vocab=8192, seq_len=128, d_model=512, heads=8, mlp=2048, layers=8)


def _linen_factory(name: str, defaults: LMConfig, make: Callable[[LMConfig], nn.Module]) -> Callable[..., Model]:
    def factory(**overrides: Any) -> Model:
        config = _config(name, defaults, overrides)
        return from_module(make(config), name=name, config=config, check=False)

    factory.__doc__ = f"The built-in {name!r} model (linen); keyword overrides are LMConfig fields."
    return factory


def _nnx_factory(name: str, defaults: LMConfig) -> Callable[..., Model]:
    def factory(**overrides: Any) -> Model:
        from spmd.models import gpt_nnx

        config = _config(name, defaults, overrides)
        model = from_module(lambda rngs: gpt_nnx.GPT(config, rngs=rngs), name=name, config=config, check=False)
        return dataclasses.replace(model, staged=gpt_nnx.staged(config, next_token_loss))

    factory.__doc__ = f"The built-in {name!r} model (nnx); keyword overrides are LMConfig fields."
    return factory


def _gpt(config: LMConfig) -> nn.Module:
    from spmd.models.gpt import GPT

    return GPT(config)


def _gpt_model(name: str, config: LMConfig) -> Model:
    from spmd.models import gpt

    model = from_module(_gpt(config), name=name, config=config, check=False)
    return dataclasses.replace(model, staged=gpt.staged(config, next_token_loss))


def _gpt_factory(name: str, defaults: LMConfig) -> Callable[..., Model]:
    def factory(**overrides: Any) -> Model:
        return _gpt_model(name, _config(name, defaults, overrides))

    factory.__doc__ = f"The built-in {name!r} model (linen); keyword overrides are LMConfig fields."
    return factory


# Per family of built-in models that can be narrowed: each logical dimension a subnetwork can narrow, and the
# LMConfig field it is.
NARROWABLE = {
    "gpt": {A.LAYERS: "layers", A.MLP: "mlp", A.HEADS: "heads"},
    "cnn": {A.LAYERS: "layers", A.CHANNELS: "mlp"},
}


def narrowed(model: Model, sizes: Mapping[str, int]) -> Model:
    """``model`` with logical dimensions narrowed (a subnetwork keeping some blocks, hidden units, heads or
    convolution channels): ``sizes`` maps a name of :data:`NARROWABLE` to the number kept. Heads keep their width.

    >>> narrowed(get("gpt-tiny"), {"mlp": 128, "heads": 2}).config.head_dim
    16
    >>> narrowed(get("cnn-tiny"), {"channels": 64}).config.mlp
    64
    """
    family = model.name.split("-")[0]
    if model.kind != "linen" or family not in NARROWABLE or model.name not in BUILTIN:
        raise ValueError(
            f"model {model.name!r} cannot be narrowed to a subnetwork; the built-in linen GPTs (gpt-tiny, gpt-small) "
            f"and cnn-tiny can"
        )
    unknown = sorted(set(sizes) - set(NARROWABLE[family]))
    if unknown:
        raise ValueError(f"narrowed: cannot narrow {unknown} of {model.name}; choose from {sorted(NARROWABLE[family])}")
    fields = {NARROWABLE[family][k]: int(v) for k, v in sizes.items()}
    if family == "cnn":
        config = dataclasses.replace(model.config, **fields)
        return from_module(_cnn(config), name=model.name, config=config, check=False)
    config = dataclasses.replace(model.config, head_size=model.config.head_dim, **fields)
    return _gpt_model(model.name, config)


def rematerialised(model: Model, policy: Remat | str | bool = True) -> Model:
    """A built-in ``model`` whose layers and head follow the remat ``policy`` (a :class:`spmd.Remat`, or what
    :meth:`spmd.Remat.of` reads; ``True``: ``full``), with the same parameters: what a plan's ``remat`` asks.

    >>> rematerialised(get("gpt-tiny", layers=2), "dots").config.remat
    Remat(kind='dots', names=())
    >>> rematerialised(get("gpt-tiny", layers=2), "names:mlp_hiden")
    Traceback (most recent call last):
    ...
    ValueError: remat policy names:mlp_hiden: the built-in models tag no activation 'mlp_hiden'; they tag ...
    """
    if model.name not in BUILTIN:
        raise ValueError(f"model {model.name!r} is not built in: rematerialise its layers in its own code")
    policy = Remat.of(policy)
    unknown = [name for name in policy.names if name not in REMAT_NAMES]
    if unknown:  # a name no activation carries would keep nothing, silently the same as full remat
        raise ValueError(
            f"remat policy {policy.kind}:{','.join(policy.names)}: the built-in models tag no activation "
            f"{', '.join(map(repr, unknown))}; they tag {', '.join(REMAT_NAMES)}"
        )
    fields = {f.name: getattr(model.config, f.name) for f in dataclasses.fields(LMConfig)}
    return BUILTIN[model.name](**(fields | {"remat": policy}))


def _mlp(config: LMConfig) -> nn.Module:
    from spmd.models.mlp import MlpLM

    return MlpLM(config)


def _cnn(config: LMConfig) -> nn.Module:
    from spmd.models.conv import ConvLM

    return ConvLM(config)


BUILTIN: dict[str, Callable[..., Model]] = {
    "mlp": _linen_factory("mlp", TINY, _mlp),
    "cnn-tiny": _linen_factory("cnn-tiny", TINY, _cnn),
    "gpt-tiny": _gpt_factory("gpt-tiny", TINY),
    "gpt-tiny-nnx": _nnx_factory("gpt-tiny-nnx", TINY),
    "gpt-small": _gpt_factory("gpt-small", SMALL),
    "gpt-small-nnx": _nnx_factory("gpt-small-nnx", SMALL),
    "moe-tiny": _linen_factory("moe-tiny", TINY, lambda c: importlib.import_module("spmd.models.moe").MoeGPT(c)),
}


def _user_factory(spec: str) -> Callable[..., Any]:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--model {spec!r}: expected a built-in name or 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any failure while importing user code (ImportError, SyntaxError, ...)
        raise ValueError(
            f"could not import {module_name!r} for --model {spec!r}: {type(e).__name__}: {e}; "
            "check that it is installed or on PYTHONPATH (e.g. run from the directory that contains it)"
        ) from e
    try:
        factory = functools.reduce(getattr, attribute.split("."), module)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise ValueError(
            f"module {module_name!r} has no attribute {attribute!r} (for --model {spec!r}); it defines {public[:20]}"
        ) from None
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {attribute!r} is a {type(factory).__name__}, not a callable")
    return factory


def get(name: str, **overrides: Any) -> Model:
    """The model called ``name``: a :data:`BUILTIN` name, or ``"package.module:factory"`` (module docstring).

    ``overrides`` are :class:`LMConfig` fields for built-ins (e.g. ``layers=4``); a user factory receives
    them all as keyword arguments.

    >>> get("gpt-tiny", layers=2).config.layers
    2
    >>> get("gpt-huge")
    Traceback (most recent call last):
    ...
    ValueError: unknown model 'gpt-huge'; known models: cnn-tiny, gpt-small, gpt-small-nnx, gpt-tiny, gpt-tiny-nnx, mlp, moe-tiny, or 'package.module:factory' for your own
    """  # noqa: E501
    if name in BUILTIN:
        return BUILTIN[name](**overrides)
    if ":" not in name:
        raise ValueError(
            f"unknown model {name!r}; known models: {', '.join(sorted(BUILTIN))}, "
            "or 'package.module:factory' for your own"
        )
    factory = _user_factory(name)
    try:
        result = factory(**overrides)
    except Exception as e:  # noqa: BLE001 - the user's code: say where it failed, in one line
        takes = f" with {', '.join(f'{k}={v!r}' for k, v in overrides.items())}" if overrides else ""
        raise ValueError(
            f"--model {name!r}: calling the factory{takes} failed ({type(e).__name__}: {e}); a factory takes the "
            f"LMConfig fields it is given as keyword arguments and returns a flax module or an spmd Model"
        ) from e
    if isinstance(result, Model):
        return result
    config = LMConfig(**{k: v for k, v in overrides.items() if k in _FIELDS})
    try:
        return from_module(result, name=name, config=config)
    except TypeError as e:
        raise ValueError(f"--model {name!r}: the factory returned the wrong thing: {e}") from e
