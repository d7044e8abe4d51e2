"""Anthropic's Messages API at the edge: its wire (``models``), its errors (``errors``), and the translation of a
request into the chat request the disaggregated flow already runs and of the chat answer back into Anthropic's
message and event stream (``translate``, ``stream``). Nothing past the edge knows this API exists."""
