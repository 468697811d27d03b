"""The plan of a Spec under given run settings, for the plan's unit tests: the Desired the operation
would hand gpugate.plan.make_plan, built from a Spec (None: no server) and the settings by the names
the tests use."""

from __future__ import annotations

from typing import Any

from gpugate import plan
from gpugate.spec import Desired, Spec, budgets


def plan_of(observation: dict[str, Any], spec: Spec | None, *, port: int, restart: bool = False,
            rollback_k: int | None = None, siblings: tuple[int, ...] = (), max_used_mib: int = 64,
            min_free_mib: int = 64, end_other_gpu_holders: bool = False, agent_silence_s: float = 30.0,
            run_order: tuple = (), executing: bool = False, **budget_values: float) -> plan.Plan:
    desired = Desired(port=port, present=spec is not None, python=spec.python if spec else "/usr/bin/python3",
                      spec=spec, budgets=budgets({"max_used_mib": max_used_mib, **budget_values}),
                      engine=spec.engine if spec else "sglang", min_free_mib=min_free_mib,
                      agent_silence_s=agent_silence_s, end_other_gpu_holders=end_other_gpu_holders,
                      restarted=restart, rollback_to=rollback_k or 1, siblings=siblings, run_order=run_order)
    return plan.make_plan(observation, desired, restoring=rollback_k is not None, executing=executing)
