"""The app's routes, one module per concern, each a ``router(state)`` over a shared
:class:`~agent.server.state.ServerState`: ``chat`` (chat completions, checked and answered whole)
with ``stream`` (the SSE answer) and ``completion`` (what the two share), ``sessions`` (agent
sessions and their steps), ``ops`` (models, health, metrics).
"""
