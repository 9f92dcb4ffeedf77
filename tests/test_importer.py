"""Request-log import: episodes by prefix or id, images kept, both replay modes, bad input named.

No engine here (``test_import_replay.py`` imports a log written by a real ``vllm serve`` client).
The logs are built from the GUI-agent language and real PNG screenshots.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc

import pytest

from statescope.errors import InputError
from statescope.workload import guilang
from statescope.workload.images import image_bytes
from statescope.workload.importer import import_request_log, manifest_path, max_overlap
from statescope.workload.screenshots import image_part, render_png
from statescope.workload.trace import episodes_of, read_trace, step_messages


def agent_log(n_episodes: int = 3, n_steps: int = 3, *, t0: float = 1_700_000_000.0,
              model: str = "tiny", id_field: str | None = None, images: bool = True) -> list[dict]:
    """Chat bodies as a GUI agent sends them: each step resends the history plus a new turn.
    Episodes interleave (step-major) the way concurrent agents fill a log."""
    eps = [guilang.generate_episode(500 + e, n_steps=max(3, n_steps)) for e in range(n_episodes)]
    lines = []
    for k in range(n_steps):
        for e, ep in enumerate(eps):
            msgs = [{"role": "system", "content": guilang.SYSTEM_PROMPT}]
            for j in range(k + 1):
                users = guilang.user_turns(ep)
                content = ([image_part(s) for s in ep.steps[j].screenshots] if images else []) \
                    + [{"type": "text", "text": users[j]}]
                msgs.append({"role": "user", "content": content})
                if j < k:
                    msgs.append({"role": "assistant", "content": ep.steps[j].action})
            start = t0 + 10 * k + 0.5 * e
            line = {"model": model, "messages": msgs, "max_tokens": 24, "temperature": 0.0,
                    "id": f"req-{k}-{e}", "timestamp": start, "end_timestamp": start + 1.2}
            if id_field:
                line["metadata"] = {id_field: f"agent-{e}"}
            lines.append(line)
    return lines


def write_log(path, lines) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_prefix_grouping_rebuilds_the_agent_episodes(tmp_path):
    log = write_log(tmp_path / "log.jsonl", agent_log(3, 3))
    m = import_request_log(log, tmp_path / "trace.jsonl")
    trace = read_trace(tmp_path / "trace.jsonl")
    eps = episodes_of(trace)
    assert m["group_by"] == "prefix" and m["episodes"] == 3 and m["requests"] == 9
    assert sorted(len(v) for v in eps.values()) == [3, 3, 3]
    # log order is kept: line k*3+e is episode e's step k
    assert [s.extra["log_line"] for s in trace] == list(range(1, 10))
    assert [s.step for s in trace] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(s.replay == "as_logged" for s in trace)
    # as logged: the recorded messages come back unchanged, images included
    original = agent_log(3, 3)
    for s in trace:
        assert step_messages(eps[s.episode], s.step, []) == original[s.extra["log_line"] - 1]["messages"]
    assert m["images"] == sum(len(list(filter(lambda p: p["type"] == "image_url", msg["content"])))
                              for line in original for msg in line["messages"]
                              if isinstance(msg["content"], list))
    # three agents overlap 1.2 s each, started 0.5 s apart: 3 in flight at once
    assert m["max_concurrency"] == 3 and m["model"] == "tiny" and m["agent_loop_possible"]
    assert json.loads(manifest_path(tmp_path / "trace.jsonl").read_text()) == m
    assert trace[4].extra["arrival_s"] == pytest.approx(10.5)


def test_agent_loop_replay_rebuilds_later_turns_from_the_answers(tmp_path):
    original = agent_log(2, 3)
    log = write_log(tmp_path / "log.jsonl", original)
    m = import_request_log(log, tmp_path / "trace.jsonl", replay="agent_loop")
    trace = read_trace(tmp_path / "trace.jsonl")
    assert m["replay"] == "agent_loop" and all(s.messages is None for s in trace)
    ep = episodes_of(trace)[trace[0].episode]
    logged_answers = [guilang.generate_episode(500, n_steps=3).steps[j].action for j in range(2)]
    # with the logged answers the loop rebuilds the logged request exactly ...
    assert step_messages(ep, 2, logged_answers) == original[4]["messages"]
    # ... with another engine's answers the history changes, the new turn stays
    other = step_messages(ep, 2, ["click(id=1)", "scroll(down)"])
    assert other[2]["content"] == "click(id=1)" and other[-1] == original[4]["messages"][-1]


def test_id_field_groups_and_batch_format(tmp_path):
    lines = [{"custom_id": x["id"], "method": "POST", "url": "/v1/chat/completions",
              "body": {k: v for k, v in x.items() if k not in ("id", "timestamp", "end_timestamp")}}
             for x in agent_log(2, 2, id_field="session_id")]
    for line in lines:  # the batch format keeps metadata inside the body
        assert "metadata" in line["body"]
    m = import_request_log(write_log(tmp_path / "b.jsonl", lines), tmp_path / "t.jsonl")
    trace = read_trace(tmp_path / "t.jsonl")
    assert m["format"] == "openai-batch" and m["group_by"] == "field:session_id"
    assert sorted(episodes_of(trace)) == ["agent-0", "agent-1"]
    assert trace[0].extra["request_id"] == "req-0-0" and m["max_concurrency"] is None


def test_root_grouping_survives_an_agent_that_rewrites_history(tmp_path):
    lines = agent_log(2, 3, images=False)
    for line in lines:  # keep only the system prompt, the goal turn and the latest turn
        msgs = line["messages"]
        line["messages"] = msgs[:2] + msgs[-1:] if len(msgs) > 3 else msgs
    assert import_request_log(write_log(tmp_path / "l.jsonl", lines), tmp_path / "p.jsonl",
                              group_by="prefix")["episodes"] > 2  # the prefix chain breaks ...
    m = import_request_log(tmp_path / "l.jsonl", tmp_path / "r.jsonl", group_by="root")
    assert m["episodes"] == 2 and not m["agent_loop_possible"]  # ... the shared root does not
    with pytest.raises(InputError, match=r"l.jsonl:3: field 'messages': step 1 .* cannot be rebuilt"):
        import_request_log(tmp_path / "l.jsonl", tmp_path / "x.jsonl", group_by="root",
                           replay="agent_loop")


def test_image_files_are_embedded_and_web_urls_refused(tmp_path):
    spec = guilang.generate_episode(7, n_steps=3).steps[0].screenshots[0]
    (tmp_path / "shots").mkdir()
    (tmp_path / "shots" / "a.png").write_bytes(render_png(spec))
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "shots/a.png"}},
        {"type": "image_url", "image_url": f"file://{tmp_path}/shots/a.png"},  # a bare string too
        {"type": "text", "text": "what now?"}]}], "max_tokens": 8}
    import_request_log(write_log(tmp_path / "log.jsonl", [body]), tmp_path / "t.jsonl")
    parts = read_trace(tmp_path / "t.jsonl")[0].messages[0]["content"]
    urls = [p["image_url"]["url"] for p in parts[:2]]
    assert all(u.startswith("data:image/png;base64,") for u in urls)
    assert image_bytes(urls[0]) == image_bytes(urls[1]) == render_png(spec)


def bad_cases():
    good = agent_log(1, 2)

    def with_line2(change):
        lines = json.loads(json.dumps(good))
        change(lines[1])
        return lines

    img = ("messages", 1, "content", 0, "image_url", "url")

    def set_img(url):
        def change(line):
            line["messages"][1]["content"][0]["image_url"]["url"] = url
        return change

    return [
        ("not json", None, r"log.jsonl:2: not valid JSON"),
        ("no messages", with_line2(lambda l: l.pop("messages")), r":2: field 'messages': missing"),
        ("web image", with_line2(set_img("https://example.com/x.png")),
         r":2: field 'messages\[1\].content\[0\].image_url.url': .*web URL"),
        ("missing file", with_line2(set_img("nope/missing.png")),
         r":2: field 'messages\[1\].content\[0\].image_url.url': .*readable image file"),
        ("not base64", with_line2(set_img("data:image/png;base64,@@@")),
         r":2: field 'messages\[1\].content\[0\].image_url.url': .*base64"),
        ("not an image", with_line2(set_img("data:image/png;base64,aGVsbG8gd29ybGQ=")),
         r":2: field 'messages\[1\].content\[0\].image_url.url': expected PNG"),
        ("mixed models", with_line2(lambda l: l.update(model="other")),
         r":2: field 'model': expected 'tiny' \(as on line 1\), got 'other': mixed models"),
        ("bad role", with_line2(lambda l: l["messages"][0].update(role="robot")),
         r":2: field 'messages\[0\].role'"),
        ("bad max_tokens", with_line2(lambda l: l.update(max_tokens=0)), r":2: field 'max_tokens'"),
        ("bad timestamp", with_line2(lambda l: l.update(timestamp="yesterday")),
         r":2: field 'timestamp': expected an ISO 8601 time"),
    ], img


@pytest.mark.parametrize("name,lines,pattern", bad_cases()[0], ids=[c[0] for c in bad_cases()[0]])
def test_bad_input_names_file_line_and_field(tmp_path, name, lines, pattern):
    log = tmp_path / "log.jsonl"
    if lines is None:
        log.write_text(json.dumps(agent_log(1, 1)[0]) + "\n{\"messages\": [\n")
    else:
        write_log(log, lines)
    with pytest.raises(InputError, match=pattern):
        import_request_log(log, tmp_path / "t.jsonl")
    assert not (tmp_path / "t.jsonl").exists() and not (tmp_path / "t.jsonl.tmp").exists()


def test_missing_id_field_when_grouping_by_it(tmp_path):
    lines = agent_log(1, 2, id_field="session_id")
    del lines[1]["metadata"]
    with pytest.raises(InputError, match=r":2: field 'session_id': missing"):
        import_request_log(write_log(tmp_path / "l.jsonl", lines), tmp_path / "t.jsonl")


def test_cli_import_and_exit_2(tmp_path):
    log = write_log(tmp_path / "log.jsonl", agent_log(2, 2))
    env_cmd = [sys.executable, "-m", "statescope.cli.main", "workload", "import", log,
               "--out", str(tmp_path / "t.jsonl"), "--json"]
    ok = subprocess.run(env_cmd, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["episodes"] == 2
    (tmp_path / "bad.jsonl").write_text('{"model": "x"}\n')
    bad = subprocess.run(env_cmd[:5] + [str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "u.jsonl")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert "bad.jsonl:1: field 'messages': missing" in bad.stderr


def test_memory_is_bounded_by_one_request_not_the_log(tmp_path):
    """Peak Python memory of an import stays flat as the log grows 8x (streamed)."""
    def peak(n_episodes: int) -> tuple[int, int]:
        log = write_log(tmp_path / f"log{n_episodes}.jsonl", agent_log(n_episodes, 3))
        size = (tmp_path / f"log{n_episodes}.jsonl").stat().st_size
        tracemalloc.start()
        import_request_log(log, tmp_path / f"t{n_episodes}.jsonl")
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top, size

    small, small_size = peak(5)
    big, big_size = peak(40)
    assert big_size > 7 * small_size
    assert big < 2 * small, (small, big)  # not proportional to the log
    assert big < big_size / 3


def test_max_overlap():
    assert max_overlap([(0, 1), (1, 2)]) == 1  # back to back: never two at once
    assert max_overlap([(0, 3), (1, 2), (1.5, 4)]) == 3
    assert max_overlap([(0, 1)] * 5) == 5
