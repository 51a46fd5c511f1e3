"""Plain models (no parallel code inside), synthetic data and the one-process reference."""

from minitp.models.llama import (
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
from minitp.models.moe import (
    MIXTRAL_8X7B,
    MOE_PRESETS,
    TINY_MOE,
    MoEConfig,
    MoEFeedForward,
    Routing,
    build_moe_model,
    moe_config,
    moe_loss,
)
from minitp.models.train import TrainConfig, make_optimizer, synthetic_batches, train_reference

__all__ = [
    "ModelConfig", "TINY", "LLAMA3_8B", "LLAMA3_70B", "PRESETS", "get_config",
    "RMSNorm", "rms_norm", "Attention", "FeedForward", "TransformerBlock", "Transformer", "KVCache",
    "build_model", "generate", "greedy_token", "loss_fn",
    "TrainConfig", "synthetic_batches", "make_optimizer", "train_reference",
    "MoEConfig", "TINY_MOE", "MIXTRAL_8X7B", "MOE_PRESETS", "moe_config", "MoEFeedForward", "Routing",
    "build_moe_model", "moe_loss",
]
