"""Data parallelism on PyTorch's own engine: torchrun, DDP or FSDP2 (`fully_shard`).

`doel-train fit` is the same command on one process and under `torchrun --nproc_per_node=N`
(`--nnodes`, c10d rendezvous for several machines): `init_distributed` reads the variables
torchrun sets. NCCL drives GPUs, gloo the CPU (how the tests run it, several processes on
loopback, and two torchrun agents as two nodes: tests/train/test_multinode.py). Every collective has
a timeout, so a rank that hangs ends the job instead of hanging it forever: `dist_setup_timeout`
until step 1 (rendezvous, compilation and the checks, where ranks can be minutes apart: one
node's inductor cache warm, another's cold), `dist_timeout` from step 1 on. Under gloo a timed-out
collective raises on every rank and the job ends with a message naming the rank that stopped and
the step it last began (`collective_timeout_message`, tests/train/test_dist.py). Under NCCL,
torch's watchdog aborts the communicator and kills the process when the timeout passes (the
default TORCH_NCCL_ASYNC_ERROR_HANDLING), usually before that message can be written: the job
still ends, and torchrun's error report and the step keys in its store (HEARTBEAT) tell which
rank stopped where.
Across nodes the run folder must be one folder every node sees (`require_shared_folder`).

Under DDP, checkpoints gather the full model and optimizer state to rank 0 and write the
ordinary single-process checkpoint. Under FSDP each rank writes its own shards of the model and
optimizer through torch.distributed.checkpoint (see train/checkpoint.py), and rank 0 adds the
full model in HF layout for the stages after training. Either resumes at any world size.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dcp_state
import torch.distributed.fsdp as fsdp
import torch.distributed.tensor
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from doel.train.common import DoelError
from doel.train.metrics import cpu_peak_flops
from doel.train.torchcheck import cuda_unavailable_message, nvidia_driver, require_torch

require_torch()  # an older torch: one line naming the floor, not an ImportError further on

HEARTBEAT = "doel/step/"  # key prefix in torchrun's store: the step each rank last began


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def resolve_device(name: str) -> torch.device:
    """The device `name` asks for. "auto" is CUDA where torch sees a GPU, else the CPU, but a
    machine with an NVIDIA driver whose GPU torch cannot use is refused: a rented GPU must not
    train silently on its CPU. "cuda" without a usable GPU is refused naming the likely cause."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if nvidia_driver() is not None:
            raise DoelError(cuda_unavailable_message("auto"))
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DoelError(cuda_unavailable_message(name))
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA; on CPU bf16 only where it is at least twice as fast as fp32 (CPUs
    with AMX or AVX512-BF16), since elsewhere autocast would only cost accuracy."""
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    fast = cpu_peak_flops(torch.bfloat16, 1024) >= 2 * cpu_peak_flops(torch.float32, 1024)
    return torch.bfloat16 if fast else torch.float32


def autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


_TIMEOUT = {"s": 0.0}  # the collective timeout in force (set_collective_timeout)


def init_distributed(device_name: str, timeout_s: float) -> tuple[DistInfo, torch.device]:
    """Join the process group torchrun describes (or none), and pick this rank's device.
    `timeout_s` is the collectives' timeout until `set_collective_timeout` changes it (a run:
    dist_setup_timeout until step 1, then dist_timeout)."""
    _TIMEOUT["s"] = timeout_s
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo(), resolve_device(device_name)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and device_name in ("auto", "cuda")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        # torchrun reuses one store across elastic restarts; a prefix per attempt keeps a
        # restarted group from reading the dead attempt's connection keys (it hangs otherwise).
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=dist.PrefixStore(f"doel/attempt-{_attempt(store, world)}/", store),
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=device if cuda else None,
        )
    return DistInfo(rank, world, local), device


def _attempt(store, world: int) -> int:
    """A number every rank of this start of the job agrees on, new at each elastic restart.

    torchrun's agents keep one store across restarts (TORCHELASTIC_USE_AGENT_STORE), so a
    restarted group would read the dead attempt's connection keys and hang: a prefix per
    attempt keeps them apart. On one node the agent's restart count is that number. Across
    nodes it is not: an agent whose own worker failed counts a restart, one that restarts
    because another node rejoined does not, and ranks with different prefixes never meet.
    There every rank takes a ticket instead; each start of the job hands out `world` of them.
    Without the shared store, rank 0 hosts a new store each attempt and nothing is stale."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return 0
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return (store.add("doel/tickets", 1) - 1) // world


def require_shared_folder(out: Path, info: DistInfo, wait_s: float = 5.0) -> None:
    """Refuse, on every rank and in one line, a run folder that other nodes do not see.

    Under FSDP each rank writes its shards of a checkpoint into the run folder, and every rank
    resumes from the latest one it finds there: on storage each node has of its own, each
    would hold a partial checkpoint and the ranks would disagree on where to resume. Rank 0
    writes a marker with a fresh name; after a barrier every rank looks for it (for up to
    `wait_s`, as network file systems cache directory listings for a few seconds)."""
    if not info.enabled:
        return
    box = [secrets.token_hex(8)]
    dist.broadcast_object_list(box, src=0)
    marker = Path(out) / f".doel-shared-{box[0]}"
    if info.is_main:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(socket.gethostname(), encoding="utf-8")
    dist.barrier()
    deadline = time.monotonic() + wait_s
    while not marker.is_file() and time.monotonic() < deadline:
        time.sleep(0.2)
    views = [None] * info.world_size
    dist.all_gather_object(views, (marker.is_file(), socket.gethostname()))
    if info.is_main:
        marker.unlink(missing_ok=True)
    blind = [f"rank {r} on {host}" for r, (seen, host) in enumerate(views) if not seen]
    if blind:
        raise DoelError(
            f"{', '.join(blind)} cannot see the run folder {out} that rank 0 on {views[0][1]} "
            "writes: each node would write its own partial checkpoint. Put --out on storage "
            "every node mounts at the same path (NFS, a shared volume, a mounted bucket)"
        )


def set_collective_timeout(info: DistInfo, seconds: float) -> None:
    """The timeout of every later collective of the default process group (gloo and NCCL)."""
    if info.enabled and dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))
    _TIMEOUT["s"] = seconds


def collective_timeout() -> float:
    """The collective timeout in force, in seconds."""
    return _TIMEOUT["s"]


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside torch.compile (`_orig_mod`) and DDP-style (`module`) wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def wrap_model(
    model: nn.Module,
    strategy: str,
    info: DistInfo,
    device: torch.device,
    dtype: torch.dtype,
    activation_checkpointing: bool = False,
    before_sharding: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """DDP, or FSDP2 per transformer block plus the root (embedding, norm and head, which keeps
    a tied head and embedding one tensor). Returns the module to train. `before_sharding(model)`
    runs after activation checkpointing and before any wrapper (build.py's compile_blocks)."""
    if activation_checkpointing:
        _checkpoint_blocks(model)
    if before_sharding is not None:
        before_sharding(model)
    if not info.enabled:
        return model
    if strategy == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    # On CUDA, FSDP itself casts parameters to bf16 for compute and reduces gradients in fp32;
    # on CPU it keeps fp32 (gloo has no bf16 reductions worth having).
    mp = fsdp.MixedPrecisionPolicy(
        param_dtype=dtype if device.type == "cuda" and dtype != torch.float32 else None,
        reduce_dtype=torch.float32,
    )
    for block in model.model.layers:
        fsdp.fully_shard(block, mp_policy=mp)
    fsdp.fully_shard(model, mp_policy=mp)
    return model


def _checkpoint_blocks(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of storing them."""
    for block in model.model.layers:
        forward = block.forward
        block.forward = lambda *a, _f=forward: checkpoint(_f, *a, use_reentrant=False)


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def full_state(model: nn.Module, optimizer) -> tuple[dict, dict]:
    """The full (unsharded) model and optimizer state on CPU, keyed by parameter name. Every
    rank must call it (it gathers); only rank 0's copy is complete under FSDP."""
    opts = dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True)
    return dcp_state.get_state_dict(model, optimizer, options=opts)


def full_model_state(model: nn.Module) -> dict:
    """The full model state on CPU (gathered under FSDP; complete on rank 0). Every rank calls
    it."""
    opts = dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True)
    return dcp_state.get_model_state_dict(model, options=opts)


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP shards the parameters (each rank holds a DTensor piece of each)."""
    return any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


def load_full_state(model: nn.Module, optimizer, model_sd: dict, optim_sd: dict) -> None:
    """Load a full state on every rank; FSDP shards it as it loads."""
    dcp_state.set_state_dict(
        model,
        optimizer,
        model_state_dict=model_sd,
        optim_state_dict=optim_sd,
        options=dcp_state.StateDictOptions(full_state_dict=True, strict=True),
    )


def heartbeat(info: DistInfo, step: int) -> None:
    """Record in the rendezvous store that this rank begins `step`. The store outlives a broken
    collective, so after a timeout it still tells which rank stopped where."""
    if info.enabled:
        dist.distributed_c10d._get_default_store().set(f"{HEARTBEAT}{info.rank}", str(step))


def _laggards(info: DistInfo) -> str:
    store = dist.distributed_c10d._get_default_store()
    steps = {}
    for r in range(info.world_size):
        try:
            store.wait([f"{HEARTBEAT}{r}"], timedelta(seconds=2))
            steps[r] = int(store.get(f"{HEARTBEAT}{r}"))
        except Exception:  # noqa: BLE001 (a rank that never reported)
            steps[r] = -1
    ahead = max(steps.values())
    behind = {r: s for r, s in steps.items() if s < ahead}
    if not behind:
        return f"every rank began step {ahead}"
    named = ", ".join(f"rank {r} last began step {s}" for r, s in sorted(behind.items()))
    return f"{named}; the others are at step {ahead}"


def collective_timeout_message(info: DistInfo, timeout_s: float, error: Exception) -> str:
    """Which ranks stopped answering, from the step each one last reported."""
    try:
        where = _laggards(info)
    except Exception as e:  # noqa: BLE001 (the store itself may be gone)
        where = f"the store could not tell which: {e}"
    return (
        f"rank {info.rank}: a collective did not complete within {timeout_s:.0f} s, so another "
        f"rank hung or died ({where}); the job stops here. Resume by re-running the same "
        f"command: it continues from the last checkpoint. (cause: {str(error)[:200]})"
    )
