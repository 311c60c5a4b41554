"""The plans of one `regen.apply` handle, and the choice of each step's plan.

`regen.apply(model, plan)` takes one plan; `regen.apply(model, [plan_a, plan_b])` a *plan set*: one plan
per way the training loop calls the model (a GAN's discriminator in its own step and in the generator's,
where its input requires grad and it saves more). Each plan was profiled with its own call; its
`Plan.call` (regen.call_signature) says how, and a step runs under the plan whose call it has. The plans
of a set must each record their call, and no two the same one.

Each plan keeps what its own steps found (`PlanState`: verified, the pack-order fast path's records),
since the steps of one use say nothing about the other's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from torch import nn

from regen.call_signature import call_inputs, call_signature, describe, grad_difference, trainable_parameters
from regen.errors import RegenError
from regen.formats.plan import Plan, load_plan
from regen.runtime.forward_ops import FastOps
from regen.runtime.packing import PackRecord
from regen.runtime.plan_index import PlanIndex, index_plan
from regen.runtime.step import StepContext

TWO_USES_DOC = 'docs/recipes.md "A module used two ways"'
PLAN_SUFFIX = ".plan.yaml"  # the plan files of a directory of plans


@dataclass
class PlanState:
    """One plan of a handle and what its steps found for its later steps (StepFindings)."""

    plan: Plan
    index: PlanIndex
    context: StepContext | None = None  # what its steps get (set by the handle)
    verified: bool = False
    pack_sequence: tuple[PackRecord, ...] | None = None  # the fast path's (docs/internals.md)
    fast_ops: FastOps | None = None  # with recompute decisions: what fast steps still track
    steps: int = 0  # steps begun under the plan
    diverged_steps: int = 0  # of which left the plan mid-step (on_mismatch="dynamic": regen.runtime.apply)


def plan_states(plans) -> list[PlanState]:
    """The handle's plans: a Plan, a plan file, a directory of plan files (`*.plan.yaml`, such as
    `save_learned_plans` writes), or a list of them (a plan set), checked."""
    given = list(plans) if isinstance(plans, (list, tuple)) else [plans]
    given = [p for plan in given for p in _plan_files(plan)]
    if not given:
        raise RegenError("regen.apply: an empty list of plans; give a plan, or one plan per use of the model")
    loaded = []
    for plan in given:
        if isinstance(plan, (str, Path)):
            plan = load_plan(plan)
        if not isinstance(plan, Plan):
            raise RegenError(f"regen.apply: expected a regen Plan (regen.load_plan(path)), got {type(plan).__name__}")
        loaded.append(plan)
    if len(loaded) > 1:
        _check_set(loaded)
    return [PlanState(plan, index_plan(plan)) for plan in loaded]


def add_plan(states: list[PlanState], plan: Plan) -> PlanState:
    """A plan joins the set (a learned one): its call must be recorded and none of the set's."""
    if plan.call is None or any(s.plan.call == plan.call for s in states):
        raise RegenError("regen.apply: a learned plan's call is missing or already in the set")
    state = PlanState(plan, index_plan(plan))
    states.append(state)
    return state


def _plan_files(plan) -> list:
    """A directory's plan files, in name order; anything else as given."""
    if not isinstance(plan, (str, Path)) or not Path(plan).is_dir():
        return [plan]
    files = sorted(Path(plan).glob(f"*{PLAN_SUFFIX}"))
    if not files:
        raise RegenError(f"regen.apply: the directory {plan} holds no plan files (*{PLAN_SUFFIX})")
    return files


def _check_set(plans: list[Plan]) -> None:
    for k, plan in enumerate(plans):
        if plan.call is None:
            raise RegenError(f"regen.apply: plan {k} of the set does not record how its step called the model "
                             f"(profiled by an older regen); profile and solve it again")
        for j in range(k):
            if plans[j].call == plan.call:
                raise RegenError(f"regen.apply: plans {j} and {k} of the set were profiled with the same call "
                                 f"({describe(plan.call)}); a set holds one plan per way the model is called "
                                 f"({TWO_USES_DOC})")


def choose(states: list[PlanState], root: nn.Module, args: tuple, kwargs: dict, by_call: bool,
           trainable: Callable[[], int]) -> tuple[PlanState | None, str]:
    """The plan for a call of the model: (its state, "") or (None, why none fits).

    A single plan takes every call, unless `by_call` (a handle that runs such calls in dynamic mode): then
    each plan that records its call (`Plan.call`) takes only that call, its trainable parameters included
    (`trainable()`: their number, e.g. a call_signature.TrainableCount)."""
    if len(states) == 1 and not (by_call and states[0].plan.call is not None):
        return states[0], ""
    inputs = call_inputs(args, kwargs)
    matching = [s for s in states if s.plan.call.inputs == inputs]
    if len(matching) > 1 or by_call:
        count = trainable()
        matching = [s for s in matching if s.plan.call.trainable_parameters == count]
    if len(matching) == 1:
        return matching[0], ""
    call = describe(call_signature(root, args, kwargs))
    if not states:
        return None, f"no plan fits this call of the model ({call}) yet"
    profiled = " | ".join(f"plan {k}: {describe(s.plan.call)}" for k, s in enumerate(states))
    return None, (f"this call of the model ({call}) is none of the plan set's ({profiled}); profile and solve "
                  f"this use too ({TWO_USES_DOC})")


def call_difference(state: PlanState, root: nn.Module, args: tuple, kwargs: dict) -> Callable[[], str | None]:
    """For a step's mismatch message: how its call's requires_grad flags differ from its plan's profiled call
    (the arguments' flags are read now; the parameters' only if a mismatch asks)."""
    profiled = state.plan.call
    if profiled is None:
        return lambda: None
    inputs = call_inputs(args, kwargs)

    def explain() -> str | None:
        difference = grad_difference(profiled, inputs, trainable_parameters(root))
        if difference is None:
            return None
        return (f"this call differs from the profiled one ({difference}), so autograd saves other tensors: "
                f"profile this use of the model too and apply both plans, regen.apply(model, [plan_a, plan_b]) "
                f"({TWO_USES_DOC})")

    return explain
