"""All stages of one pipeline replica in one process: the convergence simulator's trainer."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from parallelism.schedule import natural_routes, swapped_routes
from parallelism.seeding import seed_everything
from parallelism.spec import linear_warmup
from parallelism.workloads.data import LMBatches
from parallelism.workloads.llama import (
    LlamaStage,
    build_llama_stage,
    edge_partner,
    edge_replica_home,
    edge_replica_keys,
    llama_loss,
)
from recovery.strategies.checkfree import (
    CheckFreeConfig,
    GradNormTracker,
    clip_stage_gradients,
    load_optimizer_moments,
    optimizer_moments,
    rebuild_stage,
    sum_shared_gradients,
)
from simulations.convergence_config import ConvergenceSetup

__all__ = ["PipelineTrainer"]


class PipelineTrainer:
    """All stages of one pipeline replica in this process, trained microbatch by microbatch.

    Args:
        setup: model, data and optimizer.
        plus: CheckFree+ -- swapped routes and (de)embedding replicas.
        batches: the data (default ``setup.batches()``; pass one to share the corpus).
        swap_every: with ``plus``, microbatch ``m`` is swapped iff ``m % swap_every ==
            swap_every - 1`` (2: every odd one, as published).

    The modules are built as `parallelism.spec.TrainSpec` builds them (torch seeded from
    ``(seed, "init", stage)``), so stage ``s`` starts with the same weights here as in the
    distributed runtime.

    Raises:
        ValueError: if ``plus`` is asked for with fewer than 4 stages.
    """

    def __init__(
        self,
        setup: ConvergenceSetup,
        *,
        plus: bool = False,
        batches: LMBatches | None = None,
        swap_every: int = 2,
    ) -> None:
        S = setup.stages
        if plus and S < 4:
            raise ValueError(f"CheckFree+ needs at least 4 stages, got {S}")
        self.setup = setup
        self.plus = plus
        self.config = setup.model_config()
        self.batches = batches if batches is not None else setup.batches()
        self.routes = natural_routes(S, setup.microbatches)
        if plus:
            swapped = swapped_routes(S, setup.microbatches)
            # swapped_routes swaps the odd microbatches; swap_every > 2 keeps fewer of them.
            self.routes = tuple(
                swapped[1] if m % swap_every == swap_every - 1 else route
                for m, route in enumerate(self.routes)
            )
        self.modules: list[LlamaStage] = [self._build(s, ("init", s)) for s in range(S)]
        self.optimizers = [self._make_optimizer(s) for s in range(S)]
        self.tracker = GradNormTracker(S)
        self.rebuilt_at: list[int | None] = [None] * S
        """Step at which each stage was last rebuilt (``None``: never)."""
        self.stage_configs: list[CheckFreeConfig | None] = [None] * S
        """The config each rebuilt stage's learning-rate factor follows."""

    # -- construction ----------------------------------------------------------------------

    def _build(self, stage: int, key: tuple[str | int, ...]) -> LlamaStage:
        seed_everything(self.setup.seed, *key)
        return build_llama_stage(
            self.config,
            stage,
            self.setup.stages,
            edge_replicas=self.plus,
            replica_seed=self.setup.seed,
        )

    def shared_keys(self, stage: int) -> list[str]:
        """The CheckFree+ shared parameter names of ``stage`` (empty without CheckFree+)."""
        return edge_replica_keys(stage, self.setup.stages) if self.plus else []

    def _make_optimizer(self, stage: int) -> torch.optim.Optimizer:
        shared = set(self.shared_keys(stage))
        named = list(self.modules[stage].named_parameters())
        groups: list[dict[str, Any]] = [
            {"params": [p for n, p in named if n not in shared], "shared": False}
        ]
        if shared:
            groups.append({"params": [p for n, p in named if n in shared], "shared": True})
        return torch.optim.AdamW(
            groups,
            lr=self.setup.lr,
            betas=(0.9, 0.95),
            weight_decay=self.setup.weight_decay,
        )

    # -- training --------------------------------------------------------------------------

    def forward_route(self, inputs: torch.Tensor, route: Sequence[int]) -> torch.Tensor:
        """Run ``inputs`` through the stages in ``route`` order; the logits of the last."""
        x = inputs
        last = len(route) - 1
        for position, stage in enumerate(route):
            x = self.modules[stage](x, first=position == 0, last=position == last)
        return x

    def train_step(self, step: int) -> float:
        """One optimizer step on step ``step``'s data; returns the mean training loss."""
        S, M = self.setup.stages, self.setup.microbatches
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(M):
            inputs, targets = self.batches.microbatch(step, 0, m)
            loss = llama_loss(self.forward_route(inputs, self.routes[m]), targets)
            (loss / M).backward()
            total += float(loss.detach())
        if self.plus:
            sum_shared_gradients(self._tied_pairs())
        for s in range(S):
            shared = set(self.shared_keys(s))
            named = list(self.modules[s].named_parameters())
            norm = clip_stage_gradients(
                [p for n, p in named if n not in shared],
                [p for n, p in named if n in shared],
                max_norm=self.setup.clip_grad_norm,
                shared_is_home=edge_replica_home(s, S) if self.plus else True,
            )
            self.tracker.record(s, norm)
            self._set_lr(s, step)
            self.optimizers[s].step()
        return total / M

    def _tied_pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        S = self.setup.stages
        pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        for home in (0, S - 1):
            partner = edge_partner(home, S)
            assert partner is not None
            a = dict(self.modules[home].named_parameters())
            b = dict(self.modules[partner].named_parameters())
            pairs.extend((a[k], b[k]) for k in edge_replica_keys(home, S))
        return pairs

    def _set_lr(self, stage: int, step: int) -> None:
        base = self.setup.lr * linear_warmup(step, warmup_steps=self.setup.warmup_steps)
        rebuilt, cfg = self.rebuilt_at[stage], self.stage_configs[stage]
        factor = 1.0 if rebuilt is None or cfg is None else cfg.lr_factor(max(0, step - rebuilt))
        for group in self.optimizers[stage].param_groups:
            # Shared parameters keep the unscaled rate on both holders (they must stay equal).
            group["lr"] = base if group.get("shared") else base * factor

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``eval_batches`` fixed held-out microbatches (natural route)."""
        route = tuple(range(self.setup.stages))
        losses = []
        mb = self.setup.microbatches
        for index in range(self.setup.eval_batches):
            inputs, targets = self.batches.microbatch(index // mb, 0, index % mb, split="val")
            losses.append(float(llama_loss(self.forward_route(inputs, route), targets)))
        return sum(losses) / len(losses)

    # -- state -----------------------------------------------------------------------------

    def states(self) -> list[dict[str, torch.Tensor]]:
        """A copy of every stage's state dict."""
        return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in self.modules]

    def snapshot(self) -> dict[str, Any]:
        """Everything a rollback restores: weights, optimizer states, norms, rebuild marks."""
        return {
            "states": self.states(),
            "optimizers": [copy.deepcopy(o.state_dict()) for o in self.optimizers],
            "tracker": self.tracker.copy(),
            "rebuilt_at": list(self.rebuilt_at),
            "stage_configs": list(self.stage_configs),
        }

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """Roll every stage back to ``snapshot`` (from `snapshot`)."""
        for s, module in enumerate(self.modules):
            module.load_state_dict(snapshot["states"][s])
            self.optimizers[s] = self._make_optimizer(s)
            self.optimizers[s].load_state_dict(copy.deepcopy(snapshot["optimizers"][s]))
        self.tracker = snapshot["tracker"].copy()
        self.rebuilt_at = list(snapshot["rebuilt_at"])
        self.stage_configs = list(snapshot["stage_configs"])

    def rebuild(
        self, lost: Sequence[int], config: CheckFreeConfig, *, step: int, attempt: int
    ) -> list[str]:
        """Rebuild the ``lost`` stages from their live neighbours (CheckFree / CheckFree+).

        Every lost stage is rebuilt from the states the survivors hold now; their
        optimizers restart as ``config`` says and their learning-rate factor restarts at
        ``step``. Returns the method used per stage.

        Raises:
            RedundancyExhausted: if some lost stage cannot be rebuilt (an edge stage without
                CheckFree+, or a lost neighbour); nothing has been changed then.
        """
        S = self.setup.stages
        lost_set = set(lost)
        plans = []
        for s in sorted(lost_set):
            prev = s - 1 if s > 0 and s - 1 not in lost_set else None
            nxt = s + 1 if s + 1 < S and s + 1 not in lost_set else None
            template = self._build(s, ("rebuild", s, attempt)).state_dict()
            prev_norm, next_norm = self.tracker.neighbours(s)
            need_moments = not config.reset_optimizer or self.plus
            rebuilt = rebuild_stage(
                config,
                stage=s,
                num_stages=S,
                template=template,
                prev=self.modules[prev].state_dict() if prev is not None else None,
                nxt=self.modules[nxt].state_dict() if nxt is not None else None,
                prev_norm=prev_norm if prev is not None else None,
                next_norm=next_norm if nxt is not None else None,
                edge_replicas=self.plus,
                exact_keys=self.shared_keys(s),
                prev_moments=self._moments(prev) if need_moments and prev is not None else None,
                next_moments=self._moments(nxt) if need_moments and nxt is not None else None,
            )
            plans.append((s, rebuilt))
        for s, rebuilt in plans:
            self.modules[s].load_state_dict(rebuilt.state)
            self.optimizers[s] = self._make_optimizer(s)
            load_optimizer_moments(self.modules[s], self.optimizers[s], rebuilt.moments)
            self.tracker.forget(s)
            self.rebuilt_at[s] = step
            self.stage_configs[s] = config
        return [rebuilt.method for _, rebuilt in plans]

    def _moments(self, stage: int) -> dict[str, dict[str, torch.Tensor]]:
        return optimizer_moments(self.modules[stage], self.optimizers[stage])

    def reinit(self, stage: int, *, attempt: int, partner_lost: bool = False) -> None:
        """Re-initialise ``stage`` (the last resort when it cannot be rebuilt and there is no
        checkpoint). CheckFree+ shared parameters are copied, with their optimizer state,
        from their other holder unless that one is lost too (``partner_lost``); then both
        holders draw them fresh from the same replica seed and stay equal."""
        S = self.setup.stages
        fresh = self._build(stage, ("rebuild", stage, attempt)).state_dict()
        partner = edge_partner(stage, S) if self.plus else None
        copy_shared = partner is not None and not partner_lost
        if copy_shared:
            assert partner is not None
            live = self.modules[partner].state_dict()
            for key in self.shared_keys(stage):
                fresh[key] = live[key].clone()
        self.modules[stage].load_state_dict(fresh)
        self.optimizers[stage] = self._make_optimizer(stage)
        if copy_shared:
            assert partner is not None
            moments = self._moments(partner)
            load_optimizer_moments(
                self.modules[stage],
                self.optimizers[stage],
                {k: moments[k] for k in self.shared_keys(stage) if k in moments},
            )
        self.tracker.forget(stage)
        self.rebuilt_at[stage] = None
        self.stage_configs[stage] = None
