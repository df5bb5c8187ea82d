"""Tool calls and structured output through `alphallama serve` on the GPU (issue 33: "tool
calls (streaming and not) ... on CPU and GPU"). The device has no `openai` package (and no
room in a call's carry for it), so the requests are the OpenAI wire format over httpx, the
client the openai package itself uses; tests/server/test_server_tools.py drives the same
cases through the real client on the CPU.

For each server configuration (--configs: the serve defaults, --spec-type mtp, -np 2) it
starts the server on the embedded model (or --gguf), waits for /health 200 and sends:
  - a forced tool call (tool_choice required, then a named function), non-streaming and
    streaming: finish_reason tool_calls, the arguments parse and fit the tool's schema,
    the streamed deltas put together equal the non-streamed message,
  - a json_schema response (strict), non-streaming and streaming: it parses and fits,
  - at -np 2: the tool call and the JSON request at once (both valid, both as alone).
Writes $OUT/gpu_server_tools-<date>.json (every response's check, ms, tokens, the server's
own timings) and prints a table.

    GIT_COMMIT=... PYTHONPATH=/tmp/site:src python3 bench/gpu_server_tools.py [--device cuda]
    PYTHONPATH=src python bench/gpu_server_tools.py --device cpu --configs default   # CPU smoke
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from alphallama.bench.hostinfo import host_state

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "languages": {"type": "array", "items": {"enum": ["python", "c", "go"]},
                                                         "maxItems": 3}},
          "required": ["name", "age", "languages"], "additionalProperties": False}
CONFIGS = {"default": [], "mtp": ["--spec-type", "mtp"], "np2": ["-np", "2"]}


def fits(value, schema: dict) -> list[str]:
    """The ways `value` breaks one of the schemas above (the keywords they use); [] if it fits."""
    if "enum" in schema:
        return [] if value in schema["enum"] else [f"{value!r} not in {schema['enum']}"]
    t = schema.get("type")
    if t == "object":
        if not isinstance(value, dict):
            return [f"{value!r:.40} is not an object"]
        out = [f"missing {k}" for k in schema.get("required", []) if k not in value]
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            out += [f"extra {k}" for k in value if k not in props]
        return out + [p for k, v in value.items() if k in props for p in fits(v, props[k])]
    if t == "array":
        if not isinstance(value, list) or len(value) > schema.get("maxItems", len(value)):
            return [f"{value!r:.40} is not an array within maxItems"]
        return [p for v in value for p in fits(v, schema["items"])]
    if t == "string":
        return [] if isinstance(value, str) and len(value) <= schema.get("maxLength", len(value)) else [f"{value!r:.40}"]
    if t == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
        ok = ok and schema.get("minimum", value) <= value <= schema.get("maximum", value)
        return [] if ok else [f"{value!r} is not an integer in range"]
    return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`alphallama serve` in its own process group; stop() sends SIGINT, then SIGKILL."""

    def __init__(self, args: list[str], log: Path):
        self.port = free_port()
        self.log = log
        cmd = [sys.executable, "-m", "alphallama.cli", "serve", "--port", str(self.port), *args]
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"no /health 200 in {timeout} s")

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()


def chat(base: str, body: dict, stream: bool) -> dict:
    """One /v1/chat/completions: the message as a client puts it together, finish, usage, ms."""
    t0 = time.perf_counter()
    if not stream:
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=300)
        r.raise_for_status()
        j = r.json()
        c = j["choices"][0]
        calls = [(t["function"]["name"], t["function"]["arguments"], t["id"]) for t in c["message"].get("tool_calls") or []]
        return {"content": c["message"].get("content") or "", "calls": calls, "finish": c["finish_reason"],
                "usage": j.get("usage"), "timings": j.get("timings"), "ms": (time.perf_counter() - t0) * 1e3}
    content, calls, finish, usage, timings = "", {}, None, None, None
    with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            usage = ch.get("usage") or usage
            timings = ch.get("timings") or timings
            for choice in ch.get("choices") or []:
                d = choice.get("delta") or {}
                content += d.get("content") or ""
                for tc in d.get("tool_calls") or []:
                    e = calls.setdefault(tc["index"], ["", "", tc.get("id")])
                    e[0] += (tc.get("function") or {}).get("name") or ""
                    e[1] += (tc.get("function") or {}).get("arguments") or ""
                finish = choice.get("finish_reason") or finish
    return {"content": content, "calls": [tuple(v) for _, v in sorted(calls.items())], "finish": finish,
            "usage": usage, "timings": timings, "ms": (time.perf_counter() - t0) * 1e3}


def check_tool(r: dict, named: str | None) -> list[str]:
    if r["finish"] != "tool_calls" or len(r["calls"]) != 1:
        return [f"finish {r['finish']}, {len(r['calls'])} calls"]
    name, args, cid = r["calls"][0]
    bad = [] if cid and cid.startswith("call_") else [f"id {cid!r}"]
    if named and name != named:
        bad.append(f"called {name}, not {named}")
    try:
        return bad + (fits(json.loads(args), SCHEMAS[name]) if name in SCHEMAS else [f"unknown tool {name}"])
    except json.JSONDecodeError as e:
        return bad + [f"arguments are not JSON: {e}"]


def check_json(r: dict) -> list[str]:
    try:
        return fits(json.loads(r["content"]), PERSON)
    except json.JSONDecodeError as e:
        return [f"not JSON: {e}: {r['content'][:80]!r}"]


def cases() -> list[tuple[str, dict, object]]:
    named = {"type": "function", "function": {"name": "get_weather"}}
    base = dict(model="m", messages=ASK, tools=TOOLS, parallel_tool_calls=False, max_tokens=60, temperature=0)
    person = dict(model="m", messages=[{"role": "user", "content": "Describe a programmer as JSON."}], max_tokens=120,
                  temperature=0, response_format={"type": "json_schema", "json_schema": {
                      "name": "person", "schema": PERSON, "strict": True}})
    return [("tool_required", {**base, "tool_choice": "required"}, lambda r: check_tool(r, None)),
            ("tool_named", {**base, "tool_choice": named}, lambda r: check_tool(r, "get_weather")),
            ("json_schema", person, check_json)]


def run_config(name: str, args: list[str], out_dir: Path, timeout: float) -> dict:
    srv = Server(args, out_dir / f"tools-{name}.log")
    row: dict = {"args": args, "requests": []}
    try:
        row["ready_s"] = srv.wait(timeout)
        alone = {}
        for case, body, check in cases():
            for stream in (False, True):
                r = chat(srv.base, body, stream)
                bad = check(r)
                if stream and (r["content"], [c[:2] for c in r["calls"]]) != (alone[case]["content"],
                                                                             [c[:2] for c in alone[case]["calls"]]):
                    bad.append("streamed != non-streamed")
                alone.setdefault(case, r)
                row["requests"].append({"case": case, "stream": stream, "problems": bad, **r})
        if "-np" in args:     # the tool call and the JSON request at once: each as it was alone
            got: dict = {}
            picked = [c for c in cases() if c[0] in ("tool_required", "json_schema")]
            threads = [threading.Thread(target=lambda c=c: got.__setitem__(c[0], chat(srv.base, c[1], True)))
                       for c in picked]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for case, _, check in picked:
                r = got[case]
                bad = check(r) + ([] if (r["content"], [c[:2] for c in r["calls"]]) == (
                    alone[case]["content"], [c[:2] for c in alone[case]["calls"]]) else ["together != alone"])
                row["requests"].append({"case": case + "_together", "stream": True, "problems": bad, **r})
    except Exception as e:       # a server that failed is a row, not a lost run
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        row["stop_rc"] = srv.stop()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gguf", default=None, help="the model (default: the embedded one)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--timeout", type=float, default=180.0, help="s: a server's start")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"host": host_state(sys.argv), "commit": os.environ.get("GIT_COMMIT"), "device": args.device,
           "model": args.gguf or "embedded", "configs": {}}
    path = out_dir / f"gpu_server_tools-{time.strftime('%Y%m%d-%H%M%S')}.json"
    model = ["-m", args.gguf] if args.gguf else []
    for name in args.configs:
        res["configs"][name] = run_config(name, ["--device", args.device, *model, *CONFIGS[name]], out_dir, args.timeout)
        path.write_text(json.dumps(res, indent=1))
    bad = 0
    print(f"{'config':8s} {'case':24s} {'stream':6s} {'finish':10s} {'ms':>8s}  problems")
    for name, row in res["configs"].items():
        if "error" in row:
            print(f"{name:8s} ERROR {row['error'][:200]}")
            bad += 1
        for q in row["requests"]:
            bad += bool(q["problems"])
            print(f"{name:8s} {q['case']:24s} {str(q['stream']):6s} {str(q['finish']):10s} {q['ms']:8.0f}  "
                  f"{'; '.join(q['problems']) or 'ok'}")
    print(f"{path.name}: {'all valid' if not bad else f'{bad} with problems'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
