"""Hostile chat templates are stopped by the render budget (chat_sandbox.py), quickly and
without eating memory; real templates render exactly as in plain Jinja's sandbox."""
from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from alphallama.chat import ChatTemplate, ChatTemplateError, RenderBudget, TemplateBudgetError

TEMPLATES = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "templates"
SMALL = RenderBudget(seconds=0.3, max_chars=64 << 10)
HI = [{"role": "user", "content": "hi"}]

NESTED_RANGE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE_STRING = "{{ 'a' * 10**8 }}"
DOUBLING = "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}"

HOSTILE = {
    "nested range": NESTED_RANGE,
    "huge string": HUGE_STRING,
    "doubling +": DOUBLING,
    "doubling ~": DOUBLING.replace("ns.s + ns.s", "ns.s ~ ns.s"),
    "doubling set block": "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s %}{{ ns.s }}"
                          "{{ ns.s }}{% endset %}{% endfor %}",
    "doubling macro": "{% macro d(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='a') %}"
                      "{% for i in range(40) %}{% set ns.s = d(ns.s) %}{% endfor %}",
    "exponential macro": "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "loop over a long list": "{% for i in range(100000) %}{% for m in messages * 50000 %}{% endfor %}{% endfor %}",
    "output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "ljust": "{{ 'a'.ljust(10**9) }}",
    "center filter": "{{ 'a'|center(1000000000) }}",
    "map center": "{{ ['a']|map('center', 1000000000)|join }}",
    "join separator": "{{ range(100000)|join('x' * 60000) }}",
    "replace": "{{ ('a' * 1000)|replace('a', 'b' * 60000) }}",
    "translate": "{{ ('a' * 1000).translate({97: 'b' * 60000}) }}",
    "printf width": "{{ '%1000000000s' % 'a' }}",
    "format width": "{{ '{:>1000000000}'.format('a') }}",
    "format nested width": "{{ '{:>{w}}'.format('a', w=1000000000) }}",
    "big power": "{{ 2 ** 100000000 }}",
    "tojson indent": "{{ messages|tojson(indent=1000000000) }}",
    "lipsum": "{{ lipsum(n=10**7) }}",
    "batch fill": "{{ [1]|batch(1000000000, 'x')|list|length }}",
    # a list nested in itself: a few bytes to build, 2**60 items to print or compare
    "self-nested list": "{% set ns = namespace(l=[1]) %}{% for i in range(60) %}{% set ns.l = [ns.l, ns.l] %}"
                        "{% endfor %}{{ ns.l }}",
    "self-nested sets": "{% set a = ['x'] %}" + "{% set a = (a, a) %}" * 60 + "{{ a == a }}",
    "self-nested dict": "{% set ns = namespace(d={}) %}{% for i in range(60) %}{% set ns.d = {'a': ns.d, 'b': ns.d} %}"
                        "{% endfor %}{{ ns.d|tojson }}",
    "self-nested batch": "{% set ns = namespace(l=[1]) %}{% for i in range(60) %}{% set ns.l = [ns.l]|batch(2, ns.l)"
                         "|list %}{% endfor %}{{ ns.l }}",
    "list times": "{% set a = range(1000)|list %}{% set b = [a] * 1000 %}{{ b }}",
}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_is_stopped(name):
    rss = _rss_mib()
    start = time.monotonic()
    with pytest.raises(TemplateBudgetError) as e:
        ChatTemplate(HOSTILE[name], budget=SMALL).render(HI)
    assert time.monotonic() - start < SMALL.seconds + 1.0
    assert _rss_mib() - rss < 200, "the template was stopped only after it built something huge"
    assert isinstance(e.value, jinja2.TemplateError) and isinstance(e.value, ChatTemplateError)
    assert "budget" in str(e.value)


def test_budget_errors_name_what_ran_over():
    with pytest.raises(TemplateBudgetError, match="longer than its budget of 0.3 s"):
        ChatTemplate(NESTED_RANGE, budget=SMALL).render(HI)
    with pytest.raises(TemplateBudgetError, match="100000000 characters"):
        ChatTemplate(HUGE_STRING, budget=SMALL).render(HI)


def test_the_default_budget_stops_them_too():
    # The real numbers (seconds, MiB): a fresh deadline per render, the size checked first.
    with pytest.raises(TemplateBudgetError):
        ChatTemplate(HUGE_STRING).render(HI)
    with pytest.raises(TemplateBudgetError):
        ChatTemplate(DOUBLING).render(HI)


def test_each_render_has_its_own_deadline():
    t = ChatTemplate("{% for i in range(3000) %}{{ i }}{% endfor %}", budget=SMALL)
    assert all(len(t.render(HI)) == len("".join(map(str, range(3000)))) for _ in range(20))


def test_values_under_the_budget_still_work():
    src = ("{% set ns = namespace(s='ab') %}{% for i in range(10) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
           "{{ ns.s|length }} {{ 'x' * 3 }} {{ 'a'.ljust(4, '.') }} {{ 2 ** 10 }} {{ '%5s|' % 'b' }}"
           "{{ '{:>3}'.format('c') }} {{ [1, 2]|join(', ') }} {{ 'a-b'|replace('-', '+') }}")
    assert ChatTemplate(src, budget=SMALL).render(HI) == "2048 xxx a... 1024     b|  c 1, 2 a+b"


# -- real templates: the budgeted sandbox changes nothing --------------------------------
def _reference(source: str, **context) -> str:
    """Plain Jinja, configured as HF's apply_chat_template configures it."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda v, indent=None, **kw: json.dumps(v, ensure_ascii=False, indent=indent, **kw)

    def raise_exception(message):
        raise jinja2.TemplateError(message)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(**context)


CONVERSATIONS = [
    HI,
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo ✓"},
     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "And?\n\nMore " * 50}],
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("path", sorted(TEMPLATES.glob("*.jinja")) if TEMPLATES.is_dir() else [],
                         ids=lambda p: p.name)
def test_real_templates_render_as_plain_jinja(path):
    source = path.read_text()
    t = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    for messages in CONVERSATIONS:
        for gen in (True, False):
            for tools in (None, TOOLS):
                ctx = dict(messages=messages, add_generation_prompt=gen, tools=tools, bos_token="<s>",
                           eos_token="</s>", date_string="26 Jul 2024")
                assert t.render(messages, add_generation_prompt=gen, tools=tools,
                                date_string="26 Jul 2024") == _reference(source, **ctx)


def test_real_templates_are_present():
    if not TEMPLATES.is_dir():
        pytest.skip(f"{TEMPLATES} is not present")
    assert list(TEMPLATES.glob("*.jinja"))
