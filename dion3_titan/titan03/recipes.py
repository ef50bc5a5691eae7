"""Config functions for torchtitan 0.3: ``--module dion3_titan.titan03.recipes --config <name>``.

Each starts from torchtitan's own config function of the model and replaces the optimizer (and,
for the debug models, the data: the offline corpus built by ``python -m dion3_titan.data.build``).
Every model has a Dion3 recipe and its AdamW and Muon baselines with the same schedule.

    torchrun --nproc_per_node 2 -m dion3_titan.train \\
        --module dion3_titan.titan03.recipes --config llama3_debug_dion3

Command-line keys override any field, e.g. ``--training.steps 50``.
"""

from torchtitan.components.optimizer import default_adamw
from torchtitan.components.validate import Validator
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.deepseek_v3 import config_registry as deepseek_v3
from torchtitan.models.llama3 import config_registry as llama3
from torchtitan.models.qwen3 import config_registry as qwen3
from torchtitan.trainer import Trainer

from dion3_titan.data.titan_dataset import register_datasets
from dion3_titan.titan03.metrics import Dion3MetricsProcessor
from dion3_titan.titan03.optimizers import Dion3Optimizers, dion3_param_groups

CORPUS = "data/dion3_docs_small"  # python -m dion3_titan.data.build --size small

register_datasets()  # the corpus names "dion3_docs" / "dion3_docs_val" (also without our trainer)


def dion3_optimizer(
    name: str = "Dion3", *, lr: float, adamw_lr: float, weight_decay: float = 0.0, cuda_graph: bool = False, **options
) -> Dion3Optimizers.Config:
    """``name`` ("Dion3", "Muon", "NorMuon", "PRMuon") on the block matrices, AdamW (betas
    0.9/0.95, eps 1e-8) on embeddings, lm_head, norms and biases; metrics on."""
    return Dion3Optimizers.Config(
        param_groups=dion3_param_groups(
            name,
            lr=lr,
            weight_decay=weight_decay,
            **options,
            adamw={"lr": adamw_lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": weight_decay},
        ),
        cuda_graph=cuda_graph,
        optimizer_metrics=True,
    )


def _use(config: Trainer.Config, optimizer) -> Trainer.Config:
    config.optimizer = optimizer
    config.metrics = Dion3MetricsProcessor.Config(
        log_freq=config.metrics.log_freq, enable_tensorboard=config.metrics.enable_tensorboard
    )
    return config


def _on_corpus(config: Trainer.Config, *, seq_len: int, batch: int) -> Trainer.Config:
    """``config`` reading the offline corpus, validating on its held-out documents."""
    config.hf_assets_path = f"{CORPUS}/tokenizer"  # BPE tokenizer, 2048 ids = the debug models' vocab
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="dion3_docs", dataset_path=CORPUS)
    config.validator = Validator.Config(
        enable=True,
        freq=10,
        steps=2,  # fixed steps keep the ranks in step
        dataloader=HuggingFaceTextDataLoader.Config(dataset="dion3_docs_val", dataset_path=CORPUS, infinite=False),
    )
    config.training.seq_len, config.training.local_batch_size = seq_len, batch
    config.lr_scheduler.warmup_steps, config.lr_scheduler.decay_type = 2, "linear"
    config.lr_scheduler.decay_ratio, config.lr_scheduler.min_lr_factor = None, 0.1
    config.checkpoint.enable, config.checkpoint.interval = False, 10
    config.debug.seed = 42
    return config


def _on_cpu(config: Trainer.Config) -> Trainer.Config:
    """float32 throughout (bf16 matmuls are slow on a CPU), no activation checkpointing, no
    CUDA graphs (0.3 refuses them with expert parallelism's default token dispatcher), and
    FSDP2's DTensor parameters ("partial_dtensor"): on gloo, 0.3's default "spmd_types" backend
    stops in fully_shard ("all parameters must be DTensors on the full SPMD mesh")."""
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    config.activation_checkpoint = None
    config.parallelism.spmd_backend = "partial_dtensor"
    return config


# ------------------------------------------------------------------ llama3 debug, CPU (gloo)
def _llama3_debug_cpu() -> Trainer.Config:
    """torchtitan's 6-layer debug model on CPU: 20 steps of 4 x 256 tokens per rank."""
    config = _on_cpu(_on_corpus(llama3.llama3_debugmodel(), seq_len=256, batch=4))
    config.training.steps = 20
    config.dump_folder = "./outputs/titan03_llama3_debug"
    return config


def llama3_debug_dion3() -> Trainer.Config:
    # ns_dtype float32: float16 matmuls are slow on a CPU
    return _use(
        _llama3_debug_cpu(),
        dion3_optimizer("Dion3", lr=0.02, adamw_lr=3e-3, fraction=0.25, flavor="normuon", ns_dtype="float32"),
    )


def llama3_debug_muon() -> Trainer.Config:
    return _use(_llama3_debug_cpu(), dion3_optimizer("Muon", lr=0.02, adamw_lr=3e-3, ns_dtype="float32"))


def llama3_debug_adamw() -> Trainer.Config:
    return _use(_llama3_debug_cpu(), default_adamw(lr=3e-3, weight_decay=0.0))


# ------------------------------------------------------------------ llama3 debug, GPU
def _llama3_debug_gpu() -> Trainer.Config:
    """The same model on GPUs: bf16 compute, 8 x 2048 tokens per rank, 200 steps; torchtitan's
    CUDA-graphed forward+backward stays on (its default)."""
    config = _on_corpus(llama3.llama3_debugmodel(), seq_len=2048, batch=8)
    config.training.steps, config.training.mixed_precision_param = 200, "bfloat16"
    config.lr_scheduler.warmup_steps = 20
    config.dump_folder = "./outputs/titan03_llama3_debug_gpu"
    return config


def llama3_debug_gpu_dion3() -> Trainer.Config:
    return _use(
        _llama3_debug_gpu(),
        dion3_optimizer("Dion3", lr=0.02, adamw_lr=3e-3, fraction=0.25, flavor="normuon", cuda_graph=True),
    )


def llama3_debug_gpu_muon() -> Trainer.Config:
    return _use(_llama3_debug_gpu(), dion3_optimizer("Muon", lr=0.02, adamw_lr=3e-3, cuda_graph=True))


def llama3_debug_gpu_adamw() -> Trainer.Config:
    return _use(_llama3_debug_gpu(), default_adamw(lr=3e-3, weight_decay=0.0))


# ------------------------------------------------------------------ qwen3 0.6B / 1.7B (GPU)
def qwen3_0_6b_dion3() -> Trainer.Config:
    return _use(
        qwen3.qwen3_0_6b(),
        dion3_optimizer("Dion3", lr=0.02, adamw_lr=3e-4, weight_decay=0.1, fraction=0.25, flavor="normuon"),
    )


def qwen3_0_6b_muon() -> Trainer.Config:
    return _use(qwen3.qwen3_0_6b(), dion3_optimizer("Muon", lr=0.02, adamw_lr=3e-4, weight_decay=0.1))


def qwen3_0_6b_adamw() -> Trainer.Config:
    return _use(qwen3.qwen3_0_6b(), default_adamw(lr=3e-4, weight_decay=0.1))


def qwen3_1_7b_dion3() -> Trainer.Config:
    return _use(
        qwen3.qwen3_1_7b(),
        dion3_optimizer("Dion3", lr=0.02, adamw_lr=3e-4, weight_decay=0.1, fraction=0.25, flavor="normuon"),
    )


def qwen3_1_7b_muon() -> Trainer.Config:
    return _use(qwen3.qwen3_1_7b(), dion3_optimizer("Muon", lr=0.02, adamw_lr=3e-4, weight_decay=0.1))


def qwen3_1_7b_adamw() -> Trainer.Config:
    return _use(qwen3.qwen3_1_7b(), default_adamw(lr=3e-4, weight_decay=0.1))


# ------------------------------------------------------------------ deepseek_v3 debug (CPU) / 16B (GPU)
def _deepseek_v3_debug_cpu() -> Trainer.Config:
    """torchtitan's MoE debug model (8 experts) on CPU: 10 steps of 2 x 128 tokens per rank."""
    config = _on_cpu(_on_corpus(deepseek_v3.deepseek_v3_debugmodel(), seq_len=128, batch=2))
    config.training.steps = 10
    config.validator.enable = False
    config.dump_folder = "./outputs/titan03_deepseek_v3_debug"
    return config


def deepseek_v3_debug_dion3() -> Trainer.Config:
    return _use(
        _deepseek_v3_debug_cpu(),
        dion3_optimizer("Dion3", lr=0.02, adamw_lr=3e-3, fraction=0.25, flavor="normuon", ns_dtype="float32"),
    )


def deepseek_v3_debug_muon() -> Trainer.Config:
    return _use(_deepseek_v3_debug_cpu(), dion3_optimizer("Muon", lr=0.02, adamw_lr=3e-3, ns_dtype="float32"))


def deepseek_v3_debug_adamw() -> Trainer.Config:
    return _use(_deepseek_v3_debug_cpu(), default_adamw(lr=3e-3, weight_decay=0.0))


def deepseek_v3_16b_dion3() -> Trainer.Config:
    return _use(
        deepseek_v3.deepseek_v3_16b(),
        dion3_optimizer("Dion3", lr=0.02, adamw_lr=2.2e-4, weight_decay=0.1, fraction=0.25, flavor="normuon"),
    )


def deepseek_v3_16b_muon() -> Trainer.Config:
    return _use(deepseek_v3.deepseek_v3_16b(), dion3_optimizer("Muon", lr=0.02, adamw_lr=2.2e-4, weight_decay=0.1))


def deepseek_v3_16b_adamw() -> Trainer.Config:
    return _use(deepseek_v3.deepseek_v3_16b(), default_adamw(lr=2.2e-4, weight_decay=0.1))
