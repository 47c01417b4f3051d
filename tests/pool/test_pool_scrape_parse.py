"""parse_metrics against prometheus_client's own parser, on generated exposition pages.

`scorer.pool.scrape` reads only the few sample lines it needs, by hand (the library's
parser cost ~0.4 ms a page on the event loop). The reference here is the previous
implementation: keep the wanted families' lines, parse them with
`prometheus_client.parser.text_string_to_metric_families`, read the samples.
"""

from __future__ import annotations

import math

from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from scorer.pool import scrape
from scorer.pool.scrape import ParsedMetrics, parse_metrics


def reference_parse(text: str) -> ParsedMetrics:
    """The library-parsed reading of a page (what parse_metrics must equal)."""
    keep = [ln for ln in text.splitlines() if ln.startswith(scrape._WANTED)]
    out = ParsedMetrics()
    running: list[float] = []
    waiting: list[float] = []
    usage: list[float] = []
    queries = hits = 0.0
    firsts: float | None = None
    done: float | None = None
    lora_at = -1.0
    for fam in text_string_to_metric_families("\n".join([*keep, ""])):
        for s in fam.samples:
            if s.name.startswith("vllm:"):
                out.engine = "vllm"
            elif s.name.startswith("sglang:"):
                out.engine = "sglang"
            if s.name in scrape.RUNNING:
                running.append(s.value)
            elif s.name in scrape.WAITING:
                waiting.append(s.value)
            elif s.name in scrape.USAGE:
                usage.append(s.value)
            elif s.name == scrape.CACHE_INFO:
                out.block_size = scrape._int_label(s.labels, "block_size")
                out.num_gpu_blocks = scrape._int_label(s.labels, "num_gpu_blocks")
            elif s.name == scrape.LORA_INFO:
                if s.value >= lora_at:
                    lora_at = s.value
                    out.lora_running = scrape._adapters(s.labels.get("running_lora_adapters"))
                    out.lora_waiting = scrape._adapters(s.labels.get("waiting_lora_adapters"))
            elif s.name in (scrape.VLLM_QUERIES, scrape.VLLM_QUERIES + "_total"):
                queries += s.value
            elif s.name in (scrape.VLLM_HITS, scrape.VLLM_HITS + "_total"):
                hits += s.value
            elif s.name == scrape.VLLM_FIRST_TOKENS:
                firsts = (firsts or 0.0) + s.value
            elif s.name == scrape.VLLM_FINISHED:
                done = (done or 0.0) + s.value
            elif s.name == scrape.SGLANG_HIT_RATE:
                out.cache_hit_rate = s.value
            elif s.name == scrape.SGLANG_CAPACITY:
                # The old code let int(inf) raise OverflowError (and end the scrape loop).
                if not math.isfinite(s.value):
                    raise ValueError("infinite capacity")
                out.capacity_tokens = int(s.value)
    if running:
        out.running = sum(running)
    if waiting:
        out.waiting = sum(waiting)
    if usage:
        u = sum(usage) / len(usage)
        out.kv_usage = u / 100.0 if u > 1.0 else u
    if queries > 0:
        out.cache_hit_rate = hits / queries
    out.first_tokens, out.finished = firsts, done
    if out.engine is None:
        raise ValueError("no engine metric")
    return out


NAMES = [
    *scrape.RUNNING,
    *scrape.WAITING,
    *scrape.USAGE,
    scrape.CACHE_INFO,
    scrape.LORA_INFO,
    scrape.VLLM_QUERIES + "_total",
    scrape.VLLM_QUERIES + "_created",
    scrape.VLLM_HITS + "_total",
    scrape.SGLANG_HIT_RATE,
    scrape.SGLANG_CAPACITY,
    "vllm:num_requests_running_extra",  # a longer name sharing a wanted prefix
    "vllm:time_to_first_token_seconds_bucket",
    scrape.VLLM_FIRST_TOKENS,
    "vllm:time_to_first_token_seconds_sum",
    scrape.VLLM_FINISHED,
    "vllm:request_success_created",
    "process_cpu_seconds_total",
]
LABEL_NAMES = [
    "engine",
    "model_name",
    "block_size",
    "num_gpu_blocks",
    "le",
    "running_lora_adapters",
    "waiting_lora_adapters",
]
# Label values the exposition format allows: spaces, commas, braces, escaped quotes.
label_value = st.sampled_from(
    ["0", "1", "qwen", "512", "16.0", "None", "", "a b", "x,y", "sql,chat", "}", "{", 'q\\"uote']
)
value = st.one_of(
    st.integers(-5, 10**6).map(str),
    st.floats(0, 1e9, allow_nan=False).map(repr),
    st.sampled_from(["1.7955500284627297e+09", "+Inf", "0.0", "100", "2e3"]),
)


@st.composite
def sample_line(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(NAMES))
    labels = draw(st.dictionaries(st.sampled_from(LABEL_NAMES), label_value, max_size=4))
    text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    ts = draw(st.sampled_from(["", " 1700000000000"]))
    head = f"{name}{{{text}}}" if labels or draw(st.booleans()) else name
    return f"{head} {draw(value)}{ts}"


@st.composite
def page(draw: st.DrawFn) -> str:
    lines: list[str] = []
    for line in draw(st.lists(sample_line(), min_size=1, max_size=12)):
        name = line.split("{")[0].split(" ")[0]
        if draw(st.booleans()):
            lines += [f"# HELP {name} some help text", f"# TYPE {name} gauge"]
        lines.append(line)
    return "\n".join(lines) + "\n"


def same(a: ParsedMetrics, b: ParsedMetrics) -> bool:
    def norm(p: ParsedMetrics) -> tuple[object, ...]:
        return tuple(
            "nan" if isinstance(v, float) and math.isnan(v) else v
            for v in (
                p.engine,
                p.running,
                p.waiting,
                p.kv_usage,
                p.block_size,
                p.num_gpu_blocks,
                p.capacity_tokens,
                tuple(p.lora_running),
                tuple(p.lora_waiting),
                p.cache_hit_rate,
                p.first_tokens,
                p.finished,
            )
        )

    return norm(a) == norm(b)


def outcome(parse: object, text: str) -> ParsedMetrics | str:
    try:
        return parse(text)  # type: ignore[operator, no-any-return]
    except ValueError:
        return "ValueError"


@given(page())
@example('vllm:cache_config_info{block_size="16.0",num_gpu_blocks="None"} 1.0\n')
@example('vllm:lora_requests_info{running_lora_adapters="a b",waiting_lora_adapters="}"} 2\n')
@example("sglang:max_total_num_tokens 1e3 1700000000000\n")
@example("vllm:num_requests_waiting\t3\r\nvllm:num_requests_running 2\r\n")
def test_generated_pages_read_as_the_library_reads_them(text: str) -> None:
    ours, ref = outcome(parse_metrics, text), outcome(reference_parse, text)
    if isinstance(ours, str) or isinstance(ref, str):
        assert ours == ref
    else:
        assert same(ours, ref), (ours, ref)


@given(st.text(alphabet='vlm:_nurqesigwatkcp{}="\\ ,.0123456789e+-#\n\tIfNa', max_size=200))
@example('vllm:num_requests_running{engine="0"\n')
@example("vllm:num_requests_running 1 2 3\n")
@example('vllm:cache_config_info{block_size="inf"} 1\n')
@example("sglang:max_total_num_tokens +Inf\n")
def test_any_text_parses_or_raises_value_error(text: str) -> None:
    try:
        parsed = parse_metrics(text)
    except ValueError:
        return  # refused, counted as bad_payload by the scraper
    assert parsed.engine in ("vllm", "sglang")
