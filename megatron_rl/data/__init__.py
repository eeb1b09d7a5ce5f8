"""megatron_rl.data: the step's Batch, prompt datasets and toy tasks, rewards and reward shaping.

Importing the package registers every built-in toy task and rule reward (``agent_tasks`` adds the
agentic ``toy_multiply``), so the registries do not depend on which module was imported first.
"""

from megatron_rl.data import agent_tasks  # noqa: F401  (registers toy_multiply)
