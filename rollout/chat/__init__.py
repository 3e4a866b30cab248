"""Chat requests with tools and reasoning, shared by the HTTP server and ChatSession: checking tools
and messages (tools.py), rendering prompts and token-exact continuations (template.py), and splitting
an output into content, reasoning and tool calls (output.py).

May import: parsers/ and the top-level value modules (sampling, outputs)."""
