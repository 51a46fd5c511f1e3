"""Expert parallel from scratch: the experts of each MoE layer split over the ranks of a group.

Rank r of n holds experts [r·E/n, (r+1)·E/n) of every MoE layer and reads its own B/n sequences;
everything else (embedding, attention, norms, routers, output) is replicated and data parallel over
the same ranks, as frameworks do. One MoE layer, forward, on each rank:

1. **route** its own tokens (the router is replicated): each token picks k experts; capacity drops
   what does not fit (``minitp.models.moe``: per sequence, so the same tokens drop as on one
   process);
2. **dispatch**: sort its kept assignments by expert, hence by the rank holding it, and send each
   rank its rows with one ``all_to_all`` (uneven chunks). A first, small all-to-all of the counts
   per expert tells every rank how many rows it will receive and for which of its experts;
3. run each local expert once on every row it received, from every rank;
4. **combine**: send each output back where its token came from (the same all-to-all reversed) and
   add each token's k outputs weighted by its gates.

Backward is the transpose: autograd sends the gradients of the combine's rows to the experts and
those of the dispatch's rows back (two all-to-alls with the split sizes swapped). After backward the
replicated parameters' gradients are averaged over the group (one all-reduce), and each expert's
gradient, which already sums every rank's tokens, is divided by n: the loss is the mean of the
ranks'.

Reading order: which experts a rank holds, dispatch order, ``ExpertParallelFeedForward`` (route,
dispatch, run, combine), ``ExpertParallel`` (the layers swapped in, the gradients averaged: the
data-parallel protocol of ``minitp.replicas``), then the state put back together for checks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from minitp import comm
from minitp.models.moe import MoEFeedForward, RoutedFeedForward, Routing, combine, moe_layers
from minitp.regions import all_to_all_rows
from minitp.replicas import GradientSync, all_reduce_mean, used_by_no_rank


def experts_of_rank(n_experts: int, ep: int, rank: int) -> range:
    """The experts rank ``rank`` of ``ep`` holds: a contiguous E/ep of them."""
    if n_experts % ep:
        raise ValueError(
            f"n_experts={n_experts} is not divisible by ep={ep}: every rank holds E/ep experts")
    per = n_experts // ep
    return range(rank * per, (rank + 1) * per)


def dispatch_order(routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's kept assignments grouped by expert (so by destination rank), each expert's in
    (b, s, slot) order: (order (A,) assignment ids = token·k + slot, counts (E,) per expert)."""
    expert, keep = routing.expert.reshape(-1), routing.keep.reshape(-1)  # (B·S·k,)
    kept = keep.nonzero().squeeze(1)
    order = kept[torch.sort(expert[kept], stable=True).indices]
    return order, torch.bincount(expert[order], minlength=routing.n_experts)


# its route(): the one-process routing, the same tokens dropped
class ExpertParallelFeedForward(RoutedFeedForward):
    """A ``MoEFeedForward`` whose experts are split over ``group``: this rank keeps the router and
    its E/n experts (under their own names, ``experts.5.w1``...), and swaps tokens with the
    others."""

    def __init__(self, moe: MoEFeedForward, group=None, name: str = "moe"):
        super().__init__()
        self.config, self.top_k, self.group, self.name = moe.config, moe.top_k, group, name
        self.world_size, rank = comm.group_size(group), comm.group_rank(group)
        self.n_experts = len(moe.experts)
        self.local = experts_of_rank(self.n_experts, self.world_size, rank)
        self.router = moe.router
        self.experts = nn.ModuleDict({str(e): moe.experts[e] for e in self.local})
        self.routing: Routing | None = None
        self.aux_loss: torch.Tensor | None = None
        self.history: list[torch.Tensor] = []  # kept assignments per expert, this rank's tokens
        self.routed: list[torch.Tensor] = []  # the same before capacity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        n, k, per = self.world_size, self.top_k, self.n_experts // self.world_size
        # remembers the routing, the auxiliary loss and the load, as on one process
        routing = self.route(x)
        order, counts = dispatch_order(routing)  # (A,), (E,)

        # dispatch: first the counts (rank j gets this rank's counts for its experts), then the rows
        # (E,) as (n, E/n): from rank i, rows for each local expert
        incoming = torch.empty_like(counts)
        comm.all_to_all(incoming, counts, group=self.group, label=f"{self.name}/dispatch.counts")
        incoming = incoming.view(n, per)
        send_splits = counts.view(n, per).sum(1).tolist()  # rows to each rank
        recv_splits = incoming.sum(1).tolist()  # rows from each rank
        # (A, D) the token of each assignment, grouped by expert
        rows = x.reshape(B * S, D)[order // k]
        received = all_to_all_rows(rows, recv_splits, send_splits, self.group,
                                   f"{self.name}/dispatch")

        # each local expert once, on its rows from every rank: regroup (source, expert) -> (expert,
        # source)
        starts = torch.cat([incoming.new_zeros(1),
                            incoming.reshape(-1).cumsum(0)[:-1]]).view(n, per)
        outputs = []
        for j, e in enumerate(self.local):
            mine = torch.cat([torch.arange(s, s + c, device=x.device)
                              for s, c in zip(starts[:, j].tolist(), incoming[:, j].tolist())]
                             # its rows from every source rank
                             + [torch.arange(0, device=x.device)])
            chunk = received[mine]  # (rows for expert e, D)
            outputs.append((mine, self.experts[str(e)](chunk) if len(mine) else chunk))
        where = torch.cat([m for m, _ in outputs])
        done = received.new_zeros(received.shape).index_copy(0, where,
                                                             torch.cat([o for _, o in outputs]))

        # combine: every output back to the rank of its token, then each token's k outputs by their
        # gates
        # (A, D)
        back = all_to_all_rows(done, send_splits, recv_splits, self.group, f"{self.name}/combine")
        slots = x.new_zeros(B * S * k, D).index_copy(0, order, back)
        return combine(slots.view(B, S, k, D), routing)


class ExpertParallel(GradientSync, nn.Module):
    """Make ``model`` (a MoE model, the same on every rank) expert parallel over ``group``: each MoE
    layer keeps E/n experts; after every backward the replicated parameters' gradients are averaged
    over the data-parallel ranks and the experts' over their copies, so every rank steps as one
    process would.

    dp_group: the ranks the replicated parameters are data parallel over (default: ``group``); on a
    mesh (``Mesh.ep_group``) it holds dp ranks, ep of which share one set of experts.
    expert_dp_group: the dp/ep ranks holding the same experts as this one, one in each ep group
    (needed when dp_group is larger than ``group``). Each rank's loss is the mean over its own
    sequences and the global loss their mean over the dp ranks, so an expert's gradient, which holds
    the contributions of every token its ep group sent it, is summed over its copies and divided by
    dp.
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None, dp_group=None,
                 expert_dp_group=None):
        super().__init__()
        self.module, self.group = model, group
        comm.name_group(group, "ep", unless_named=True)
        self.dp_group = group if dp_group is None else dp_group  # the replicated parameters' group
        self.expert_dp_group = expert_dp_group
        self.world_size = comm.group_size(group)
        if dp_group is not None:  # its own group object: its bytes count as "dp"
            ep_ranks, dp_ranks = comm.group_ranks(group), comm.group_ranks(dp_group)
            if not set(ep_ranks) <= set(dp_ranks):
                raise ValueError(f"dp_group {dp_ranks} must hold the ep group's ranks {ep_ranks}: "
                                 "the replicated parameters are data parallel over them")
            copies = len(dp_ranks) // len(ep_ranks)
            have = 1 if expert_dp_group is None else comm.group_size(expert_dp_group)
            if len(dp_ranks) % len(ep_ranks) or have != copies:
                raise ValueError(f"dp_group has {len(dp_ranks)} ranks and the ep group "
                                 f"{len(ep_ranks)}: expected an expert_dp_group of dp/ep = "
                                 f"{len(dp_ranks) / len(ep_ranks):g} ranks, got {have}")
            comm.name_group(dp_group, "dp", unless_named=True)
        self.dp_size = comm.group_size(self.dp_group)
        for i, block in model.layers.named_children():  # "0", "1"...; a pipeline stage's own blocks
            if isinstance(block.feed_forward, MoEFeedForward):
                block.feed_forward = ExpertParallelFeedForward(block.feed_forward, group,
                                                               f"ep/layers.{i}")
        self.expert_params = [p for layer in moe_layers(model) for p in layer.experts.parameters()]
        ids = {id(p) for p in self.expert_params}
        self.replicated_params = [p for p in model.parameters() if id(p) not in ids]
        for p in model.parameters():  # finish_gradients, once, when a backward pass is over
            p.register_post_accumulate_grad_hook(lambda p: self.queue_finish())

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def finish_gradients(self) -> None:
        """Average the replicated gradients over dp (one flat all-reduce); the experts' over their
        copies (one flat all-reduce over expert_dp_group, every expert in it, when there are
        copies), or divide them."""
        grads = [p.grad for p in self.replicated_params]
        if any(g is None for g in grads):
            missing = [i for i, g in enumerate(grads) if g is None]
            raise RuntimeError(
                f"replicated parameters {missing[:5]} got no gradient; every rank must use them")
        all_reduce_mean(grads, self.dp_group, self.dp_size, "ep/replicated_grads")
        if self.expert_dp_group is not None and comm.group_size(self.expert_dp_group) > 1:
            # every copy sends every expert's slot, so the copies' buffers line up whichever experts
            # got tokens where; an expert no copy's tokens reached keeps grad None, as on one
            # process
            all_reduce_mean_of_used(self.expert_params, self.expert_dp_group, self.dp_size,
                                    "ep/expert_grads")
        else:  # the only copy: an expert with no gradient got no token from any rank
            for p in self.expert_params:
                if p.grad is not None:
                    p.grad.div_(self.dp_size)


@torch.no_grad()
def all_reduce_mean_of_used(params: list[torch.nn.Parameter], group, divide_by: int,
                            label: str) -> None:
    """``all_reduce_mean`` of the gradients of ``params`` when a rank may not have used some of them
    (``grad`` None here): every rank sends a slot for every parameter, so the ranks' buffers line up
    whatever each used. A parameter this rank did not use sends -0.0, one it used never does (+0.0
    added), so after the sum a parameter no rank used reads -0.0 everywhere and keeps ``grad`` None,
    as on one process; one used elsewhere gets the average, this rank counting as zeros."""
    if not params:
        return
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype,
                       device=params[0].device)
    views, offset = [], 0
    for p in params:
        view = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        if p.grad is None:  # not used here: -0.0 says so
            view.fill_(-0.0)
        else:  # divided first, as all_reduce_mean does; used here: never -0.0
            torch.div(p.grad, divide_by, out=view).add_(0.0)
        views.append(view)
    comm.all_reduce(flat, group=group, label=label)
    for p, averaged in zip(params, views):
        if p.grad is not None:
            p.grad.copy_(averaged)
        # used on another rank: the average, in a tensor of its own
        elif not used_by_no_rank(averaged):
            p.grad = averaged.clone()


def local_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters under the plain model's names (its experts only)."""
    state = {}
    for k, v in model.state_dict().items():
        state[k.removeprefix("module.")] = v.detach().clone()
    return state


def full_state(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every rank's state put together: the replicated parameters from rank 0, each expert from its
    rank."""
    full = dict(states[0])
    for s in states[1:]:
        full.update({k: v for k, v in s.items() if ".experts." in k})
    return full
