"""Whether a chat template renders each message on its own, read from its syntax tree: what lets a follow-up turn
render only the messages it adds.

A template of the shape ``[before] {% for m in messages %}[body]{% endfor %} [after]`` renders ``before``, one
piece per message, then ``after``, provided: ``before`` and ``after`` never read the messages; the body reads its
message, ``loop.first`` and ``messages[0]`` only (no ``loop.index``/``last``/``length``, no ``messages|length`` or
``messages[-1]``, no ``add_generation_prompt``); nothing anywhere sets a variable, calls a stateful global
(``namespace``, ``cycler``, ``joiner``, ``lipsum``) or a method outside a short list of pure string methods, or
uses a filter or test outside the builtin pure ones. Then a message's piece depends on the message, whether it is
first, and the first message alone, so ``loop`` rendered over ``[messages[0], *new]`` gives the first message's
piece followed by exactly the pieces ``new`` has in the whole conversation. Any other template is rendered whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import jinja2
from jinja2 import nodes

_PURE_FILTERS = frozenset({
    "abs", "capitalize", "center", "count", "d", "default", "e", "escape", "first", "float", "forceescape", "indent",
    "int", "join", "last", "length", "list", "lower", "replace", "reverse", "round", "safe", "string", "striptags",
    "title", "tojson", "trim", "truncate", "upper", "wordcount", "wordwrap"})
_PURE_TESTS = frozenset({
    "!=", "<", "<=", "==", ">", ">=", "boolean", "defined", "divisibleby", "eq", "equalto", "escaped", "even",
    "false", "float", "ge", "greaterthan", "gt", "in", "integer", "iterable", "le", "lessthan", "lower", "lt",
    "mapping", "ne", "none", "number", "odd", "sameas", "sequence", "string", "true", "undefined", "upper"})
_PURE_METHODS = frozenset({"strip", "lstrip", "rstrip", "startswith", "endswith", "split", "upper", "lower",
                           "title", "replace", "items", "keys", "values", "get"})
# Expression and statement nodes that compute from their children alone (no state, no side effect).
_PLAIN_NODES = (nodes.Output, nodes.TemplateData, nodes.Const, nodes.If, nodes.BinExpr, nodes.UnaryExpr,
                nodes.Compare, nodes.Operand, nodes.Concat, nodes.CondExpr, nodes.Tuple, nodes.List, nodes.Dict,
                nodes.Pair, nodes.Keyword, nodes.Slice, nodes.MarkSafe, nodes.MarkSafeIfAutoescape)
_MESSAGES = "messages"


@dataclass(frozen=True, slots=True)
class MessageWise:
    """A message-wise template in its three parts, each rendered with the same variables as the whole."""

    before: jinja2.Template  # what precedes the loop over the messages (reads no message)
    loop: jinja2.Template  # the loop alone: one piece per message
    after: jinja2.Template  # what follows it (reads no message; the generation prompt)


def message_wise(environment: jinja2.Environment, source: str) -> MessageWise | str:
    """The template's parts if it renders message by message, else why not (one line)."""
    try:
        tree = environment.parse(source)
    except jinja2.TemplateError as exc:
        return f"the template does not parse: {exc}"
    loops = [i for i, node in enumerate(tree.body) if isinstance(node, nodes.For) and _iterates_messages(node)]
    if len(loops) != 1:
        return "the template has no single top-level loop over the messages"
    at = loops[0]
    loop = tree.body[at]
    assert isinstance(loop, nodes.For)
    if not isinstance(loop.target, nodes.Name) or loop.else_ or loop.test is not None or loop.recursive:
        return "its loop over the messages unpacks, filters, recurses or has an else"
    for node in (*tree.body[:at], *tree.body[at + 1:]):
        refusal = _refusal(node, message=None)
        if refusal:
            return f"outside its loop: {refusal}"
    for node in loop.body:
        refusal = _refusal(node, message=loop.target.name)
        if refusal:
            return f"in its loop: {refusal}"
    return MessageWise(_compiled(environment, tree.body[:at]), _compiled(environment, [loop]),
                       _compiled(environment, tree.body[at + 1:]))


def _iterates_messages(loop: nodes.For) -> bool:
    return isinstance(loop.iter, nodes.Name) and loop.iter.name == _MESSAGES


def _compiled(environment: jinja2.Environment, body: list[nodes.Node]) -> jinja2.Template:
    tree = nodes.Template(body, lineno=1)
    tree.set_environment(environment)
    return environment.from_string(tree)


def _refusal(node: nodes.Node, message: str | None) -> str | None:
    """Why ``node`` may make a piece depend on more than its message (None: it may not). ``message``: the loop's
    variable inside the loop, None outside it."""
    return next((why for why in _walk(node, message) if why), None)


def _walk(node: nodes.Node, message: str | None) -> Iterator[str | None]:
    if isinstance(node, nodes.Getattr) and _is_name(node.node, "loop"):
        yield None if message is not None and node.attr == "first" else f"it reads loop.{node.attr}"
        return
    if isinstance(node, nodes.Getitem) and _is_name(node.node, _MESSAGES):
        first = isinstance(node.arg, nodes.Const) and node.arg.value == 0 and type(node.arg.value) is int
        yield None if message is not None and first else "it reads the messages other than the first"
        return
    if isinstance(node, nodes.Name):
        yield _name_refusal(node, message)
        return
    if isinstance(node, nodes.Call):
        yield _call_refusal(node)
        if isinstance(node.node, nodes.Getattr):  # a method: what it is called on counts
            yield from _walk(node.node.node, message)
        arguments: list[nodes.Node] = [*node.args, *node.kwargs]
        for argument in (*arguments, node.dyn_args, node.dyn_kwargs):
            if argument is not None:
                yield from _walk(argument, message)
        return
    if isinstance(node, nodes.Filter):
        yield None if node.name in _PURE_FILTERS else f"it uses the filter {node.name!r}"
    elif isinstance(node, nodes.Test):
        yield None if node.name in _PURE_TESTS else f"it uses the test {node.name!r}"
    elif not isinstance(node, (*_PLAIN_NODES, nodes.Getattr, nodes.Getitem)):
        yield f"it has a {type(node).__name__} node"
        return
    for child in node.iter_child_nodes():
        yield from _walk(child, message)


def _is_name(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.name == name


def _name_refusal(node: nodes.Name, message: str | None) -> str | None:
    if node.ctx != "load":
        return f"it sets {node.name!r}"
    if node.name == _MESSAGES:
        return "it reads the messages as a whole"
    if node.name == "loop":
        return "it reads the loop variable as a whole"
    if message is not None and node.name == "add_generation_prompt":
        return "its loop reads add_generation_prompt"
    if node.name in ("namespace", "cycler", "joiner", "lipsum", "range", "dict", "self", "caller", "varargs",
                     "kwargs", "super"):
        return f"it uses {node.name!r}"
    return None  # the loop's message, bos_token and the like, or an undefined name: the same for every piece


def _call_refusal(node: nodes.Call) -> str | None:
    callee = node.node
    if _is_name(callee, "raise_exception"):
        return None
    if isinstance(callee, nodes.Getattr) and callee.attr in _PURE_METHODS:
        return None
    return "it calls something other than raise_exception or a pure string method"
