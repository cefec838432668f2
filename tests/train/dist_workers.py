"""Run by tests/train/test_dist.py under torchrun (gloo, CPU); each rank writes what it saw to
OUT/rank-R.json for the test to judge.

`dist_workers.py muon OUT`: MuonAdamW's sharded (FSDP2) step on several matrices of each shape
(counts that are and are not multiples of the world size, rows that do not split evenly, a
rank with no rows) against torch.optim.Muon on the whole matrices, over 3 steps, and the
collectives one sharded update makes (torch's CommDebugMode counts c10d and DTensor ones).

`dist_workers.py compile OUT STRATEGY`: build_parts under DDP or FSDP with compile on, against
the same run eager: whether each block had its compiled forward when the wrapper took it, the
graphs dynamo made, and both runs' losses and weights over 2 steps. The backend is aot_eager:
AOTAutograd traces and partitions the same joint forward/backward graph as inductor (where
FSDP's hooks would break it if they were inside), only no kernels are generated, which on two
shared CPU cores would take minutes a rank (tests/train/test_fit.py runs inductor, one process).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import doel.train.dist as doel_dist
from doel.train.build import _EagerOrCompiled, build_parts
from doel.train.config import load_config
from doel.train.dist import init_distributed
from doel.train.optim import MuonAdamW
from doel.train.settings import TrainConfig
from doel.train.step import train_step

ROOT = Path(__file__).resolve().parents[2]

# (rows, cols): how many matrices of that shape
SHAPES = {(64, 64): 5, (32, 64): 3, (176, 64): 4, (64, 176): 1, (65, 40): 2, (2, 16): 2}
HYPER = dict(
    lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw"
)


class Matrices(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.mats = nn.ParameterList(
            nn.Parameter(torch.randn(*shape, generator=gen) * 0.1)
            for shape, count in SHAPES.items()
            for _ in range(count)
        )


def muon(out: Path) -> None:
    rank = dist.get_rank()
    sharded, whole, initial = Matrices(), Matrices(), Matrices()  # the same on every rank
    fully_shard(sharded)
    mesh = sharded.mats[0].device_mesh
    ours = MuonAdamW([{"kind": "muon", "params": list(sharded.mats), **HYPER}])
    theirs = torch.optim.Muon(list(whole.mats), **HYPER)
    gen = torch.Generator().manual_seed(1)
    seen = {"rank": rank, "world": dist.get_world_size(), "shapes": len(SHAPES), "steps": []}
    for _ in range(3):
        for p, q in zip(sharded.mats, whole.mats):
            q.grad = torch.randn(q.shape, generator=gen)
            p.grad = distribute_tensor(q.grad, mesh, [Shard(0)], src_data_rank=None)
        with CommDebugMode() as comm:
            ours.step()
        theirs.step()
        seen["steps"].append(_compare(ours, theirs, sharded, whole, initial, comm))
    (out / f"rank-{rank}.json").write_text(json.dumps(seen), encoding="utf-8")


@torch.no_grad()
def _compare(ours, theirs, sharded, whole, initial, comm) -> dict:
    return {
        "collectives": {str(k): v for k, v in comm.get_comm_counts().items()},
        "sharded": all(isinstance(p, DTensor) for p in sharded.mats),
        "rows_here": [p.to_local().size(0) for p in sharded.mats],
        "weights_equal": [
            torch.equal(p.full_tensor(), q) for p, q in zip(sharded.mats, whole.mats)
        ],
        "momentum_equal": [
            torch.equal(
                ours.state[p]["momentum_buffer"].full_tensor(),
                theirs.state[q]["momentum_buffer"],
            )
            for p, q in zip(sharded.mats, whole.mats)
        ],
        "max_error": max(
            float((p.full_tensor() - q).abs().max()) for p, q in zip(sharded.mats, whole.mats)
        ),
        "all_moved": all(not torch.equal(q, q0) for q, q0 in zip(whole.mats, initial.mats)),
    }


def _record_wrapping(seen: list) -> None:
    """Note, as fully_shard or DDP takes a module, whether each block it covers already has its
    compiled forward."""

    def note(module):
        blocks = [module] if hasattr(module, "self_attn") else list(module.model.layers)
        compiled = [isinstance(b.__dict__.get("forward"), _EagerOrCompiled) for b in blocks]
        seen.append({"wrapper": "block" if hasattr(module, "self_attn") else "root",
                     "blocks_compiled": compiled})  # fmt: skip

    shard, ddp = torch.distributed.fsdp.fully_shard, doel_dist.DistributedDataParallel
    torch.distributed.fsdp.fully_shard = lambda m, **kw: (note(m), shard(m, **kw))[1]
    doel_dist.DistributedDataParallel = lambda m, **kw: (note(m), ddp(m, **kw))[1]


def compile_under(out: Path, strategy: str) -> None:
    info, device = init_distributed("cpu", 120)
    graphs, wrapping = [], []
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def counting(gm, example_inputs):
        graphs.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)])
        return aot_eager(gm, example_inputs)

    real = torch.compile
    torch.compile = lambda fn, **kw: real(fn, backend=counting, **kw)
    _record_wrapping(wrapping)
    cfg = load_config(TrainConfig, ROOT / "configs" / "tiny.toml", [f"strategy={strategy}"])
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (2 * info.world_size, cfg.seq_len), generator=gen)
    mine = slice(2 * info.rank, 2 * info.rank + 2)
    batch = (x[mine], torch.roll(x, -1, 1)[mine])
    seen, weights = {"rank": info.rank, "losses": {}}, {}
    for compiled in (True, False):
        parts = build_parts(cfg, None, info=info, device=device, compile=compiled,
                            example_batch=batch, log=lambda s: None)  # fmt: skip
        if compiled:
            seen["step_calls"] = type(parts.compiled).__name__
            seen["wrapping"], seen["graphs_after_warmup"] = list(wrapping), len(graphs)
        steps = [train_step(parts.compiled, parts.optimizer, [batch], cfg.lr, 1.0, parts.ctx)
                 for _ in range(2)]  # fmt: skip
        seen["losses"][str(compiled)] = [float(s["loss"]) for s in steps]
        with torch.no_grad():
            weights[compiled] = {
                n: (p.full_tensor() if isinstance(p, DTensor) else p).clone()
                for n, p in parts.model.named_parameters()
            }
    seen["graphs"] = graphs
    a, b = weights[True], weights[False]
    seen["max_weight_error"] = max(float((a[n] - b[n]).abs().max()) for n in a)
    (out / f"rank-{info.rank}.json").write_text(json.dumps(seen), encoding="utf-8")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        jobs = {"muon": muon, "compile": compile_under}
        jobs[sys.argv[1]](Path(sys.argv[2]), *sys.argv[3:])
    finally:
        dist.destroy_process_group()
