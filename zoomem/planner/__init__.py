"""The planner: a cost model from the traced step, the ILP and the baseline strategies, and the Plan."""

from .costs import EXPENSIVE_KINDS, OUTSIDE_UNITS, CostModel
from .plan import Decision, InfeasibleBudgetError, Plan, UnitPlan, parse_budget
from .solve import STRATEGIES, make_plan, min_feasible_budget

__all__ = [
    "EXPENSIVE_KINDS",
    "OUTSIDE_UNITS",
    "STRATEGIES",
    "CostModel",
    "Decision",
    "InfeasibleBudgetError",
    "Plan",
    "UnitPlan",
    "make_plan",
    "min_feasible_budget",
    "parse_budget",
]
