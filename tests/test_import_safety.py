"""Request-log import, the hostile and the faithful side: where images may come from, caps, broken
text, conflicting ids, failed requests, and every request field kept, normalised or refused.

No engine here (``test_import_openai.py`` replays a real client's log against a real server).
Files are real (symlinks, a FIFO, a text file posing as a BMP); images are real PNG renders.
"""
from __future__ import annotations

import json
import os

import pytest

from statescope.engine.config import EngineConfig
from statescope.engine.runners import ServerRunner, template_inputs
from statescope.errors import InputError
from statescope.verdict.inputs import check_trace, check_trace_runner
from statescope.verdict.reproduce import Arm
from statescope.workload import guilang
from statescope.workload.importer import import_request_log
from statescope.workload.request_fields import ChatRequest
from statescope.workload.screenshots import image_part, render_png
from statescope.workload.trace import episodes_of, read_trace, step_messages
from test_importer import agent_log, write_log

SECRET = b"BM AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG"
PNG = render_png(guilang.generate_episode(7, n_steps=3).steps[0].screenshots[0])


def image_body(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "next?"}]}],
        "max_tokens": 8}


@pytest.fixture
def dirs(tmp_path):
    logs, other = tmp_path / "logs", tmp_path / "other"
    logs.mkdir()
    other.mkdir()
    (logs / "a.png").write_bytes(PNG)
    (other / "b.png").write_bytes(PNG)
    (other / "secret.bmp").write_bytes(SECRET)
    return logs, other


def run_import(logs, url, **kw):
    log = write_log(logs / "log.jsonl", [image_body(url)])
    return import_request_log(log, logs.parent / "t.jsonl", **kw)


@pytest.mark.parametrize("url", ["{other}/b.png", "../other/b.png", "file://{other}/b.png",
                                 "link.png", "/etc/passwd", "/proc/self/environ", "/dev/zero"])
def test_images_only_from_the_logs_folder(dirs, url):
    logs, other = dirs
    (logs / "link.png").symlink_to(other / "b.png")  # a symlink out of the folder
    with pytest.raises(InputError, match=r"log.jsonl:1: field 'messages\[0\].content\[0\]"
                                         r"\.image_url\.url': .*outside the folders"):
        run_import(logs, url.format(other=other))
    assert not (logs.parent / "t.jsonl").exists()


def test_allow_root_admits_a_folder_and_the_manifest_says_so(dirs):
    logs, other = dirs
    m = run_import(logs, f"{other}/b.png", allow_roots=[other])
    assert str(other.resolve()) in m["image_roots"] and m["images"] == 1
    assert run_import(logs, "a.png")["images"] == 1  # the log's own folder, relative


def test_other_hosts_fifos_and_fake_images_are_refused_without_echo(dirs):
    logs, other = dirs
    with pytest.raises(InputError, match="another host"):
        run_import(logs, "file://otherhost/etc/passwd")
    os.mkfifo(logs / "pipe.png")
    with pytest.raises(InputError, match="not a regular file"):  # and no hang
        run_import(logs, "pipe.png")
    with pytest.raises(InputError) as err:
        run_import(logs, f"{other}/secret.bmp", allow_roots=[other])
    assert "decode as an image" in str(err.value)
    assert "AWS" not in str(err.value) and "BM" not in str(err.value).replace("BMP", "")


def test_size_caps_on_an_image_a_line_and_the_trace(dirs):
    logs, _ = dirs
    with pytest.raises(InputError, match=r":1: field .*image_url.url': .*bytes, expected at most 100 "):
        run_import(logs, "a.png", max_image_bytes=100)
    with pytest.raises(InputError, match=r"log.jsonl:1: line longer than 50 bytes"):
        run_import(logs, "a.png", max_line_bytes=50)
    log = write_log(logs / "l.jsonl", agent_log(2, 2))
    with pytest.raises(InputError, match=r"l.jsonl:\d+: the trace would exceed 10,000 bytes"):
        import_request_log(log, logs / "t.jsonl", max_trace_bytes=10_000)


def test_surrogates_nesting_and_conflicting_ids(tmp_path):
    base = agent_log(1, 1, images=False)[0]
    marked = json.loads(json.dumps(base))
    marked["messages"][1]["content"][0]["text"] = "MARK"
    line = json.dumps(marked).replace('"MARK"', '"Go\\ud800al"')
    (tmp_path / "s.jsonl").write_text(line + "\n")
    with pytest.raises(InputError, match=r"s.jsonl:1: field 'messages\[1\].content\[0\].text': .*surrogate"):
        import_request_log(tmp_path / "s.jsonl", tmp_path / "t.jsonl")
    (tmp_path / "d.jsonl").write_text("[" * 200_000 + "]" * 200_000 + "\n")
    with pytest.raises(InputError, match=r"d.jsonl:1: field '\(line\)': nested too deeply"):
        import_request_log(tmp_path / "d.jsonl", tmp_path / "t.jsonl")
    deep = {**base, "metadata": {"x": json.loads("[" * 100 + "]" * 100)}}
    with pytest.raises(InputError, match=r":1: field 'metadata': nested deeper than 64"):
        import_request_log(write_log(tmp_path / "e.jsonl", [deep]), tmp_path / "t.jsonl")
    twice = agent_log(2, 1, images=False)
    twice[1]["id"] = twice[0]["id"]
    with pytest.raises(InputError, match=r"r.jsonl:2: field 'id': request id already on line 1"):
        import_request_log(write_log(tmp_path / "r.jsonl", twice), tmp_path / "t.jsonl")
    two = agent_log(2, 1, id_field="session_id", images=False)
    two[1]["metadata"]["session_id"] = "agent-0"  # another agent's conversation under one id
    with pytest.raises(InputError, match=r"c.jsonl:2: field 'session_id': 'agent-0' names the "
                                         r"conversation of line 1"):
        import_request_log(write_log(tmp_path / "c.jsonl", two), tmp_path / "t.jsonl")


def test_failed_requests_are_skipped_and_counted(tmp_path):
    lines = agent_log(2, 2, images=False)
    lines[1]["status"] = 400
    lines[2]["metadata"] = {"status_code": 503}
    m = import_request_log(write_log(tmp_path / "l.jsonl", lines), tmp_path / "t.jsonl")
    assert m["requests"] == 2 and m["failed_skipped"] == 2
    assert any("status >= 400 skipped" in n for n in m["notes"])


TOOLS = [{"type": "function", "function": {"name": "click", "parameters": {
    "type": "object", "properties": {"id": {"type": "integer"}}}}}]


def tool_log() -> list[dict]:
    """A function-calling agent: parallel tool calls, their results, then the next user turn."""
    sys_msg = {"role": "system", "content": "You operate a desktop."}
    first = {"role": "user", "content": "open the menu"}
    calls = [{"id": f"c{i}", "type": "function",
              "function": {"name": "click", "arguments": json.dumps({"id": i})}} for i in (1, 2)]
    second = [sys_msg, first, {"role": "assistant", "content": None, "tool_calls": calls},
              {"role": "tool", "tool_call_id": "c1", "content": "ok"},
              {"role": "tool", "tool_call_id": "c2", "content": "ok"},
              {"role": "user", "content": "and now?"}]
    common = {"tools": TOOLS, "tool_choice": "auto", "stop": ["\n\n"], "seed": 3, "n": 2,
              "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
              "top_logprobs": 4, "response_format": {"type": "text"}, "frequency_penalty": 0,
              "max_tokens": 8, "model": "m"}
    return [{**common, "messages": [sys_msg, first], "id": "r1"},
            {**common, "messages": second, "id": "r2"}]


def test_request_fields_kept_normalised_or_refused(tmp_path):
    m = import_request_log(write_log(tmp_path / "l.jsonl", tool_log()), tmp_path / "t.jsonl")
    trace = read_trace(tmp_path / "t.jsonl")
    assert m["episodes"] == 1 and m["requests"] == 2  # the tool turns extend the conversation
    want = {"tools": TOOLS, "tool_choice": "auto", "stop": ["\n\n"], "seed": 3, "top_logprobs": 4,
            "response_format": {"type": "text"}}
    assert all(s.request == want for s in trace)
    assert m["fields"]["kept"] == {k: 2 for k in want}
    normalised = m["fields"]["normalised"]
    assert normalised["n"]["requests"] == 2 and "greedy" in normalised["n"]["how"]
    assert {"stream", "stream_options", "logprobs", "frequency_penalty"} <= set(normalised)
    raw = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert all(x["user"] is None and x["system"] is None for x in raw)  # each turn stored once
    for bad, field in (({"logit_bias": {"1": 5}}, "logit_bias"), ({"presence_penalty": 0.5},
                       "presence_penalty"), ({"functions": []}, "functions"), ({"audio": {}}, "audio")):
        lines = tool_log()
        lines[1].update(bad)
        with pytest.raises(InputError, match=rf"b.jsonl:2: field '{field}': "):
            import_request_log(write_log(tmp_path / "b.jsonl", lines), tmp_path / "u.jsonl")


def test_tool_conversations_replay_on_both_runners(tmp_path):
    import_request_log(write_log(tmp_path / "l.jsonl", tool_log()), tmp_path / "t.jsonl")
    trace = read_trace(tmp_path / "t.jsonl")
    gui = EngineConfig(model="data/models/tiny-gui")
    arms = [Arm("trigger", gui), Arm("control", gui)]
    check_trace(trace, arms)  # the user: null turn of a tool step (was a TypeError)
    with pytest.raises(InputError, match=r"t.jsonl:1: field 'request.stop': the offline runner"):
        check_trace_runner(trace, arms, "offline")
    check_trace_runner(trace, arms, "server")
    prompt = step_messages(episodes_of(trace)[trace[1].episode], 1, [])
    assert isinstance(prompt, ChatRequest) and prompt.fields["tools"] == TOOLS
    runner = ServerRunner("http://127.0.0.1:9", model="m")
    path, body = runner._body(prompt, "chat", 8, 2, False)
    assert path == "/v1/chat/completions" and body["tools"] == TOOLS and body["stop"] == ["\n\n"]
    assert body["temperature"] == 0.0 and body["top_logprobs"] == 4 and "n" not in body
    assert body["messages"] == list(prompt)
    messages, tools = template_inputs(prompt)  # what the offline runner's template gets
    assert messages[2]["tool_calls"][1]["function"]["arguments"] == {"id": 2}
    assert tools[0]["function"]["name"] == "click" and "parameters" in tools[0]["function"]


def test_images_on_a_text_only_model_refused_alike_or_dropped(tmp_path):
    lines = agent_log(1, 2)
    log = write_log(tmp_path / "l.jsonl", lines)
    import_request_log(log, tmp_path / "t.jsonl")
    arms = [Arm("trigger", EngineConfig(model="data/models/tiny-gui")),
            Arm("control", EngineConfig(model="data/models/tiny-gui"))]
    for runner in ("offline", "server"):
        with pytest.raises(InputError, match="text-only .* --drop-images"):
            check_trace_runner(read_trace(tmp_path / "t.jsonl"), arms, runner)
    m = import_request_log(log, tmp_path / "d.jsonl", drop_images=True)
    assert m["images"] == 0 and m["images_dropped"] > 0 and any("--drop-images" in n for n in m["notes"])
    check_trace_runner(read_trace(tmp_path / "d.jsonl"), arms, "offline")


def test_as_logged_import_still_replays_as_an_agent_loop(tmp_path):
    original = agent_log(2, 3)
    import_request_log(write_log(tmp_path / "l.jsonl", original), tmp_path / "t.jsonl")
    trace = read_trace(tmp_path / "t.jsonl")
    ep = episodes_of(trace)[trace[0].episode]
    answers = [guilang.generate_episode(500, n_steps=3).steps[j].action for j in range(2)]
    assert step_messages(ep, 2, answers, replay="agent_loop") == original[4]["messages"]


def test_detail_is_kept(tmp_path):
    part = image_part(guilang.generate_episode(7, n_steps=3).steps[0].screenshots[0])
    part["image_url"]["detail"] = "high"
    body = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "x"}]}]}
    import_request_log(write_log(tmp_path / "l.jsonl", [body]), tmp_path / "t.jsonl")
    assert read_trace(tmp_path / "t.jsonl")[0].messages[0]["content"][0]["image_url"]["detail"] == "high"
