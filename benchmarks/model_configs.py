"""Model configs the benchmarks build random-weight models from, written out so nothing is downloaded."""

from __future__ import annotations


def tiny(**fields) -> dict:
    """The CPU smoke tests' model: a few units wide and two layers deep, ``fields`` on top (vocabulary, head_dim,
    another width, ...)."""
    base = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    return {**base, **fields}


# The released configs (config.json of each hub repository) of the 7-9B models the multi-GPU benchmarks train,
# written out so nothing is downloaded (random weights are built from them).
RELEASED_CONFIGS: dict[str, dict] = {
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
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
    "qwen2.5-7b": dict(
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "gemma-2-9b": dict(
        model_type="gemma2",
        hidden_size=3584,
        intermediate_size=14336,
        num_hidden_layers=42,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        vocab_size=256000,
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
