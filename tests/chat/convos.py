"""Multi-turn agent conversations shared by the chat and judge tests."""

from __future__ import annotations

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Semantic code search.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "What to look for."},
                "lines": {"type": "integer", "description": "Result lines to return."},
            },
            "required": ["query"],
        },
    },
}


def call(name: str, **args) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": args}}


def conversation() -> list[dict]:
    """4 assistant turns: thinking + call, two calls, user follow-up, thinking + final answer."""
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the off-by-one bug in count()."},
        {"role": "assistant", "reasoning_content": "I should find count first.",
         "content": "Let me search for it.", "tool_calls": [call("search", query="def count")]},
        {"role": "tool", "content": "src/util.py:12: def count(items):"},
        {"role": "assistant", "content": "Found it; editing and testing.",
         "tool_calls": [call("edit_file", path="src/util.py", old="n - 1", new="n"),
                        call("run", command="pytest -q")]},
        {"role": "tool", "content": "ok"},
        {"role": "tool", "content": "3 passed in 0.01s"},
        {"role": "user", "content": "Great. Anything else?"},
        {"role": "assistant", "content": "", "tool_calls": [call("search", query="count(", lines="5")]},
        {"role": "tool", "content": "src/app.py:3: count(xs)"},
        {"role": "assistant", "reasoning_content": "Summarise for the user.",
         "content": "| File | Change |\n|---|---|\n| `src/util.py` | fixed bound |\n\n**Tests pass.**"},
    ]
