"""Long-context evaluation: does eviction keep the answers of the full cache?

tasks    seeded prompt generators (passkey, needle in a haystack, fidelity document)
code_tasks  questions about a generated Python project, in chat format
policies named cache policies (full, snapkv-b1024-head-avg-k31-w32-s4, ...)
runner   one prefill per prompt, branched into every policy
report   results.json, summary.md, PNG plots
cli      `engine eval`
"""
from .policies import Policy, default_policies, parse_policy
from .runner import EvalPlan, Runner
from .tasks import TASKS, make_sample

__all__ = ["EvalPlan", "Policy", "Runner", "TASKS", "default_policies", "make_sample", "parse_policy"]
