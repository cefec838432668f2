"""The settings of a run as frozen dataclasses: the model's hyper-parameters (`ModelConfig`,
named as in `transformers.LlamaConfig`) and training's (`TrainConfig`, with a [model] table).

Standard library only, so the command line validates a config (a preset, a TOML file, --set
overrides) before it imports torch: a typo fails before the seconds torch takes to load.
Import them from here (`ModelConfig` is also importable as `doel.train.model.ModelConfig`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """Llama hyper-parameters, named as in `transformers.LlamaConfig`."""

    vocab_size: int = 32768
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(
                    f"model.{name} must be a positive integer, got {getattr(self, name)!r}"
                )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"model.num_key_value_heads ({self.num_key_value_heads}) (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ValueError(f"model head dim {self.head_dim} must be even for rotary embeddings")
        if not (self.rope_theta > 0 and self.rms_norm_eps > 0 and self.initializer_range > 0):
            raise ValueError(
                "model.rope_theta, model.rms_norm_eps, model.initializer_range must be > 0"
            )
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ValueError(f"model.{name} must lie in [0, vocab_size)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf(self) -> dict:
        """The `config.json` that `transformers.LlamaConfig` reads."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **asdict(self),
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "rope_scaling": None,
            "use_cache": True,
            "torch_dtype": "float32",
        }

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """Read a Llama `config.json`; refuse settings this model does not implement."""
        if cfg.get("model_type", "llama") != "llama":
            raise ValueError(f"config.json has model_type {cfg.get('model_type')!r}, not 'llama'")
        unsupported = {
            "hidden_act": ("silu", None),
            "attention_bias": (False, None),
            "mlp_bias": (False, None),
            "rope_scaling": (None,),
        }
        for key, allowed in unsupported.items():
            if cfg.get(key) not in allowed:
                raise ValueError(f"config.json {key}={cfg.get(key)!r} is not supported by doel")
        fields = {k: cfg[k] for k in cls.__dataclass_fields__ if cfg.get(k) is not None}
        made = cls(**fields)
        if cfg.get("head_dim", made.head_dim) != made.head_dim:
            raise ValueError("config.json head_dim must equal hidden_size / num_attention_heads")
        return made


SCHEDULES = ("cosine", "wsd", "constant")
STRATEGIES = ("ddp", "fsdp")  # data parallelism under torchrun (train/dist.py)
DTYPES = ("auto", "float32", "bfloat16")
OPTIMIZERS = ("adamw", "muon")  # muon: Muon on the hidden matrices, AdamW on the rest
MUON_ADJUST_LR = ("original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn


@dataclass(frozen=True)
class TrainConfig:
    """One run's settings. TOML: top-level keys below plus a `[model]` table."""

    model: ModelConfig = field(default_factory=ModelConfig)
    seq_len: int = 512
    batch_size: int = 8  # rows per micro-batch
    grad_accum: int = 1  # micro-batches per step (per optimizer update, after any ramp)
    # The first fraction of the steps updates on fewer micro-batches (1 growing to grad_accum),
    # several updates a step: same tokens, same data order (`take_step`). 0: no ramp.
    batch_ramp_fraction: float = 0.0
    steps: int = 1000
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # the schedule ends at lr * min_lr_ratio
    warmup_steps: int = 100
    schedule: str = "cosine"
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    optimizer: str = "adamw"  # or "muon" (train/optim.py)
    muon_lr: float = 0.02  # Muon's peak lr; the schedule scales it as it scales lr
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0  # Muon decays by muon_lr * this a step
    muon_adjust_lr: str = "original"  # lr x sqrt(max(1, rows/cols)); or "match_rms_adamw"
    grad_clip: float = 1.0  # 0 disables clipping
    dtype: str = "auto"  # autocast dtype; auto: bf16 on CUDA, and on CPUs whose bf16 is fast
    compile: bool = False
    device: str = "auto"
    strategy: str = "ddp"  # under torchrun: ddp, or fsdp (FSDP2 per block)
    activation_checkpointing: bool = False
    dist_timeout: float = 600.0  # seconds a collective may wait during the steps
    # ... and before step 1 (rendezvous, compile, the checks): ranks compile at their own
    # speed (one node's inductor cache warm, another's cold), so the first wait is long
    dist_setup_timeout: float = 1800.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100  # 0 disables periodic validation
    eval_batches: int = 8
    eval_task: str = ""  # optional NAME=PATH of a multiple-choice task scored at each validation
    eval_task_limit: int = 200  # the fixed first items of that task
    checkpoint_every: int = 200  # 0: only the final model
    keep_checkpoints: int = 3
    hourly_price: float = 3.0  # dollars per GPU-hour, for the cost estimate
    time_limit: float = 0.0  # seconds of training before stopping early; 0: none

    def __post_init__(self):
        positive = ("seq_len", "batch_size", "grad_accum", "steps", "log_every", "eval_batches")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "keep_checkpoints"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if self.seq_len > self.model.max_position_embeddings:
            raise ValueError(
                f"seq_len ({self.seq_len}) exceeds model.max_position_embeddings "
                f"({self.model.max_position_embeddings})"
            )
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"decay_fraction must lie in (0, 1], got {self.decay_fraction}")
        if not 0 <= self.batch_ramp_fraction < 1:
            raise ValueError(
                f"batch_ramp_fraction must lie in [0, 1), got {self.batch_ramp_fraction}"
            )
        if self.batch_ramp_fraction and self.grad_accum < 2:
            raise ValueError(
                "batch_ramp_fraction needs grad_accum >= 2 (the ramp grows an optimizer "
                "update from 1 micro-batch to grad_accum): lower batch_size and raise "
                "grad_accum, or set batch_ramp_fraction=0"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.eval_task and "=" not in self.eval_task:
            raise ValueError(
                f"eval_task must be NAME=PATH, e.g. hellaswag=val.jsonl, got {self.eval_task!r}"
            )
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        for name in ("dist_timeout", "dist_setup_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.muon_adjust_lr not in MUON_ADJUST_LR:
            raise ValueError(
                f"muon_adjust_lr must be one of {MUON_ADJUST_LR}, got {self.muon_adjust_lr!r}"
            )
        if not self.muon_lr > 0:
            raise ValueError(f"muon_lr must be > 0, got {self.muon_lr}")
        if not 0 <= self.muon_momentum < 1:
            raise ValueError(f"muon_momentum must lie in [0, 1), got {self.muon_momentum}")
        if self.muon_weight_decay < 0:
            raise ValueError(f"muon_weight_decay must be >= 0, got {self.muon_weight_decay}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and self.eps > 0):
            raise ValueError("beta1 and beta2 must lie in [0, 1), eps must be > 0")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.time_limit < 0:
            raise ValueError("weight_decay, grad_clip and time_limit must be >= 0")

    @property
    def tokens_per_step(self) -> int:
        """Per process; a data-parallel step trains world_size times as many."""
        return self.batch_size * self.grad_accum * self.seq_len
