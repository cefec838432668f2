"""The optimizers a run can use (`optimizer = "adamw" | "muon"` in TrainConfig).

adamw: AdamW on everything, weight decay on matrices only.
muon: torch.optim.Muon on the hidden matrices (the attention and MLP projections of the
blocks), AdamW on the rest (embedding, head whether tied or not, norms), as modded-nanogpt and
nanochat do: Muon orthogonalizes each matrix's momentum (Newton-Schulz, in bfloat16), which
only makes sense for a 2-D weight that maps hidden features to hidden features. Both live in
one `MuonAdamW`, a real torch Optimizer whose groups carry `kind` ("muon" / "adamw"), so
checkpoints (state_dict, torch.distributed.checkpoint), the verification suite and the step
loop handle it as they handle AdamW. Each group has an `lr_scale`: the schedule's lr times it
is the group's lr (muon_lr / lr for Muon), so one schedule drives both.

Unsharded matrices (one process, DDP) are updated by `_muon_step`: torch.optim.Muon's update
with its per-matrix loop replaced by foreach momentum ops and one Newton-Schulz a shape over the
stacked matrices of that shape (`newton_schulz_batched`, as modded-nanogpt and nanochat batch
it): 4 shapes instead of 168 matrices at 0.4B, so a few dozen kernel launches an update instead
of thousands. The same arithmetic in the same order: on the CPU it equals torch's per-matrix
update bit for bit (tests/train/test_muon_batched.py). Under DDP every rank holds the same
averaged gradients, so instead of each rank orthogonalizing all of them, rank r takes every
world-th matrix of each shape and an all-gather shares the results (`_orthogonalized`): each
matrix is computed once, by one rank, and every rank applies the same numbers.

Under FSDP2 a hidden matrix is a DTensor sharded by rows. torch's Muon would run on it through
DTensor's operators, which sum bfloat16 partial products across ranks and move the update by
1-2 % of its size against one process; gathering each matrix whole instead costs one blocking
collective a matrix (168 at 0.4B) and every rank orthogonalizing every matrix. So `_muon_step`
runs the elementwise parts (momentum, Nesterov, decay, the step) on each rank's own rows, and
`_orthogonalized_sharded` distributes the orthogonalization as nanochat's DistMuon and
modded-nanogpt do: the matrices of one shape are numbered, rank r owns the r-th block of
ceil(N / world) of them, one all_to_all gives each owner the rows every rank holds of its
matrices (in bfloat16, which Newton-Schulz casts to first: the same numbers for half the bytes),
the owner runs the batched Newton-Schulz on its whole matrices, and a second all_to_all sends
each rank its rows of every result. Two collectives a shape (8 at 0.4B) instead of one a
matrix, each matrix orthogonalized once, and the numbers of one process: every matrix is
orthogonalized whole, by the same kernels (tests/train/test_dist.py compares the sharded
update with torch.optim.Muon's at world sizes 2 and 3 and counts the collectives).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from doel.train.torchcheck import require_torch

# torch's Muon's shape-based lr adjustment (a private name: a torch release that renames it fails
# here, at import, not silently in a run; one older than the floor is named).
try:
    from torch.optim._muon import _adjust_lr
except ImportError:
    require_torch()
    raise

from doel.train.dist import unwrap  # noqa: E402
from doel.train.settings import TrainConfig


def hidden_matrices(model: nn.Module) -> list[str]:
    """Names of the parameters Muon takes: weights of nn.Linear layers other than the output
    head (`lm_head`) and other than any weight shared with an embedding (a tied head)."""
    inner = unwrap(model)
    embedded = {id(m.weight) for m in inner.modules() if isinstance(m, nn.Embedding)}
    names = []
    for mod_name, mod in inner.named_modules():
        w = getattr(mod, "weight", None)
        if (
            isinstance(mod, nn.Linear)
            and mod_name.split(".")[-1] != "lm_head"
            and isinstance(w, nn.Parameter)
            and w.requires_grad
            and w.dim() == 2
            and id(w) not in embedded
        ):
            names.append(f"{mod_name}.weight")
    return names


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over the groups with kind="muon", torch.optim.AdamW over the others.
    Both share this optimizer's group dicts and state, so state_dict / load_state_dict are the
    base class's (one flat state keyed by parameter)."""

    def __init__(self, params, fused: bool | None = None):
        groups = [dict(g) for g in params]
        for g in groups:
            g.setdefault("kind", "adamw")
            if g["kind"] not in ("muon", "adamw"):
                raise ValueError(f"group kind must be muon or adamw, got {g['kind']!r}")
        # The base class refuses a parameter in two groups, across both kinds.
        super().__init__(groups, {"fused": fused})
        self._subs: dict[str, torch.optim.Optimizer] = {}
        muon = [g for g in self.param_groups if g["kind"] == "muon"]
        adam = [g for g in self.param_groups if g["kind"] == "adamw"]
        if muon:
            self._subs["muon"] = torch.optim.Muon(muon, lr=muon[0]["lr"])
        if adam:
            try:
                self._subs["adamw"] = torch.optim.AdamW(adam, fused=fused)
            except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
                for g in adam:
                    g["fused"] = None
                self._subs["adamw"] = torch.optim.AdamW(adam)
        self._link()

    def _link(self) -> None:
        for kind, sub in self._subs.items():
            sub.param_groups = [g for g in self.param_groups if g["kind"] == kind]
            sub.state = self.state

    def sub(self, kind: str) -> torch.optim.Optimizer | None:
        """The torch optimizer of one kind ("muon" / "adamw"), or None without such groups."""
        return self._subs.get(kind)

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # new group dicts and state: share them again
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon = self._subs.get("muon")
        for g in muon.param_groups if muon is not None else []:
            live = [p for p in g["params"] if p.grad is not None]
            whole = [p for p in live if not isinstance(p, DTensor)]
            _muon_step(whole, self.state, g, _orthogonalized)
            sharded = [p for p in live if isinstance(p, DTensor)]
            _muon_step(sharded, self.state, g, _orthogonalized_sharded)
        if "adamw" in self._subs:
            self._subs["adamw"].step()
        return loss


def newton_schulz_batched(
    g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz (`_zeropower_via_newtonschulz`: bfloat16, wide side
    last, scaled by the Frobenius norm, `steps` quintic iterations) on a stack (N, rows, cols)
    of same-shape matrices at once: batched matmuls instead of N launches of each."""
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        if b and c:
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        else:  # a zero coefficient: the CPU's bf16 baddbmm then returns NaN (torch 2.13)
            poly = gram * b + (gram @ gram) * c
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (a view: in-place ops on it change the DTensor), or `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


def _muon_step(params: list[torch.Tensor], state: dict, group: dict, orthogonalize) -> None:
    """torch.optim.Muon's step for one group's matrices, all whole or all sharded: momentum
    (lerp), Nesterov, decoupled weight decay, the shape-adjusted lr, elementwise on each rank's
    own part; `orthogonalize(updates, params, group)` turns each shape's updates into the
    Newton-Schulz results (the same parts). The momentum lives in state[p]["momentum_buffer"]
    (a DTensor under FSDP), as torch's Muon keeps it (checkpoints)."""
    if not params:
        return
    for p in params:
        if "momentum_buffer" not in state[p]:
            state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
    grads = [_local(p.grad) for p in params]
    bufs = [_local(state[p]["momentum_buffer"]) for p in params]
    momentum, lr = group["momentum"], float(group["lr"])
    torch._foreach_lerp_(bufs, grads, 1 - momentum)
    updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
    same = defaultdict(list)
    for i, p in enumerate(params):
        same[(tuple(p.shape), p.device, p.dtype)].append(i)
    for (shape, _, _), idx in same.items():
        ortho = orthogonalize([updates[i] for i in idx], [params[i] for i in idx], group)
        mine = [_local(params[i]) for i in idx]
        torch._foreach_mul_(mine, 1 - lr * group["weight_decay"])
        step = -_adjust_lr(lr, group["adjust_lr_fn"], torch.Size(shape))
        for p, o in zip(mine, ortho):
            p.add_(o, alpha=step)


def _ns_args(group: dict) -> tuple:
    return tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"]


def _orthogonalized(updates: list, params: list, group: dict) -> list[torch.Tensor]:
    """Newton-Schulz of same-shape whole matrices; under a process group (DDP: every rank
    holds the same updates) each rank computes every world-th matrix and an all-gather shares
    them, so the work is split, not repeated."""
    stack = torch.stack(updates)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1 or stack.size(0) == 1:
        return list(newton_schulz_batched(stack, *_ns_args(group)).unbind(0))
    n = stack.size(0)
    per = -(-n // world)  # matrices a rank (the last ranks may pad with zeros)
    padded = torch.cat([stack, stack.new_zeros(per * world - n, *stack.shape[1:])])
    rank = dist.get_rank()
    mine = newton_schulz_batched(padded[rank * per : (rank + 1) * per], *_ns_args(group))
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine.contiguous())
    return list(torch.cat(parts)[:n].unbind(0))


def _orthogonalized_sharded(updates: list, params: list, group: dict) -> list[torch.Tensor]:
    """Newton-Schulz of same-shape matrices sharded by rows (FSDP2): `updates` are this rank's
    rows of each; returns this rank's rows of each result. See the module docstring: owners by
    block of matrices, one all_to_all to the owners, one back."""
    p = params[0]
    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise ValueError(f"Muon shards matrices by rows on one mesh axis, not {p.placements}")
    pg, world = p.device_mesh.get_group(), p.device_mesh.size()
    rank = dist.get_rank(pg)
    (rows, cols), n, have = p.shape, len(updates), updates[0].size(0)
    per, span = -(-n // world), -(-rows // world)  # matrices an owner, rows a full shard
    if have != max(0, min(span, rows - rank * span)):  # FSDP2 shards as torch.chunk does
        raise ValueError(f"rank {rank} holds {have} rows of a {rows}-row matrix")
    send = updates[0].new_zeros(world * per, span, cols, dtype=torch.bfloat16)
    send[:n, :have] = torch.stack(updates)
    got = torch.empty_like(send)  # [j * per + k]: rank j's rows of this rank's k-th matrix
    dist.all_to_all_single(got, send, group=pg)
    whole = got.view(world, per, span, cols).transpose(0, 1).reshape(per, world * span, cols)
    owned = max(0, min(per, n - rank * per))
    result = torch.zeros_like(whole)
    if owned:
        mats = whole[:owned, :rows].contiguous()
        result[:owned, :rows] = newton_schulz_batched(mats, *_ns_args(group))
    send = result.view(per, world, span, cols).transpose(0, 1).contiguous()
    back = torch.empty_like(send)  # [j, k]: this rank's rows of rank j's k-th result
    dist.all_to_all_single(back, send, group=pg)
    return list(back.view(world * per, span, cols)[:n, :have].unbind(0))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's lr into every group, times the group's lr_scale (Muon's own rate)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device):
    """The run's optimizer (cfg.optimizer), over `model`'s parameters (the wrapped model's:
    FSDP's are DTensor shards). Fused AdamW where the device has it."""
    fused = device.type in ("cuda", "cpu")
    named = [(n, p) for n, p in unwrap(model).named_parameters() if p.requires_grad]
    hidden = set(hidden_matrices(model)) if cfg.optimizer == "muon" else set()
    adam = dict(lr_scale=1.0, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    groups = [
        {
            "kind": "adamw",
            "params": [p for n, p in named if p.dim() >= 2 and n not in hidden],
            "weight_decay": cfg.weight_decay,
            **adam,
        },
        {
            "kind": "adamw",
            "params": [p for n, p in named if p.dim() < 2],
            "weight_decay": 0.0,
            **adam,
        },
    ]
    if cfg.optimizer == "adamw":
        kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        plain = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups]
        try:
            return torch.optim.AdamW(plain, fused=fused, **kwargs)
        except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
            return torch.optim.AdamW(plain, **kwargs)
    muon = {
        "kind": "muon",
        "params": [p for n, p in named if n in hidden],
        "lr": cfg.muon_lr,
        "lr_scale": cfg.muon_lr / cfg.lr,
        "weight_decay": cfg.muon_weight_decay,
        "momentum": cfg.muon_momentum,
        "nesterov": True,
        "adjust_lr_fn": cfg.muon_adjust_lr,
    }
    for g in groups:
        g["lr"] = cfg.lr
    return MuonAdamW([muon, *[g for g in groups if g["params"]]], fused=fused)


def describe_groups(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """One line a group: its optimizer, rates, how many tensors and parameters, which ones."""
    name_of = {id(p): n for n, p in unwrap(model).named_parameters()}
    lines = []
    for g in optimizer.param_groups:
        names = [name_of.get(id(p), "?") for p in g["params"]]
        count = sum(p.numel() for p in g["params"])
        kind = g.get("kind", type(optimizer).__name__.lower())
        shown = _short(names)
        lines.append(
            f"optimizer group {kind}: {len(names)} tensors, {count:,} parameters, lr "
            f"{g['lr']:.2e}, weight decay {g['weight_decay']:g}: {shown}"
        )
    return lines


def _short(names: list[str], limit: int = 4) -> str:
    """Names with the layer index folded (layers.*), at most `limit` shown."""
    folded = []
    for n in names:
        parts = n.split(".")
        f = ".".join("*" if p.isdigit() else p for p in parts)
        if f not in folded:
            folded.append(f)
    more = f" (+{len(folded) - limit} more)" if len(folded) > limit else ""
    return ", ".join(folded[:limit]) + more
