"""Chat requests → the prompt string vLLM's OpenAI server renders.

Two stages, each mirroring the code that runs in the engine's front end:

1. vLLM's message parsing (`vllm/entrypoints/chat_utils.py`: `_parse_chat_message_content`,
   `_postprocess_messages`): content-part lists are flattened (text parts joined with "\\n")
   for templates that read `content` as a string, or kept as `{"type": "text", ...}` parts
   for templates that loop over it ("openai" format, detected from the template's AST);
   only `role`, `content`, `name`, `tool_calls` + `reasoning` (assistant), `tool_call_id`
   (tool), `tools` (developer), `task` survive; tool-call `arguments` strings are parsed to
   objects; `tools` are dumped like vLLM's pydantic `ChatCompletionToolsParam.model_dump()`
   (declared fields first, `description`/`parameters` null when absent, extras after).
2. transformers' `apply_chat_template(tokenize=False)` (transformers 5.x,
   `utils/chat_template_utils.py`): `ImmutableSandboxedEnvironment(trim_blocks=True,
   lstrip_blocks=True)` with `loopcontrols` and a `{% generation %}` block, the
   `raise_exception` / `strftime_now` globals, a `tojson` filter that does not escape HTML
   (json.dumps, ensure_ascii=False), keys whose value is None dropped from messages,
   reasoning aliased to `reasoning_content`, the special tokens as template variables,
   and `continue_final_message` cut after the final message's text.

Multimodal parts (images, audio, video, embeddings) are refused with a clear error: their
placeholder tokens depend on the model's processor, so exact ids are out of reach.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
from jinja2.sandbox import ImmutableSandboxedEnvironment

from scorer.tokens import budget as _budget

ContentFormat = Literal["string", "openai"]

# vLLM's MM_PARSER_MAP: the part types whose payload is text.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
_MEDIA_PARTS = {
    "image_url",
    "input_image",
    "image_pil",
    "image_embeds",
    "audio_url",
    "input_audio",
    "audio_embeds",
    "video_url",
    "prompt_embeds",
}
# Keys apply_chat_template / vLLM never forward from chat_template_kwargs to the template.
_RESERVED_KWARGS = {"chat_template", "tokenize", "messages", "conversation"}
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker, trailing space included
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatError(ValueError):
    """The chat request cannot be rendered (bad messages or a template error)."""


# -- the jinja environment (transformers' _compile_jinja_template) ---------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks assistant text; renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render", [])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names (no reach into Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace ({name!r})"
            )


_DICT_ATTRS = frozenset(dir(dict))
_MISSING = object()
_STR_WRAPPED = frozenset({"format", "format_map"})  # the sandbox wraps these two
_LOOP_ATTRS = frozenset(
    {"index", "index0", "first", "last", "length", "revindex", "revindex0", "depth", "depth0"}
)


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with fast paths for the two lookups templates do most.

    `message.content` on a plain dict and `text.startswith(...)` on a str take the
    sandbox's generic path (an AttributeError, then safety checks) ~500 times per
    render of a long conversation. The shortcuts return exactly what that path returns:
    a dict key that is not a dict attribute (undefined when the dict lacks it), or a
    public str method other than the format methods (str is immutable, its methods
    return plain data). Everything else goes through the full sandbox.
    """

    def getattr(self, obj: Any, attribute: str) -> Any:
        t = type(obj)
        if t is dict:
            if attribute not in _DICT_ATTRS:
                v = obj.get(attribute, _MISSING)
                if v is not _MISSING:
                    return v
                # What the generic path ends with for a missing key (`is defined` tests on
                # optional message fields): no attribute, no item, so undefined.
                return self.undefined(obj=obj, name=attribute)
        elif (
            t is str
            and isinstance(attribute, str)
            and not attribute.startswith("_")
            and attribute not in _STR_WRAPPED
        ):
            try:
                return getattr(obj, attribute)
            except AttributeError:
                pass
        elif (t is jinja2.runtime.LoopContext and attribute in _LOOP_ATTRS) or (
            t is _Namespace and isinstance(attribute, str) and not attribute.startswith("_")
        ):
            # `loop.index0` / `ns.flag`: read-only properties and stored template data.
            try:
                return getattr(obj, attribute)
            except AttributeError:
                pass
        return super().getattr(obj, attribute)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


_ENV = _environment()


class _RequestSandbox(_Sandbox):
    """The sandbox for templates a request supplied: `*`/`**`, calls, filters, `range` and
    the output are held to the render's budget (scorer.tokens.budget)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(
        self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any
    ) -> Any:
        if operator in ("*", "**"):
            return _budget.bounded_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(
        __self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any
    ) -> Any:
        _budget.check_args(args, kwargs)
        out = super().call(__context, __obj, *args, **kwargs)
        _budget.check(out)
        return out


def _request_environment() -> ImmutableSandboxedEnvironment:
    env = _RequestSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters.update(_ENV.filters)
    env.filters = {k: _budget.bounded_filter(f) for k, f in env.filters.items()}
    env.globals.update(_ENV.globals)
    env.globals["range"] = _budget.bounded_range
    return env


_REQUEST_ENV = _request_environment()


@lru_cache(maxsize=16)
def compile_request_template(source: str) -> jinja2.Template:
    """A request-supplied template compiled in the budgeted sandbox (cached by source)."""
    try:
        return _REQUEST_ENV.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatError(f"chat template does not parse: {e}") from e


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached by source text)."""
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatError(f"chat template does not parse: {e}") from e


@lru_cache(maxsize=64)
def template_variables(source: str, from_request: bool = False) -> frozenset[str]:
    """Variables the template reads from its context (jinja2.meta). It compiles the
    template, folding constants: a request's template goes through the budgeted sandbox."""
    import jinja2.meta

    env = _REQUEST_ENV if from_request else _ENV
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))


def _reads_content(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Filter) and node.node is not None:
        return _reads_content(node.node)
    return False


@lru_cache(maxsize=64)
def content_format(source: str) -> ContentFormat:
    """ "openai" when the template loops over a message's content, else "string".

    vLLM's `chat_template_content_format="auto"` makes the same call from the template's
    AST: a `for` over `message.content` / `message['content']` means it expects parts.
    """
    try:
        ast = _ENV.parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    for loop in ast.find_all(jinja2.nodes.For):
        if _reads_content(loop.iter):
            return "openai"
    return "string"


# -- vLLM's message parsing ---------------------------------------------------------------


def _parts(role: str, content: Any, fmt: ContentFormat) -> str | list[dict[str, Any]]:
    if type(content) is str and fmt == "string":
        return content  # the common case: one text part, joined with nothing
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = content
    else:
        raise ChatError(f"{role} message content must be a string or a list of parts")
    texts: list[str] = []
    wrapped: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
            wrapped.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict):
            raise ChatError(f"{role} message content part must be an object or a string")
        ptype = part.get("type")
        if ptype is None:
            if any(k in part for k in _MEDIA_PARTS):
                raise ChatError("multimodal content parts are not tokenized by the scorer")
            raise ChatError("Missing 'type' field in content part")
        if ptype in _TEXT_PARTS or ptype == "thinking":
            text = part.get("thinking" if ptype == "thinking" else _TEXT_PARTS[ptype])
            if text is None:
                continue  # vLLM skips text/refusal parts without text
            if not isinstance(text, str):
                raise ChatError(f"content part {ptype!r} must carry a string")
            texts.append(text)
            wrapped.append({"type": "text", "text": text})
        elif ptype == "tool_reference":
            name = part.get("name")
            texts.append(str(name))
            wrapped.append({"type": "tool_reference", "name": name})
        elif ptype in _MEDIA_PARTS:
            raise ChatError(f"multimodal content part {ptype!r} is not tokenized by the scorer")
        else:
            raise ChatError(f"unsupported chat content part type: {ptype!r}")
    if fmt == "openai":
        if role == "tool" and all(p.get("type") == "text" for p in wrapped):
            return "\n".join(p["text"] for p in wrapped)
        return wrapped
    return "\n".join(texts)


def normalize_messages(messages: Any, fmt: ContentFormat) -> list[dict[str, Any]]:
    """The conversation vLLM hands to apply_chat_template (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    plain = fmt == "string"
    for m in messages:
        if plain and type(m) is dict and len(m) == 2:
            # The common message, {"role": str, "content": str}: what the full path below
            # builds for it (a developer message also gets `tools`).
            role, content = m.get("role"), m.get("content")
            if type(role) is str and type(content) is str and role != "developer":
                out.append({"role": role, "content": content})
                continue
        if not isinstance(m, dict):
            raise ChatError("each message must be an object")
        role = m.get("role")
        if not isinstance(role, str):
            raise ChatError("each message needs a string 'role'")
        msg: dict[str, Any] = {"role": role, "content": _parts(role, m.get("content"), fmt)}
        if role == "assistant":
            if m.get("tool_calls") is not None:
                calls = m["tool_calls"]
                if not isinstance(calls, list):
                    raise ChatError("tool_calls must be a list")
                msg["tool_calls"] = [_tool_call(c) for c in calls]
            # vLLM reads `reasoning` (older clients send `reasoning_content`).
            reasoning = m.get("reasoning", m.get("reasoning_content"))
            if reasoning is not None:
                msg["reasoning"] = reasoning
                msg["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if isinstance(m.get("task"), str):
            msg["task"] = m["task"]
        if role == "developer":
            msg["tools"] = m.get("tools")
        if msg.get("tool_calls") == []:
            del msg["tool_calls"]  # vLLM drops empty tool_calls (normal assistant path)
        out.append(msg)
    return out


def _tool_call(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ChatError("each tool call needs a 'function' object")
    fn = dict(call["function"])
    args = fn.get("arguments")
    if isinstance(args, str):
        # vLLM parses the arguments string so templates can `tojson` an object; bad JSON
        # becomes {} there too.
        try:
            fn["arguments"] = json.loads(args)
        except json.JSONDecodeError:
            fn["arguments"] = {}
    elif not isinstance(args, dict | list):
        fn["arguments"] = {}
    return {**call, "function": fn}


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """`tools` as vLLM's `[tool.model_dump() for tool in request.tools]` produces them."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatError("tools must be a list")
    out = []
    for t in tools:
        if not isinstance(t, dict) or not isinstance(t.get("function"), dict):
            raise ChatError("each tool needs a 'function' object")
        f = t["function"]
        if not isinstance(f.get("name"), str):
            raise ChatError("each tool function needs a string 'name'")
        fn = {"name": f["name"], "description": f.get("description"), "parameters": None}
        fn["parameters"] = f.get("parameters")
        fn.update({k: v for k, v in f.items() if k not in fn})
        tool: dict[str, Any] = {"type": t.get("type", "function"), "function": fn}
        tool.update({k: v for k, v in t.items() if k not in tool})
        out.append(tool)
    return out


# -- transformers' apply_chat_template(tokenize=False) ---------------------------------------


def _alias_reasoning(msg: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
    if reasoning is None:
        return msg
    return {"thinking": reasoning, **msg, "reasoning_content": reasoning}


def render_chat(
    body: Mapping[str, Any],
    template: str,
    special_tokens: Mapping[str, str],
    budget: tuple[float, int] | None = None,
) -> str:
    """The prompt string for a /v1/chat/completions body, rendered with `template`.

    `budget` = (seconds, max output chars) marks `template` as supplied by the request: it
    is compiled in the budgeted sandbox and rendered within those limits."""
    fmt = content_format(template)
    messages = normalize_messages(body.get("messages"), fmt)
    tools = normalize_tools(body.get("tools"))
    # vLLM builds these defaults and lets chat_template_kwargs override them.
    kwargs: dict[str, Any] = {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
        "tools": tools,
        "documents": body.get("documents"),
    }
    extra = body.get("chat_template_kwargs")
    if extra is not None:
        if not isinstance(extra, dict):
            raise ChatError("chat_template_kwargs must be an object")
        kwargs.update(extra)
    add_gen = bool(kwargs.pop("add_generation_prompt"))
    cont = bool(kwargs.pop("continue_final_message"))
    tools = kwargs.pop("tools")
    documents = kwargs.pop("documents")
    if cont and add_gen:
        raise ChatError("continue_final_message and add_generation_prompt are not compatible")
    used = template_variables(template, budget is not None)
    rest = {k: v for k, v in kwargs.items() if k in used and k not in _RESERVED_KWARGS}

    # transformers drops None-valued keys, then aliases reasoning fields.
    chat = [
        m
        if len(m) == 2  # role and content, neither None: nothing to drop or alias
        else _alias_reasoning(
            m if None not in m.values() else {k: v for k, v in m.items() if v is not None}
        )
        for m in messages
    ]
    final_text: str | None = None
    if cont:
        last = chat[-1]
        final = last.get("content")
        if final is None:
            raise ChatError("continue_final_message is set but the final message has no content")
        if "content" not in template:
            raise ChatError("continue_final_message: the chat template does not read 'content'")
        if isinstance(final, list):
            for block in reversed(final):
                if "text" in block:
                    final_text = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ChatError("continue_final_message: no text to continue in the final message")
        else:
            final_text = final
            last["content"] = final + _CONTINUE_TAG

    compiled = compile_template(template) if budget is None else compile_request_template(template)
    ctx: dict[str, Any] = {**special_tokens, **rest}
    try:
        if budget is None:
            text = compiled.render(
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_gen,
                **ctx,
            )
        else:
            text = _budget.render_within(
                compiled,
                budget[0],
                budget[1],
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_gen,
                **ctx,
            )
    except _budget.BudgetExceeded:
        raise
    except jinja2.TemplateError as e:
        raise ChatError(f"chat template error: {e}") from e
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as e:
        raise ChatError(f"chat template failed: {type(e).__name__}: {e}") from e
    except (RecursionError, MemoryError) as e:
        raise ChatError(f"chat template failed: {type(e).__name__}") from e

    if cont:
        assert final_text is not None
        tag = _CONTINUE_TAG.strip()
        if final_text.strip() not in text or tag not in text:
            raise ChatError(
                "continue_final_message: the template dropped part of the final message"
            )
        at = text.rindex(tag)
        if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            text = text[:at]
        else:
            text = text[:at].rstrip()
    return text
