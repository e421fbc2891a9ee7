"""Logical axis names: what models call their arrays' dimensions, and what plans map to mesh axes.

Models annotate parameters and activations with these names (``nn.with_logical_partitioning(init, (EMBED,
MLP))``, ``spmd.constrain(x, (BATCH, SEQ, EMBED))``); strategies map them to mesh axes (``(MLP, "tensor")``). The
cost model does not depend on these words: it reads what a weight does from its shape and layout, whatever a model
calls its dimensions. Execution modes prepend their own names to the arrays they store: a pipeline ``(STAGE,
CHUNK, LAYERS, ...)``, subnetwork data parallelism ``(WORKER, ...)``.

>>> from spmd import axes
>>> (axes.EMBED, axes.MLP), axes.STACKING
(('embed', 'mlp'), ('stage', 'chunk', 'layers'))
"""

__all__ = [
    "BATCH",
    "CHANNELS",
    "CHUNK",
    "EMBED",
    "EXPERT",
    "HEADS",
    "HEAD_DIM",
    "LAYERS",
    "MLP",
    "NEURONS",
    "POSITION",
    "SEQ",
    "STACKING",
    "STAGE",
    "VOCAB",
    "WIDTH",
    "WORKER",
]

# Activations
BATCH = "batch"  # a batch's leading dimension: always the plan's batch axes
SEQ = "seq"  # sequence positions (sequence parallelism splits them)

# Weights (and the activations they produce)
EMBED = "embed"  # the residual stream's width
MLP = "mlp"  # an MLP's hidden units
HEADS = "heads"  # attention heads
HEAD_DIM = "head_dim"  # one head's width
VOCAB = "vocab"  # the vocabulary (embedding rows, logits)
POSITION = "position"  # learned position embeddings' rows
CHANNELS = "channels"  # convolution channels
WIDTH = "width"  # a convolution kernel's taps
EXPERT = "expert"  # a mixture-of-experts layer's experts
LAYERS = "layers"  # stacked (scanned) layers

# Added by execution modes to the arrays they store
STAGE = "stage"  # a pipeline's stage device, split over the pipeline axis
CHUNK = "chunk"  # a pipeline device's chunk (virtual stage)
WORKER = "worker"  # a subnetwork worker's own copy of the part it owns, split over the data axis

STACKING = (STAGE, CHUNK, LAYERS)  # leading dimensions that stack layers rather than hold a layer's values
NEURONS = (MLP, HEADS, CHANNELS)  # the dimensions subnetworks cut into neuron groups
