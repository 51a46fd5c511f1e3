"""Plain models, with no parallel code inside: the dense LLaMA-style model here; the mixture of
experts in ``minitp.models.moe``; the GPT-2-style family (biases, LayerNorm, learned positions, a
tied output layer) in ``minitp.models.gpt2``; synthetic data, the optimizer and the one-process
reference in ``minitp.models.train``."""

from minitp.models.llama import (  # noqa: F401  (re-exported: the dense model)
    BYTE,
    LLAMA3_8B,
    LLAMA3_70B,
    PRESETS,
    TINY,
    Attention,
    FeedForward,
    KVCache,
    ModelConfig,
    RMSNorm,
    Transformer,
    TransformerBlock,
    build_model,
    generate,
    get_config,
    greedy_token,
    loss_fn,
    rms_norm,
)
