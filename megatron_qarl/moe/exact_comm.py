"""Collectives with autograd for the learner's exact forward (moe/exact.py). None of them adds two numbers: what
crosses ranks is gathered and then selected or concatenated, so a value is the same bits whichever rank made it.

Every rank of a tensor-parallel group computes the replicated parts of the forward (norms, residuals, the router,
the loss) on the same tokens, so their gradients are the same on every rank; the sharded parts (column- and
row-parallel linears, experts) give partial gradients that the backward of ``copy_to`` sums.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_qarl.moe.parallelize import all_gather_tensors, all_reduce, to_group_device


class Group:
    """A process group with this rank's place in it (size 1: every function below is the identity)."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank

    def gather(self, t: Tensor, name: str) -> list[Tensor]:
        return [p.to(t.device) for p in all_gather_tensors(to_group_device(t.contiguous(), self.group), self.group,
                                                           self.size, name=name)]


class _CopyTo(torch.autograd.Function):
    """Forward: x. Backward: the sum of the gradients over the group (x feeds a sharded computation)."""

    @staticmethod
    def forward(ctx, x: Tensor, g: Group) -> Tensor:
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = to_group_device(grad.contiguous().clone(), ctx.g.group)
        all_reduce(grad, ctx.g.group, name="exact copy_to grad")
        return grad, None


class _GatherLast(torch.autograd.Function):
    """Forward: the ranks' tensors concatenated along the last dim, in rank order. Backward: this rank's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, g: Group) -> Tensor:
        ctx.g = g
        return torch.cat(g.gather(x, "exact gather"), dim=-1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.chunk(ctx.g.size, dim=-1)[ctx.g.rank].contiguous(), None


class _GatherRows(torch.autograd.Function):
    """Forward: rows concatenated in rank order. Backward: this rank's rows (``summed``: the group's sum of them,
    when each rank's use of the gathered rows is partial, as experts are)."""

    @staticmethod
    def forward(ctx, x: Tensor, g: Group, summed: bool) -> Tensor:
        ctx.g, ctx.summed = g, summed
        return torch.cat(g.gather(x, "exact gather rows"))

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.summed:
            grad = to_group_device(grad.contiguous().clone(), ctx.g.group)
            all_reduce(grad, ctx.g.group, name="exact gather rows grad")
        return grad.chunk(ctx.g.size)[ctx.g.rank].contiguous(), None, None


class _SplitRows(torch.autograd.Function):
    """Forward: this rank's equal share of the rows. Backward: the shares' gradients gathered."""

    @staticmethod
    def forward(ctx, x: Tensor, g: Group) -> Tensor:
        ctx.g = g
        return x.chunk(g.size)[g.rank].contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return torch.cat(ctx.g.gather(grad, "exact split grad")), None


class _SelectOwner(torch.autograd.Function):
    """Forward: out[i] = rank owner[i]'s x[i] (every rank computes x of the same shape, meaningful where it owns the
    entry), optionally followed by this rank's share of the rows. Backward: the gradient to the owner's entries."""

    @staticmethod
    def forward(ctx, x: Tensor, owner: Tensor, g: Group, split: bool) -> Tensor:
        ctx.g, ctx.split = g, split
        ctx.save_for_backward(owner)
        parts = torch.stack(g.gather(x, "exact select"))  # [size, *x.shape]
        idx = owner.reshape(1, *owner.shape, *([1] * (x.dim() - owner.dim()))).expand(1, *x.shape)
        out = parts.gather(0, idx)[0]
        return out.chunk(g.size)[g.rank].contiguous() if split else out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (owner,) = ctx.saved_tensors
        if ctx.split:
            grad = torch.cat(ctx.g.gather(grad, "exact select grad"))
        mine = (owner == ctx.g.rank).reshape(*owner.shape, *([1] * (grad.dim() - owner.dim())))
        return torch.where(mine, grad, torch.zeros_like(grad)), None, None, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None


def copy_to(x: Tensor, g: Group) -> Tensor:
    return x if g.size == 1 else _CopyTo.apply(x, g)


def gather_last(x: Tensor, g: Group) -> Tensor:
    return x if g.size == 1 else _GatherLast.apply(x, g)


def gather_rows(x: Tensor, g: Group, summed: bool = False) -> Tensor:
    return x if g.size == 1 else _GatherRows.apply(x, g, summed)


def split_rows(x: Tensor, g: Group) -> Tensor:
    return x if g.size == 1 else _SplitRows.apply(x, g)


def select_owner(x: Tensor, owner: Tensor, g: Group, split: bool = False) -> Tensor:
    return x if g.size == 1 else _SelectOwner.apply(x, owner, g, split)


def scale_grad(x: Tensor, scale: float) -> Tensor:
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)
