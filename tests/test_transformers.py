"""Third-party models: HuggingFace transformers' Flax classes, from tiny configs with random weights, trained
under spmd plans exactly as the README says for a model whose code you do not own (the module's ``apply`` on a
parameter tree), and the layouts ``strategies.tensor_parallel()`` recognises in their real parameter trees."""

import functools
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import transformers
from jax.sharding import PartitionSpec as P

import spmd
import strategies
from spmd import data
from tests.conftest import assert_trees_close

# transformers 4.57 logs, on the first Flax model built, that its Flax classes are deprecated: noise here.
logging.getLogger("transformers.modeling_flax_utils").addFilter(
    lambda record: "TensorFlow and JAX classes are deprecated" not in record.getMessage()
)

VOCAB, SEQ, BATCH = 64, 16, 8


def _tiny(family, layers=2):
    """A tiny HF model object of ``family``, its weights not created yet (``_do_init=False``: ``init_weights``
    creates them, sharded, inside the training step's init)."""
    T = transformers
    gqa = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    bert = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=64)
    built = {
        "bert": lambda: T.FlaxBertForMaskedLM(T.BertConfig(**bert), _do_init=False),
        "roberta": lambda: T.FlaxRobertaForMaskedLM(T.RobertaConfig(**bert), _do_init=False),
        "vit": lambda: T.FlaxViTModel(
            T.ViTConfig(image_size=8, patch_size=4, **{k: v for k, v in bert.items() if k != "vocab_size"}),
            _do_init=False,
        ),
        "gpt2": lambda: T.FlaxGPT2LMHeadModel(
            T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=SEQ), _do_init=False
        ),
        "t5": lambda: T.FlaxT5ForConditionalGeneration(
            T.T5Config(
                vocab_size=VOCAB,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=layers,
                num_heads=4,
                feed_forward_proj="gated-gelu",
            ),
            _do_init=False,
        ),
        "llama": lambda: T.FlaxLlamaForCausalLM(
            T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, **gqa), _do_init=False
        ),
        "mistral": lambda: T.FlaxMistralForCausalLM(
            T.MistralConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, **gqa), _do_init=False
        ),
        "gpt_neo": lambda: T.FlaxGPTNeoForCausalLM(
            T.GPTNeoConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_layers=layers,
                attention_types=[[["global"], layers]],
                num_heads=4,
                intermediate_size=128,
                max_position_embeddings=SEQ,
            ),
            _do_init=False,
        ),
        "gptj": lambda: T.FlaxGPTJForCausalLM(
            T.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, rotary_dim=4, n_positions=SEQ),
            _do_init=False,
        ),
        "opt": lambda: T.FlaxOPTForCausalLM(
            T.OPTConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=layers,
                num_attention_heads=4,
                ffn_dim=128,
                word_embed_proj_dim=32,
                max_position_embeddings=SEQ,
            ),
            _do_init=False,
        ),
        "bart": lambda: T.FlaxBartForConditionalGeneration(
            T.BartConfig(
                vocab_size=VOCAB,
                d_model=32,
                encoder_layers=layers,
                decoder_layers=layers,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=SEQ,
            ),
            _do_init=False,
        ),
        "clip": lambda: T.FlaxCLIPTextModel(
            T.CLIPTextConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=layers,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=SEQ,
            ),
            _do_init=False,
        ),
        "gemma": lambda: T.FlaxGemmaForCausalLM(
            T.GemmaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=layers,
                head_dim=8,
                hidden_activation="gelu_pytorch_tanh",
                **gqa,
            ),
            _do_init=False,
        ),
    }
    return built[family]()


def _init(hf):
    """``key -> params``: the model's own initialiser (the HF object's ``.params`` come from it)."""
    return functools.partial(hf.init_weights, input_shape=hf.input_shape)


def _loss(family, module):
    """Next-token (causal LMs, T5's decoder) or same-token (masked LMs) cross-entropy of ``module.apply`` on the
    parameters."""

    def loss(params, batch):
        tokens = batch["tokens"]
        ones, positions = jnp.ones_like(tokens), jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        if family in ("bert", "roberta"):
            logits = module.apply({"params": params}, tokens, ones, jnp.zeros_like(tokens), positions, None).logits
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()
        if family == "t5":  # the encoder reads the tokens, the decoder predicts each next one
            logits = module.apply({"params": params}, tokens, ones, tokens, ones).logits
        else:
            logits = module.apply({"params": params}, tokens, ones, positions).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    return loss


def _train_against_one_device(family, plan, axes, *, steps=2, layers=1):
    """``steps`` SGD-with-momentum steps under ``plan`` on a mesh of ``axes`` and on one device: the sharded
    state, the step and the plan warnings it raised. Losses are compared at every step."""
    hf = _tiny(family, layers)
    init, loss = _init(hf), _loss(family, hf.module)
    params = jax.eval_shape(init, jax.random.key(0))
    tx = optax.sgd(0.1, momentum=0.9)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", spmd.PlanWarning)
        step = spmd.TrainStep(loss, tx, plan, spmd.make_mesh(axes), params=params)
    state = step.init(init, jax.random.key(0))
    one = spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    ref_step = spmd.TrainStep(loss, tx, spmd.Plan(), one, params=params)
    ref = ref_step.init(init, jax.random.key(0))
    for i in range(steps):
        batch = data.batch(0, i, BATCH, SEQ, VOCAB)
        state, a = step(state, batch)
        ref, b = ref_step(ref, batch)
        np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
    assert_trees_close(state.params, ref.params)
    assert_trees_close(state.opt_state, ref.opt_state)
    return state, step, [str(w.message) for w in seen if issubclass(w.category, spmd.PlanWarning)]


def _said_by_tensor_parallel(messages):
    return [m for m in messages if "tensor_parallel" in m]


@pytest.mark.slow
def test_llama_trains_under_fsdp_and_tensor_parallel_like_one_device():
    plan = strategies.fsdp(min_bytes=0) + strategies.tensor_parallel()
    state, step, said = _train_against_one_device("llama", plan, {"fsdp": 4, "tensor": 2})
    layer = state.params["model"]["layers"]["0"]
    assert layer["self_attn"]["q_proj"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert layer["self_attn"]["k_proj"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert layer["self_attn"]["o_proj"]["kernel"].sharding.spec == P("tensor", "fsdp")
    assert layer["mlp"]["gate_proj"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert layer["mlp"]["down_proj"]["kernel"].sharding.spec == P("tensor", "fsdp")
    assert _said_by_tensor_parallel(said) == []


@pytest.mark.slow
def test_bert_trains_under_fsdp_like_one_device():
    state, step, said = _train_against_one_device("bert", strategies.fsdp(min_bytes=0), {"fsdp": 8})
    specs = [x.sharding.spec for x in jax.tree.leaves(state.params)]
    assert all("fsdp" in spec for spec in specs), specs  # every array split, none left whole
    assert said == []


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "gpt2", "mistral"])
def test_more_families_train_under_fsdp_and_tensor_parallel_like_one_device(family):
    plan = strategies.fsdp(min_bytes=0) + strategies.tensor_parallel()
    _, step, said = _train_against_one_device(family, plan, {"fsdp": 4, "tensor": 2}, layers=2)
    assert any("tensor" in str(r.spec) for r in step.layout.params.leaves)
    assert _said_by_tensor_parallel(said) == []


@pytest.mark.slow
def test_t5_trains_under_fsdp_and_tensor_parallel_like_one_device(clip_with_a_max):
    plan = strategies.fsdp(min_bytes=0) + strategies.tensor_parallel()
    state, _, said = _train_against_one_device("t5", plan, {"fsdp": 4, "tensor": 2}, layers=2)
    block = state.params["decoder"]["block"]["0"]["layer"]
    assert block["1"]["EncDecAttention"]["q"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert block["2"]["DenseReluDense"]["wo"]["kernel"].sharding.spec == P("tensor", "fsdp")
    assert _said_by_tensor_parallel(said) == []


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_more_families_train_under_fsdp_like_one_device(family):
    _, _, said = _train_against_one_device(family, strategies.fsdp(min_bytes=0), {"fsdp": 8}, layers=2)
    assert said == []


# Per family: the layers (by the end of their path) tensor parallelism splits column-wise (output features,
# bias with them) and row-wise (input features, bias whole), and how their kernels are stored.
FAMILIES = {
    "bert": (("attention/self/query", "attention/self/key", "attention/self/value", "intermediate/dense"),
             ("attention/output/dense", "output/dense"), "in_out", 2 * 6),
    "roberta": (("attention/self/query", "attention/self/key", "attention/self/value", "intermediate/dense"),
                ("attention/output/dense", "output/dense"), "in_out", 2 * 6),
    "vit": (("attention/attention/query", "attention/attention/key", "attention/attention/value",
             "intermediate/dense"), ("attention/output/dense", "output/dense"), "in_out", 2 * 6),
    "gpt2": (("attn/c_attn", "mlp/c_fc"), ("attn/c_proj", "mlp/c_proj"), "out_in", 2 * 4),
    "t5": (("SelfAttention/q", "SelfAttention/k", "SelfAttention/v", "EncDecAttention/q", "EncDecAttention/k",
            "EncDecAttention/v", "DenseReluDense/wi_0", "DenseReluDense/wi_1"),
           ("SelfAttention/o", "EncDecAttention/o", "DenseReluDense/wo"), "in_out", 2 * 7 + 2 * 11),
    "llama": (("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj"), "in_out", 2 * 7),
    "mistral": (("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj"), "in_out", 2 * 7),
    "gemma": (("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj"), "in_out", 2 * 7),
    # GPT-Neo names its nn.Dense MLP as GPT-2 names its Conv1D one: [in, out], read from the shape.
    "gpt_neo": (("q_proj", "k_proj", "v_proj", "mlp/c_fc"), ("out_proj", "mlp/c_proj"), "in_out", 2 * 6),
    "gptj": (("q_proj", "k_proj", "v_proj", "fc_in"), ("out_proj", "fc_out"), "in_out", 2 * 6),
    "opt": (("q_proj", "k_proj", "v_proj", "fc1"), ("out_proj", "fc2"), "in_out", 2 * 6),
    "bart": (("q_proj", "k_proj", "v_proj", "fc1"), ("out_proj", "fc2"), "in_out", 2 * 6 + 2 * 10),
    "clip": (("q_proj", "k_proj", "v_proj", "fc1"), ("out_proj", "fc2"), "in_out", 2 * 6),
}  # fmt: skip


def _expected(path, column, row, orientation):
    layer, _, kind = ("/" + path).rpartition("/")
    is_column = any(layer.endswith("/" + name) for name in column)
    is_row = any(layer.endswith("/" + name) for name in row)
    if kind == "bias":
        return P("tensor") if is_column else P(None)
    if kind != "kernel" or not (is_column or is_row):
        return None  # replicated over tensor
    on_out = is_column
    return P("tensor", None) if on_out == (orientation == "out_in") else P(None, "tensor")


@pytest.fixture
def clip_with_a_max(monkeypatch):
    """T5's Flax code calls ``jnp.clip(x, a_max=...)``, which JAX 0.10 no longer accepts: the model cannot be built
    on this JAX at all (with or without spmd), so its parameter tree is read with the old keyword restored."""
    clip = jnp.clip

    def old_clip(x, a_min=None, a_max=None, *, min=None, max=None):
        return clip(x, a_min if min is None else min, a_max if max is None else max)

    monkeypatch.setattr(jnp, "clip", old_clip)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tensor_parallel_splits_every_attention_and_mlp_matmul_of_real_param_trees(family, request):
    if family == "t5":
        request.getfixturevalue("clip_with_a_max")
    column, row, orientation, matmuls = FAMILIES[family]
    hf = _tiny(family)
    params = jax.eval_shape(_init(hf), jax.random.key(0))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", spmd.PlanWarning)
        layout = strategies.tensor_parallel().resolve(params, {"tensor": 2})
    assert [str(w.message) for w in seen] == []  # every column layer found its row partner
    split = 0
    for leaf in layout.leaves:
        want = _expected(leaf.path, column, row, orientation)
        if want is None:
            assert "tensor" not in str(leaf.spec), leaf.path
            continue
        assert leaf.spec == P(*want, *[None] * (len(leaf.shape) - len(want))), (leaf.path, leaf.spec)
        split += leaf.path.endswith("kernel")
    assert split == matmuls
