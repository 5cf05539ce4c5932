"""A render budget for chat templates, which come from model files anyone can publish.

Jinja's sandbox keeps a template away from Python's internals, but not from looping for
hours (`range(100000)` inside `range(100000)`), allocating gigabytes (`'x' * 10**10`) or
recursing until Python gives up (a macro that calls itself). The server renders in a
worker thread, which cannot be killed, so every limit here is checked from inside the
render, by hooks that the template's own code passes through:

- steps: every loop iteration (filtered loops and recursive `loop()` levels included),
  call (macros, methods, globals), filter and `+ * ** %` counts one (`MAX_STEPS`);
- time: a deadline checked at each step (`RENDER_SECONDS`), a backstop for work that no
  step measures, such as comparing two long strings inside a loop;
- size: no value the template builds (string, list, number, block of output) may pass a
  cap, checked *before* each operation whose result can dwarf its inputs (`'x' * n`,
  `s.ljust(n)`, `s.replace('', t)`, `sep.join(...)`, `'%*d'`, `'{:>n}'`, `indent(n)`,
  turning a list that repeats one long string into text) and after every other one;
- work and memory: the total size of what one render's filters, methods and operators
  read and build (`WORK_CHARS`), so a loop cannot sort or scan a long list at every step;
- output: the rendered prompt (`OUTPUT_CHARS`);
- depth: macros and blocks calling themselves (`MAX_CALL_DEPTH`), so Python's own
  RecursionError is never the limit.

Size limits grow with the input (messages, tools), since a template legitimately copies
its input a few times. A limit raises `BudgetExceeded`; chat_template turns it into one
user-facing line.
"""

from __future__ import annotations

import contextvars
import re
import string
import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import wraps
from types import BuiltinMethodType
from typing import Any, Callable, Iterator

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.runtime import LoopContext, Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import Namespace

# Measured (tests/test_chat_template.py::test_real_templates_stay_far_below_the_budget):
# a 100-message chat with tool calls and two tools (13 k characters of input) takes at most
# ~500 steps, reads and builds ~41 k characters and writes ~15 k with the fallbacks and
# tool/feature templates (SmolLM2's own: ~600 steps). Heavier real templates take ~30
# steps a message, a few thousand for 100. Each limit sits ~100x or more above that.
MAX_STEPS = 500_000
RENDER_SECONDS = 10.0  # a 100-message chat takes ~10 ms; 500,000 steps take 0.2-5 s on a slow CPU
MAX_CALL_DEPTH = 64  # JSON-schema macros in tool templates nest < 10 deep; 64 levels use ~400 Python frames
MAX_RANGE = 100_000  # Jinja's own sandbox cap; the step budget bounds nested ranges
MAX_INT_BITS = 4096  # ~1,200 digits; templates count messages, they do no arithmetic
VALUE_CHARS = 2**20  # one string, list or block of output: 1 Mi + 2x the input
OUTPUT_CHARS = 2**20  # the rendered prompt: 1 Mi + 4x the input
WORK_CHARS = 16 * 2**20  # what filters, methods and operators read and build: 16 Mi + 64x the input


_SIZED = (str, bytes, list, tuple, dict, set, frozenset)


class BudgetExceeded(Exception):
    """A template went past a limit; the message is a phrase that follows "the model's
    chat template" (e.g. "ran more than 500,000 steps ...")."""


@dataclass
class RenderBudget:
    """What one render may still spend; one per render, found through `current()`."""

    max_value: int
    max_output: int
    max_work: int
    max_steps: int = MAX_STEPS
    seconds: float = RENDER_SECONDS
    steps: int = 0
    work: int = 0
    output: int = 0
    depth: int = 0
    deadline: float = field(init=False)

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.seconds

    @classmethod
    def for_input(cls, *values: Any) -> "RenderBudget":
        room = input_size(values)
        return cls(max_value=VALUE_CHARS + 2 * room, max_output=OUTPUT_CHARS + 4 * room,
                   max_work=WORK_CHARS + 64 * room, max_steps=MAX_STEPS, seconds=RENDER_SECONDS)

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.max_steps:
            raise BudgetExceeded(f"ran more than {self.max_steps:,} steps (loop iterations, calls and filters)")
        if time.monotonic() > self.deadline:
            raise BudgetExceeded(f"ran longer than {self.seconds:g} s")

    def check_size(self, n: int, what: str = "a value") -> None:
        if n > self.max_value:
            raise BudgetExceeded(f"would build {what} of {n:,} characters or items (at most {self.max_value:,})")

    def check_text(self, value: Any) -> None:
        """Refuse a value whose text (str() of it) would pass the size cap, before making it."""
        if not isinstance(value, str):
            self.check_size(text_size(value, self.max_value), "text")

    def check_int(self, bits: int) -> None:
        if bits > MAX_INT_BITS:
            raise BudgetExceeded(f"would build a number of {bits:,} bits (at most {MAX_INT_BITS:,})")

    def add_work(self, n: int) -> None:
        self.work += n
        if self.work > self.max_work:
            raise BudgetExceeded(f"read and built more than {self.max_work:,} characters and items in all")

    def charge(self, value: Any) -> Any:
        """Check and count a value an operation returned; returns it."""
        if isinstance(value, _SIZED):
            self.check_size(len(value))
            self.add_work(len(value))
        elif isinstance(value, int):
            self.check_int(value.bit_length())
        return value

    def read(self, value: Any) -> None:
        """Count a value a filter or method is about to read whole."""
        if isinstance(value, _SIZED):
            self.add_work(len(value))

    def write(self, n: int) -> None:
        self.output += n
        if self.output > self.max_output:
            raise BudgetExceeded(f"wrote more than {self.max_output:,} characters")


_active: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar("template_budget", default=None)


def current() -> RenderBudget:
    budget = _active.get()
    if budget is None:
        raise RuntimeError("template code ran outside a render budget (use template_budget.spending)")
    return budget


@contextmanager
def spending(budget: RenderBudget) -> Iterator[RenderBudget]:
    """Make `budget` the one the hooks charge, in this thread/context, for the block."""
    token = _active.set(budget)
    try:
        yield budget
    finally:
        _active.reset(token)


def render_bounded(template: jinja2.Template, budget: RenderBudget, variables: dict) -> str:
    """Render `template` (compiled by a BudgetedSandbox) within `budget`; streaming, so
    the output cap stops a template long before its whole output exists."""
    pieces = []
    with spending(budget):
        for piece in template.generate(**variables):
            budget.write(len(piece))
            pieces.append(piece)
    return "".join(pieces)


def input_size(values: Any) -> int:
    """Characters of text plus items in the input (messages, tools); a shared or cyclic
    container counts once."""
    total, stack, seen = 0, list(values), set()
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, (dict, list, tuple)) and id(v) not in seen:
            seen.add(id(v))
            total += len(v)
            stack.extend(v.keys() if isinstance(v, dict) else ())
            stack.extend(v.values() if isinstance(v, dict) else v)
    return total


def text_size(value: Any, limit: int) -> int:
    """About how many characters str(value) has, found without making it; counting stops
    once past `limit`. A reference repeated in a list counts every time, as str() prints
    it every time. Escapes in reprs are not counted: the size check after the operation
    catches those (they grow text at most ~10x)."""
    if isinstance(value, str):
        return len(value)
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v) + 3
        elif isinstance(v, Undefined):
            continue
        elif isinstance(v, Mapping):
            total += 2 + 4 * len(v)
            if total <= limit:
                stack.extend(v.keys())
                stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset, type({}.keys()), type({}.values()), type({}.items()))):
            total += 2 + 2 * len(v)
            if total <= limit:
                stack.extend(v)
        elif isinstance(v, Namespace):  # its repr shows its attributes' dict
            total += 12
            try:
                stack.append(object.__getattribute__(v, "_Namespace__attrs"))
            except AttributeError:  # a Jinja that keeps them elsewhere: the text check after str() still holds
                continue
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 2
        else:  # numbers, None, ranges, macros, loop objects: a short repr
            total += 32
    return total


# -- bounds for the operations whose result can be far larger than their inputs ---------

_DIGITS = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d+|\*)?(?:\.(\d+|\*))?")  # width, precision


def _number(digits: str) -> int:
    return int(digits) if len(digits) < 20 else 10**20  # Python refuses to parse very long ints


def _length(x: Any) -> int:
    """A width given as a number or as the text to repeat."""
    return len(x) if isinstance(x, str) else int(x)


def _percent(budget: RenderBudget, fmt: Any, values: Any) -> None:
    """`fmt % values` (and the `format` filter): each conversion's width, `*` widths and
    the text of the values it may insert."""
    fmt = str(fmt)
    # a mapping is inserted by key, a tuple item by item, anything else whole
    items = [values] if isinstance(values, Mapping) else list(values) if isinstance(values, tuple) else [values]
    specs = _PERCENT_SPEC.findall(fmt)
    numbers = [n for spec in specs for n in spec if n]
    width = max([_number(n) for n in numbers if n != "*"], default=0)
    if "*" in numbers:
        width = max([width] + [abs(v) for v in items if isinstance(v, int)])
    budget.check_size(width, "a formatted field")
    biggest = max((text_size(v, budget.max_value) for v in items), default=0)
    budget.check_size(len(fmt) + len(specs) * (width + biggest), "formatted text")


def _str_format(budget: RenderBudget, env, fmt: str, args: tuple, kwargs: Mapping) -> None:
    """`fmt.format(...)`: resolve each field as the sandbox will and add up its text and
    width; a field that does not resolve is left for the real call to report."""
    resolver = SandboxedFormatter(env)
    total, auto = 0, 0
    for literal, name, spec, _conversion in string.Formatter().parse(fmt):
        total += len(literal)
        if name is None:
            continue
        if name == "":
            name, auto = str(auto), auto + 1
        try:
            value, _ = resolver.get_field(name, args, kwargs)
        except Exception:  # the real call raises the same error, which render reports
            continue
        width = max(map(_number, _DIGITS.findall(spec or "")), default=0)
        for _lit, inner, _s, _c in string.Formatter().parse(spec or ""):
            if inner is not None:  # a nested `{:{w}}` width
                if inner == "":
                    inner, auto = str(auto), auto + 1
                try:
                    w, _ = resolver.get_field(inner, args, kwargs)
                except Exception:  # as above: the real call reports it
                    continue
                width = max(width, abs(w) if isinstance(w, int) else text_size(w, budget.max_value))
        budget.check_size(width, "a formatted field")
        total += width + text_size(value, budget.max_value)
        budget.check_size(total, "formatted text")


def _replace(budget: RenderBudget, s: Any, old: Any, new: Any, count: Any = -1, *_: Any) -> None:
    s, old, new = str(s), str(old), str(new)
    n = (s.count(old) if old else len(s) + 1)
    if count is not None and int(count) >= 0:
        n = min(n, int(count))
    budget.check_size(len(s) + n * max(0, len(new) - len(old)))


def _join(budget: RenderBudget, sep: Any, items: list) -> None:
    # join(attribute=...) takes a part of each item: at most the item's own text
    total = len(str(sep)) * max(0, len(items) - 1)
    for item in items:
        total += text_size(item, budget.max_value)
        budget.check_size(total, "joined text")


def _width(budget: RenderBudget, s: Any, width: Any = 0, *_: Any) -> None:
    budget.check_size(_length(width), "padded text")


def _expandtabs(budget: RenderBudget, s: str, tabsize: Any = 8) -> None:
    budget.check_size(len(s) + s.count("\t") * int(tabsize), "expanded text")


def _translate(budget: RenderBudget, s: str, table: Any) -> None:
    targets = table.values() if isinstance(table, Mapping) else table if isinstance(table, (list, tuple)) else ()
    longest = max((len(t) for t in targets if isinstance(t, str)), default=1)
    budget.check_size(len(s) * max(1, longest), "translated text")


def _indent(budget: RenderBudget, s: Any, width: Any = 4, *_: Any, **__: Any) -> None:
    s = str(s)
    budget.check_size(len(s) + (s.count("\n") + 1) * _length(width), "indented text")


def _wordwrap(budget: RenderBudget, s: Any, width: Any = 79, break_long_words: Any = True,
              wrapstring: Any = None, *_: Any, **__: Any) -> None:
    s, wrap = str(s), str(wrapstring or "\n")
    budget.check_size(len(s) * (1 + len(wrap)) + len(wrap), "wrapped text")


def _urlize(budget: RenderBudget, value: Any, trim_url_limit: Any = None, nofollow: Any = False,
            target: Any = None, rel: Any = None, *_: Any, **__: Any) -> None:
    n = len(str(value))  # a link per 4 characters at most, each its URL again in an <a ...> tag
    budget.check_size(2 * n + (n // 4 + 1) * (48 + len(str(target or "")) + len(str(rel or ""))), "linked text")


def _padded_lists(budget: RenderBudget, value: Any, count: Any, fill_with: Any = None) -> None:
    """batch(n, fill) and slice(n, fill): up to n lists, or n copies of the filler."""
    fill = 0 if fill_with is None else text_size(fill_with, budget.max_value)
    budget.check_size(_length(count) * max(1, fill), "padded lists")


def _sum(budget: RenderBudget, items: list, attribute: Any = None, start: Any = 0) -> None:
    if isinstance(start, (int, float)):
        return
    # sum() of lists or strings copies the running total at every item: quadratic
    total = text_size(start, budget.max_value) + sum(text_size(i, budget.max_value) for i in items)
    budget.check_size(total, "a sum")
    budget.add_work(len(items) * total)


# Methods of str reached as `s.name(...)`; the check gets the string, then the call's arguments.
STR_METHOD_CHECKS: dict[str, Callable[..., None]] = {
    "ljust": _width, "rjust": _width, "center": _width, "zfill": _width,
    "expandtabs": _expandtabs, "replace": _replace, "translate": _translate,
    "join": lambda budget, sep, items: _join(budget, sep, items),
}
# Filters, checked with the filter's own arguments (the value first).
FILTER_CHECKS: dict[str, Callable[..., None]] = {
    "center": _width, "indent": _indent, "wordwrap": _wordwrap, "urlize": _urlize,
    "batch": _padded_lists, "slice": _padded_lists, "replace": _replace,
    "format": lambda budget, value, *args, **kwargs: _percent(budget, value, kwargs or args),
    "join": lambda budget, items, d="", attribute=None: _join(budget, d, items),
    "sum": _sum,
}
# Filters that turn their value into text first (a list that repeats a long string blows up there).
TEXT_FILTERS = frozenset({
    "string", "e", "escape", "forceescape", "safe", "trim", "upper", "lower", "capitalize", "title",
    "striptags", "urlencode", "wordcount", "center", "indent", "wordwrap", "truncate", "replace",
    "format", "urlize", "pprint", "tojson",
})
# Filters that walk their whole value in Python code (keys, comparisons, grouping), about
# as slow per item as a loop iteration: each item counts a step. Lazy ones (map, select...)
# are counted by whatever consumes them.
ITERATING_FILTERS = frozenset({"sort", "unique", "min", "max", "groupby", "dictsort", "list", "join", "sum",
                               "pprint", "xmlattr", "reverse"})
# Filters and methods whose iterable argument is read whole by the check, so a generator
# is turned into a list first (the real call then reads the list).
_MATERIALIZE = frozenset({"join", "sum"})


def _budgeted_filter(name: str, func: Callable) -> Callable:
    first = 1 if hasattr(func, "jinja_pass_arg") else 0  # context/eval_ctx/environment comes first
    check = FILTER_CHECKS.get(name)
    iterates = name in ITERATING_FILTERS

    @wraps(func)  # keeps jinja_pass_arg, which tells Jinja what to pass first
    def budgeted(*args: Any, **kwargs: Any) -> Any:
        budget = current()
        budget.step()
        value = args[first] if len(args) > first else None
        if value is not None:
            if name in _MATERIALIZE and not isinstance(value, (list, tuple, str, Undefined)):
                value = list(value)
                args = args[:first] + (value,) + args[first + 1:]
            budget.read(value)
            if iterates and isinstance(value, _SIZED):
                budget.step(len(value))
            if name in TEXT_FILTERS:
                budget.check_text(value)
            if check is not None:
                check(budget, *args[first:], **kwargs)
        result = func(*args, **kwargs)
        if iterates and not isinstance(value, _SIZED) and isinstance(result, _SIZED):
            budget.step(len(result))  # it read a generator: as many items as it kept
        return budget.charge(result)

    return budgeted


def bounded_range(*args: int) -> range:
    numbers = range(*args)
    try:
        n = len(numbers)
    except OverflowError:  # more than sys.maxsize numbers
        n = MAX_RANGE + 1
    if n > MAX_RANGE:
        raise BudgetExceeded(f"asked for a range of more than {MAX_RANGE:,} numbers")
    return numbers


class _OutputBuffer(list):
    """The list Jinja collects a macro body's or `{% set %}` block's output in; counts
    what goes in, since that output never passes through render's own count."""

    def __init__(self) -> None:
        super().__init__()
        self.budget = current()
        self.size = 0

    def _count(self, n: int) -> None:
        self.size += n
        self.budget.check_size(self.size, "a block of output")
        self.budget.add_work(n)

    def append(self, text: str) -> None:
        self._count(len(text))
        super().append(text)

    def extend(self, texts) -> None:
        texts = list(texts)
        self._count(sum(map(len, texts)))
        super().extend(texts)


class _BudgetedCodeGenerator(CodeGenerator):
    """Compiles the hooks into the template's Python code: every loop runs over
    `environment.budget_iter(...)`, every buffer is an `_OutputBuffer`, every `~` goes
    through `environment.budget_join` and every `{{ value }}` through
    `environment.budget_text`, each of which charges the budget."""

    def visit_For(self, node: nodes.For, frame) -> None:
        counted = nodes.Call(nodes.EnvironmentAttribute("budget_iter"), [node.iter], [], None, None,
                             lineno=node.lineno)
        loop = nodes.For(node.target, counted, node.body, node.else_, node.test, node.recursive, lineno=node.lineno)
        loop.set_environment(self.environment)
        super().visit_For(loop, frame)

    def buffer(self, frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.budget_buffer()")

    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        # the join function Jinja itself would pick, so `~` keeps its meaning
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write(f"environment.budget_join({join}, (")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")

    def _output_child_pre(self, node, frame, finalize) -> None:
        super()._output_child_pre(node, frame, finalize)
        self.write("environment.budget_text(")

    def _output_child_post(self, node, frame, finalize) -> None:
        self.write(")")
        super()._output_child_post(node, frame, finalize)


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """An immutable sandbox whose templates must render inside `spending(budget)`.
    `filters` and `globals` given here are wrapped like Jinja's own."""

    code_generator_class = _BudgetedCodeGenerator
    # the operators whose result can outgrow their inputs; intercepting them also stops
    # Jinja from folding `'x' * 10**10` into the compiled template
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, filters: dict | None = None, globals: dict | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.filters.update(filters or {})
        self.filters = {name: _budgeted_filter(name, f) for name, f in self.filters.items()}
        self.globals.update(globals or {})
        self.globals["range"] = bounded_range
        del self.globals["lipsum"]  # lorem ipsum of n paragraphs: no chat template writes one

    # -- hooks the compiled code calls ------------------------------------------------

    def budget_iter(self, iterable: Any) -> Iterator[Any]:
        budget = current()
        for item in iterable:
            budget.step()
            yield item

    def budget_buffer(self) -> _OutputBuffer:
        return _OutputBuffer()

    def budget_join(self, join: Callable, parts: tuple) -> str:
        budget = current()
        budget.check_size(sum(text_size(p, budget.max_value) for p in parts), "joined text")
        return budget.charge(join(parts))

    def budget_text(self, value: Any) -> Any:
        current().check_text(value)
        return value

    # -- the sandbox's own hooks --------------------------------------------------------

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = current()
        budget.step()
        _check_binop(budget, operator, left, right)
        return budget.charge(self.binop_table[operator](left, right))

    def call(self, context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = current()
        budget.step()
        if isinstance(obj, LoopContext) and args:  # `loop(children)` in a recursive for
            args = (self.budget_iter(args[0]),) + args[1:]
        if isinstance(obj, BuiltinMethodType) and isinstance(obj.__self__, _SIZED):
            budget.read(obj.__self__)
        if isinstance(obj, BuiltinMethodType) and isinstance(obj.__self__, str):
            check = STR_METHOD_CHECKS.get(obj.__name__)
            if check is not None:
                if obj.__name__ in _MATERIALIZE and args and not isinstance(args[0], (list, tuple, str)):
                    args = (list(args[0]),) + args[1:]
                check(budget, obj.__self__, *args, **kwargs)
        budget.depth += 1
        try:
            if budget.depth > MAX_CALL_DEPTH:
                raise BudgetExceeded(f"nested calls more than {MAX_CALL_DEPTH} deep (a macro that calls itself?)")
            result = super().call(context, obj, *args, **kwargs)
        finally:
            budget.depth -= 1
        return budget.charge(result)

    def getitem(self, obj: Any, argument: Any) -> Any:
        budget = current()
        if not isinstance(argument, (str, int, slice)):
            budget.check_text(argument)  # an undefined-key error message quotes the key
        value = super().getitem(obj, argument)
        return budget.charge(value) if isinstance(argument, slice) else value

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        @wraps(wrapper)
        def bounded(*args: Any, **kwargs: Any) -> str:
            budget = current()
            if is_map and len(args) == 1 and isinstance(args[0], Mapping):
                _str_format(budget, self, fmt, (), args[0])
            elif not is_map:
                _str_format(budget, self, fmt, args, kwargs)
            return budget.charge(wrapper(*args, **kwargs))

        return bounded


def _check_binop(budget: RenderBudget, operator: str, left: Any, right: Any) -> None:
    sequences = (str, list, tuple)
    if operator == "*":
        if isinstance(left, int) and isinstance(right, sequences):
            left, right = right, left
        if isinstance(left, sequences) and isinstance(right, int) and right > 0:
            budget.check_size(len(left) * right)
            if not isinstance(left, str):  # a list of long strings, repeated: its text
                budget.check_size(text_size(left, budget.max_value // right + 1) * right, "text")
        elif isinstance(left, int) and isinstance(right, int):
            budget.check_int(left.bit_length() + right.bit_length())
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            budget.check_int((abs(left).bit_length() - 1) * min(right, MAX_INT_BITS + 1))
    elif operator == "+":
        if isinstance(left, sequences) and isinstance(right, sequences):
            budget.check_size(len(left) + len(right))
            if not isinstance(left, str):
                budget.check_size(text_size(left, budget.max_value) + text_size(right, budget.max_value), "text")
    elif operator == "%" and isinstance(left, str):
        _percent(budget, left, right)
