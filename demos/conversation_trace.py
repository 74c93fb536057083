"""The conversation ``kamera demo`` replays: an on-call agent's window, model call by model call.

An assistant for a platform team investigates a latency alert with four tools (logs, runbook
search, deploys, metrics). Its window is the system prompt with the tool definitions, then the
conversation; the agent's own turns are recorded (tool calls and short findings), and the model
is asked for the next one at every step. The context manager does what agent windows do:

- most steps append (the agent's call and the tool's output, or a user turn);
- it keeps the last three tool outputs: the fourth drops the oldest one, call and output, and
  everything after it moves up (the window slides);
- it keeps retrieved passages ranked for the latest user question: when the question changes
  the ranking, the passages of the search result swap places inside that message (reordered).

Tool outputs reach the model as the server renders them: a ``tool`` message where the chat
template takes tools, else a user turn inside ``<tool_response>`` tags.

Not here: answering it (``demos/conversation.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from agent.engine.chat import Message
from agent.engine.tools import ToolCall

Change = Literal["start", "appended", "slid", "reordered"]

SYSTEM = (
    "You are Relay, the on-call assistant of the Shopfront platform team. You investigate alerts "
    "with the tools below, one call at a time, and report to the engineer on call.\n"
    "- Read logs and metrics before you suggest a change; quote the line or number you rely on.\n"
    "- Never restart, scale or roll back a service yourself: propose the command and wait for the "
    "engineer to confirm.\n"
    "- Keep answers short: what you found, what it means, the next step.\n"
    "- Times are UTC. The engineer on call today is Dana Okafor (platform team)."
)


def _tool(name: str, description: str, properties: dict[str, object], required: Sequence[str]) -> dict:
    parameters = {"type": "object", "properties": properties, "required": list(required)}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


_SERVICE = {"type": "string", "description": "service name, e.g. checkout-api"}
TOOLS = [
    _tool(
        "get_logs",
        "Recent log lines of a service, newest last.",
        {
            "service": _SERVICE,
            "since": {"type": "string", "description": "HH:MM, UTC"},
            "level": {"type": "string", "enum": ["debug", "info", "warn", "error"]},
        },
        ["service", "since"],
    ),
    _tool(
        "search_runbooks",
        "Search the team's runbooks and postmortems; returns the best passages.",
        {"query": {"type": "string"}, "top_k": {"type": "integer", "minimum": 1, "maximum": 5}},
        ["query"],
    ),
    _tool(
        "get_deploy",
        "The last deploy of a service: version, time, author, migrations and config diff.",
        {"service": _SERVICE},
        ["service"],
    ),
    _tool(
        "get_metrics",
        "Metrics of a service over the last minutes, one row per minute.",
        {
            "service": _SERVICE,
            "metrics": {"type": "array", "items": {"type": "string"}},
            "window_minutes": {"type": "integer", "minimum": 1, "maximum": 180},
        },
        ["service", "metrics"],
    ),
]

LOGS = """\
09:01:47 INFO  deploy checkout-api v2.41.0 started (build 7f3c2e1, by m.alvarez)
09:03:12 INFO  checkout-api v2.41.0 serving on 12/12 pods
09:05:08 WARN  db pool orders-db: 10/10 connections in use, request waited 412 ms
09:05:31 WARN  db pool orders-db: 10/10 connections in use, request waited 967 ms
09:06:02 WARN  POST /v1/checkout 2214 ms (pool wait 1630 ms) trace=4be1f0a9
09:06:45 ERROR payment-gateway call timed out after 3000 ms, retry 1/3 trace=91c07d2e
09:07:10 WARN  db pool orders-db: 10/10 connections in use, request waited 1804 ms
09:08:56 WARN  POST /v1/checkout 2731 ms (pool wait 2102 ms) trace=c3d5a7e0
09:10:03 ERROR payment-gateway call timed out after 3000 ms, retry 2/3 trace=91c07d2e
09:11:40 WARN  db pool orders-db: 10/10 connections in use, request waited 2388 ms
09:12:01 WARN  POST /v1/checkout 3050 ms (pool wait 2515 ms) trace=e8a4419b"""

PASSAGES = {
    "pool": "runbooks/checkout-api.md > Connection pool\n"
    "checkout-api holds one orders-db connection for the whole checkout, the payment call included. "
    "The pool size is DB_POOL_SIZE (default 40 per pod). When the pool is exhausted, requests queue "
    "for a connection and p99 latency grows with the queue. Raising the pool is safe up to 60 per "
    "pod: orders-db accepts 800 connections across all pods.",
    "postmortem": "postmortems/2024-03-18-checkout-latency.md > Summary\n"
    "Checkout p99 rose to 4 s for 38 minutes after a config change halved DB_POOL_SIZE. The payment "
    "gateway was slow that morning, so each checkout held its connection longer and the smaller "
    "pool ran out first. Resolution: the config was rolled back. Follow-up: alert when pool waits "
    "exceed 200 ms.",
    "rollback": "runbooks/rollback.md > Rolling back a deploy\n"
    "Roll back with `shipctl rollback <service> --to <version>`; it takes about four minutes for 12 "
    "pods and drains in-flight requests. A deploy with a database migration is rolled back only by "
    "its author; a config-only deploy may be rolled back by the engineer on call.",
}

DEPLOY = """\
checkout-api v2.41.0, deployed 09:01 UTC by m.alvarez (PR #2281 "Tune pools for pgbouncer")
previous: v2.40.3, deployed May 28
migrations: none
config diff:
-  DB_POOL_SIZE: 40
+  DB_POOL_SIZE: 10
-  DB_POOL_TIMEOUT_MS: 5000
+  DB_POOL_TIMEOUT_MS: 3000
   PAYMENT_TIMEOUT_MS: 3000
notes: the pgbouncer rollout to orders-db is planned for June 12 and not live yet."""

METRICS = """\
orders-db, 08:55 to 09:14 UTC (every fifth minute shown)
08:55  active_connections 462  cpu_percent 31  p99_query_ms 14
09:00  active_connections 455  cpu_percent 30  p99_query_ms 13
09:05  active_connections 120  cpu_percent 18  p99_query_ms 9
09:10  active_connections 121  cpu_percent 17  p99_query_ms 9
09:14  active_connections 120  cpu_percent 18  p99_query_ms 10
max_connections 800; replication lag 0.2 s; no query over 500 ms since 08:55"""


@dataclass(frozen=True)
class Entry:
    """One message of the window; ``name`` is how a step refers to it, ``passages`` the retrieved
    passages a search result holds (in the order the window shows them)."""

    name: str
    role: str
    text: str = ""
    call: ToolCall | None = None
    passages: tuple[str, ...] = ()


@dataclass(frozen=True)
class Step:
    """One model call: what the context manager did to the window before it, then the call."""

    change: Change
    note: str  # one line: what changed
    add: tuple[Entry, ...] = ()
    drop: tuple[str, ...] = ()  # entries leaving the window
    rerank: tuple[str, tuple[str, ...]] | None = None  # a search result and its passages' new order


def _call(name: str, tool: str, text: str = "", **arguments: object) -> Entry:
    return Entry(name, "assistant", text, ToolCall(f"call_{name}", tool, json.dumps(arguments)))


def _output(name: str, text: str = "", passages: Sequence[str] = ()) -> Entry:
    return Entry(name, "tool", text, passages=tuple(passages))


STEPS: tuple[Step, ...] = (
    Step(
        "start",
        "system prompt and 4 tools; the user reports a latency alert",
        add=(
            Entry(
                "alert",
                "user",
                "PagerDuty paged me at 09:12: checkout-api p99 latency is over 2 s since about 09:05. "
                "Orders still go through, slowly. Can you find out what is going on?",
            ),
        ),
    ),
    Step(
        "appended",
        "get_logs call and its 11 log lines",
        add=(
            _call("logs-call", "get_logs", service="checkout-api", since="09:00", level="warn"),
            _output("logs", LOGS),
        ),
    ),
    Step(
        "appended",
        "a finding, search_runbooks call and its 3 passages",
        add=(
            _call(
                "search-call",
                "search_runbooks",
                "Every slow checkout waits on the orders-db pool, full at 10/10 since 09:05, right "
                "after the v2.41.0 deploy.",
                query="checkout-api orders-db connection pool exhausted",
                top_k=3,
            ),
            _output("search", passages=("pool", "postmortem", "rollback")),
        ),
    ),
    Step(
        "appended",
        "get_deploy call and its config diff",
        add=(_call("deploy-call", "get_deploy", service="checkout-api"), _output("deploy", DEPLOY)),
    ),
    Step(
        "appended",
        "the agent proposes a rollback; the user asks about the database",
        add=(
            Entry(
                "finding",
                "assistant",
                "Found it: v2.41.0 cut DB_POOL_SIZE from 40 to 10 per pod for a pgbouncer that is not "
                "live yet, and each checkout holds its connection through the payment call, which is "
                "timing out. The 2024-03-18 postmortem is the same failure. The deploy is config-only: "
                "I propose `shipctl rollback checkout-api --to v2.40.3`. Shall I prepare it?",
            ),
            Entry(
                "db-question",
                "user",
                "Wait. Payments are timing out too. Before we roll back, is orders-db itself healthy? "
                "Check its connections and CPU.",
            ),
        ),
    ),
    Step(
        "slid",
        "oldest tool output (get_logs) dropped; get_metrics and its output",
        drop=("logs-call", "logs"),
        add=(
            _call(
                "metrics-call",
                "get_metrics",
                service="orders-db",
                metrics=["active_connections", "cpu_percent", "p99_query_ms"],
                window_minutes=20,
            ),
            _output("metrics", METRICS),
        ),
    ),
    Step(
        "reordered",
        "the 3 passages re-ranked for the user's new question",
        rerank=("search", ("rollback", "pool", "postmortem")),
        add=(
            Entry(
                "db-answer",
                "assistant",
                "orders-db is healthy: 120 of 800 connections since 09:05 (12 pods x 10), CPU 18%, "
                "p99 queries under 10 ms. The bottleneck is the pool inside checkout-api.",
            ),
            Entry(
                "rollback-question",
                "user",
                "And the payment timeouts, are they on our side? What does the runbook say about "
                "rolling back versus raising the pool?",
            ),
        ),
    ),
    Step(
        "appended",
        "the agent's answer; the user asks for the rollback and a status",
        add=(
            Entry(
                "rollback-answer",
                "assistant",
                "The gateway times out at 3 s on its own, but as in the postmortem it only hurts "
                "because the small pool runs out. The runbook allows up to 60 per pod, yet the "
                "40 -> 10 change is the cause and config-only, so rolling back is the safer fix.",
            ),
            Entry(
                "go",
                "user",
                "OK, Dana here: go ahead and prepare the rollback, and write the status update for "
                "#incidents in two sentences.",
            ),
        ),
    ),
)


def apply(window: Sequence[Entry], step: Step) -> list[Entry]:
    """The window after ``step``'s changes: entries dropped, a search result re-ranked, entries
    appended. KeyError for a name the window does not hold."""
    names = [e.name for e in window]
    for name in step.drop:
        if name not in names:
            raise KeyError(f"step drops {name!r}, which the window does not hold")
    out = [e for e in window if e.name not in step.drop]
    if step.rerank is not None:
        name, order = step.rerank
        at = [e.name for e in out].index(name)
        if sorted(order) != sorted(out[at].passages):
            raise KeyError(f"rerank of {name!r} must order its passages {sorted(out[at].passages)}")
        out[at] = Entry(name, "tool", passages=order)
    return [*out, *step.add]


def to_messages(window: Sequence[Entry], native_tools: bool) -> list[Message]:
    """The window as chat messages, rendered as the server renders a request with tool calls."""
    out = []
    for e in window:
        if e.role == "tool":
            body = e.text or "\n\n".join(PASSAGES[p] for p in e.passages)
            out.append(
                Message("tool", (body,))
                if native_tools
                else Message("user", (f"<tool_response>\n{body}\n</tool_response>",))
            )
        elif e.call is not None:
            out.append(Message(e.role, tuple(p for p in (e.text, e.call.text()) if p)))
        else:
            out.append(Message(e.role, (e.text,)))
    return [Message("system", (SYSTEM,)), *out]
