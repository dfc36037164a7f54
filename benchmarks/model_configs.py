"""Model configs the benchmarks build random-weight models from, written out so nothing is downloaded."""

from __future__ import annotations


def tiny(**fields) -> dict:
    """The CPU smoke tests' model: a few units wide and two layers deep, ``fields`` on top (vocabulary, head_dim,
    another width, ...)."""
    base = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    return {**base, **fields}


def decoder(sizes: tuple[int, int, int, int, int, int], **fields) -> dict:
    """A decoder's config fields: ``sizes``, the six every family names alike (hidden size, MLP width, layers,
    attention heads, key/value heads, vocabulary), then ``fields``, the family's own."""
    names = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    return {**dict(zip((*names, "vocab_size"), sizes)), **fields}


# The released configs (config.json of each hub repository) of the 7-9B models the multi-GPU benchmarks train,
# written out so nothing is downloaded (random weights are built from them).
RELEASED_CONFIGS: dict[str, dict] = {
    "llama-3.1-8b": decoder(
        (4096, 14336, 32, 32, 8, 128256),
        model_type="llama",
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "qwen2.5-7b": decoder(
        (3584, 18944, 28, 28, 4, 152064),
        model_type="qwen2",
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "gemma-2-9b": decoder(
        (3584, 14336, 42, 16, 8, 256000),
        model_type="gemma2",
        head_dim=256,
        rms_norm_eps=1e-6,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        hidden_activation="gelu_pytorch_tanh",
    ),
}
