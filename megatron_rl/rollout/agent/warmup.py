"""The supervised warm-up of a toy agentic task: tool-call demonstrations, trained on model turns only.

An inline toy policy knows nothing before RL; the main job warms it up on the task's answers
(``megatron_rl.models.tiny.sft_warmup``). An agentic task's demonstrations are sessions instead
(``megatron_rl.data.agent_tasks.AGENT_DEMOS``: a calculator call, its result, the answer -- or a
direct answer), and they are assembled exactly as the agent loop assembles a session: the prompt
rendered with the tools (``ChatFormat.prompt_ids``), each model turn as its encoded text plus eos
(loss on these), each observation as ``ChatFormat.observation_ids`` (no loss). So RL starts from
the token layout it trains on.

``agent_tokenizer_texts`` gives the tokenizer trainer the rendered demonstrations (its merges
then cover the tool-call syntax and the tools' system block); ``agent_sft_warmup`` trains.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from megatron_rl.data.agent_tasks import AGENT_DEMOS, DEMO_TOOL_FRACTION
from megatron_rl.rollout.agent.chat import TOOL_CHATML_TEMPLATE, ChatFormat
from megatron_rl.rollout.agent.parser import get_parser
from megatron_rl.rollout.tools.tool_registry import load_tools

AGENT_SFT_BATCH_SIZE = 16
"""Demonstrations per warm-up step: copying is learnt from the number of steps more than from
their size, so smaller steps buy more of them."""

__all__ = [
    "AGENT_SFT_BATCH_SIZE",
    "is_agent_task",
    "demonstrations",
    "agent_tokenizer_texts",
    "agent_sft_examples",
    "agent_sft_warmup",
    "agent_task_texts",
    "install_tool_chat_template",
    "agent_warmup",
]


def is_agent_task(task: Optional[str]) -> bool:
    """True for a built-in task with agent demonstrations (``AGENT_DEMOS``)."""
    return task is not None and task in AGENT_DEMOS


def _tool_schemas(tool_config_path: Optional[str]) -> list[dict]:
    return [t.tool_schema.to_openai() for t in load_tools(tool_config_path).values()]


def demonstrations(
    task: str,
    rows: Sequence[dict],
    seed: int,
    tool_fraction: float = DEMO_TOOL_FRACTION,
    tool_names: Optional[Sequence[str]] = None,
) -> list[list[dict]]:
    """Each row's full conversation (prompt + demonstration); ``tool_fraction`` of them call a tool.
    ValueError when a demonstration calls a tool that ``tool_names`` lacks."""
    rng = np.random.default_rng(seed)
    out = []
    for row in rows:
        demo = AGENT_DEMOS[task](row, bool(rng.random() < tool_fraction))
        for m in demo:
            for call in m.get("tool_calls", []):
                if tool_names is not None and call["function"]["name"] not in tool_names:
                    raise ValueError(
                        f"task {task!r} demonstrates tool {call['function']['name']!r}, which "
                        f"multi_turn.tool_config_path does not provide (tools: {list(tool_names)})"
                    )
        out.append(list(row["prompt"]) + demo)
    return out


def agent_tokenizer_texts(
    task: str,
    rows: Sequence[dict],
    tool_config_path: Optional[str],
    seed: int = 0,
    chat_template: str = TOOL_CHATML_TEMPLATE,
) -> list[str]:
    """Tokenizer-training texts: the rendered demonstrations of ``rows`` (half with a tool call)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = _tool_schemas(tool_config_path) or None
    convs = demonstrations(task, rows, seed, tool_fraction=0.5)
    rendered, _ = render_jinja_template(convs, tools=tools, chat_template=chat_template)
    return list(rendered)


def agent_sft_examples(
    chat: ChatFormat, conversations: Sequence[list[dict]], num_prompt_messages: Sequence[int], fmt: str = "hermes"
) -> list[tuple[list[int], list[int]]]:
    """``(ids, loss_mask)`` per conversation, assembled as the agent loop assembles a session."""
    parser = get_parser(fmt)
    examples = []
    for conv, num_prompt in zip(conversations, num_prompt_messages):
        ids = chat.prompt_ids(conv[:num_prompt])
        mask = [0] * len(ids)
        rest, i = conv[num_prompt:], 0
        while i < len(rest):
            m = rest[i]
            if m["role"] == "assistant":
                calls = [
                    parser.format(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])
                ]
                text = "\n".join(([m["content"]] if m["content"] else []) + calls)
                turn = chat.encode(text) + [chat.eos_token_id]
                ids, mask, i = ids + turn, mask + [1] * len(turn), i + 1
            else:
                j = i
                while j < len(rest) and rest[j]["role"] == "tool":
                    j += 1
                if j == i:
                    raise ValueError(
                        f"a demonstration continues with a {m['role']!r} message; only assistant and "
                        "tool messages follow the prompt"
                    )
                obs = chat.observation_ids(rest[i:j])
                ids, mask, i = ids + obs, mask + [0] * len(obs), j
        examples.append((ids, mask))
    return examples


def agent_sft_warmup(
    model_dir: str | Path,
    out_dir: str | Path,
    task: str,
    rows: Sequence[dict],
    *,
    steps: int,
    tool_config_path: Optional[str],
    chat_template: Optional[str] = None,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    warmup_ratio: float = 0.1,
    log: Optional[list] = None,
) -> Path:
    """Train the HF model in ``model_dir`` for ``steps`` AdamW steps on ``task``'s demonstrations of
    ``rows``; save it (with its tokenizer) to ``out_dir`` and return that path.

    Loss: mean cross-entropy over the model-turn tokens (eos included), cosine-decayed ``lr``
    after a linear warm-up, as ``megatron_rl.models.tiny.sft_warmup``; ``log`` receives the losses.
    """
    from transformers import AutoTokenizer

    from megatron_rl.models.tiny import sft_train

    if steps < 1:
        raise ValueError(f"agent_sft_warmup: steps={steps} must be >= 1")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tools = load_tools(tool_config_path)
    chat = ChatFormat(tokenizer, [t.tool_schema.to_openai() for t in tools.values()] or None, chat_template)
    convs = demonstrations(task, rows, seed, tool_names=list(tools))
    examples = agent_sft_examples(chat, convs, [len(r["prompt"]) for r in rows])
    # One thread: a tiny model gains nothing from more; on a busy machine they cost ~5x.
    return sft_train(
        model_dir,
        out_dir,
        examples,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        warmup_ratio=warmup_ratio,
        log=log,
        record={"task": task},
        num_threads=1,
    )


# -- the main job's entry points (megatron_rl.job.prepare) ----------------------------------------
def agent_task_texts(config: Any, rows: Sequence[dict]) -> list[str]:
    """Tokenizer texts a run's agentic ``data.task`` adds to the task's own (see ``agent_tokenizer_texts``)."""
    return agent_tokenizer_texts(
        config.data.task,
        rows,
        config.actor_rollout_ref.rollout.multi_turn.tool_config_path,
        seed=int(config.data.seed or 0),
    )


def install_tool_chat_template(model_dir: str | Path) -> None:
    """Give the inline model's tokenizer in ``model_dir`` the tool-aware ChatML (``TOOL_CHATML_TEMPLATE``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.chat_template = TOOL_CHATML_TEMPLATE
    tokenizer.save_pretrained(str(model_dir))


def agent_warmup(
    config: Any, model_dir: str | Path, out_dir: str | Path, rows: Sequence[dict], *, log: Optional[list] = None
) -> Path:
    """``agent_sft_warmup`` with the run's settings (``trainer.sft_warmup_steps`` / ``sft_warmup_lr``,
    the tools of ``multi_turn.tool_config_path``, ``model.custom_chat_template``, ``data.seed``)."""
    return agent_sft_warmup(
        model_dir,
        out_dir,
        config.data.task,
        rows,
        steps=config.trainer.sft_warmup_steps,
        tool_config_path=config.actor_rollout_ref.rollout.multi_turn.tool_config_path,
        chat_template=config.actor_rollout_ref.model.custom_chat_template,
        lr=config.trainer.sft_warmup_lr,
        batch_size=AGENT_SFT_BATCH_SIZE,
        seed=int(config.data.seed or 1),
        log=log,
    )
