"""Run by tests/test_dist.py under torchrun (gloo): Muon's step on a row-sharded matrix (a
DTensor, as FSDP2 holds it) against the same step on the whole matrix, same gradients, for
wide, tall, square and unevenly split shapes. Prints one line a shape from rank 0."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from train.optim import MuonAdamW

SHAPES = [(64, 176), (176, 64), (64, 64), (63, 64)]

if __name__ == "__main__":
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    group = {"kind": "muon", "lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}
    for shape in SHAPES:
        w = torch.randn(*shape, generator=g) * 0.02
        grads = [torch.randn(*shape, generator=g) for _ in range(3)]
        whole = torch.nn.Parameter(w.clone())
        shard = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
        a = MuonAdamW([{**group, "params": [whole]}])
        b = MuonAdamW([{**group, "params": [shard]}])
        for grad in grads:
            whole.grad = grad.clone()
            shard.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
            a.step()
            b.step()
        got = shard.detach().full_tensor()
        moved = float((whole.detach() - w).norm())
        if dist.get_rank() == 0:
            equal = torch.equal(got, whole.detach())
            print(
                f"shape {shape}: equal {equal}, max diff {float((got - whole.detach()).abs().max()):.3g}, "
                f"update norm {moved:.3g}",
                flush=True,
            )
    dist.destroy_process_group()
