"""guilang: deterministic episodes, exact step counts, prompts that share prefixes, an independent
re-derivation of every correct action from the observation + goal, parsing and grading."""
import re

import pytest

from statescope.workload import guilang as g

LINE = re.compile(r'(textbox|button|text) "([^"]*)"(?: value="([^"]*)")?( focused)? id=(\d+) @')


def solve(goal: str, observation: str) -> str:
    """An independent solver written from the rule list in the module docstring."""
    text = re.search(r'with text="(\w+)"', goal).group(1)
    submit = re.search(r"then press (\w+)\.", goal).group(1)
    lines = observation.splitlines()
    # the focus line (last) names the first empty textbox, else the default button, else nothing
    focus = re.fullmatch(r'focused: (textbox|button) "(\w+)" at\(id=(\d+)\)', lines[-1])
    if any(line.startswith("dialog ") for line in lines):
        return "key(esc)"
    if lines[0].endswith("submitted"):
        return "done()"
    widgets = []
    for line in lines[1:]:
        m = LINE.match(line)
        if m:
            role, label, value, focused, wid = m.groups()
            widgets.append((wid, role, label, value))
            assert bool(focused) == (role == "textbox" and value == "" and
                                     not any(r == "textbox" and v == "" for _, r, _, v in widgets[:-1]))
    empty = [(w, lab) for w, r, lab, v in widgets if r == "textbox" and v == ""]
    default = [(w, lab) for w, r, lab, _ in widgets if r == "button" and lab in (submit, "Next")]
    want_focus = (empty or default or [None])[0]
    assert (focus.group(3), focus.group(2)) == want_focus if focus else want_focus is None, lines[-1]
    for wid, role, label, value in widgets:
        if role == "textbox" and value == "":
            return f'type(id={wid}, text="{text}")'
    for wid, role, label, _ in widgets:
        if role == "button" and label == submit:
            return f"click(id={wid})"
    if "(more below)" in lines:
        return "scroll(down)"
    return "click(id=%s)" % next(w for w, r, lab, _ in widgets if r == "button" and lab == "Next")


@pytest.mark.parametrize("n_steps", range(3, 15))
def test_episode_has_exact_steps_and_solver_agrees(n_steps):
    for seed in range(25):
        ep = g.generate_episode(seed, n_steps)
        assert len(ep.steps) == n_steps
        assert ep.steps[-1].action == "done()"
        for step in ep.steps:
            assert g.is_valid_action(step.action)
            assert solve(ep.goal, step.observation) == step.action, (seed, step.index)


def test_deterministic_and_seed_dependent():
    a, b = g.generate_episode(7, 8), g.generate_episode(7, 8)
    assert a == b
    assert g.generate_episode(8, 8).goal != a.goal or g.generate_episode(8, 8).steps != a.steps


def test_all_action_kinds_occur():
    kinds = {s.kind for seed in range(60) for s in g.generate_episode(seed, 9).steps}
    assert kinds == {"type", "click_submit", "click_next", "scroll", "key", "done"}


def test_bad_n_steps():
    with pytest.raises(ValueError):
        g.generate_episode(0, 2)
    with pytest.raises(ValueError):
        g.generate_episode(0, 40)


def test_prompts_grow_with_shared_prefix():
    ep = g.generate_episode(3, 7)
    prompts = [g.render_prompt(ep, i) for i in range(7)]
    for i in range(6):
        assert prompts[i + 1].startswith(prompts[i] + ep.steps[i].action + "<|im_end|>\n")
    assert prompts[0].count("Goal:") == 1 and prompts[-1].endswith("<|im_start|>assistant\n")
    whole = "".join(t for t, _ in g.transcript_segments(ep))
    assert whole == prompts[-1] + ep.steps[-1].action + "<|im_end|>\n"
    msgs = g.render_messages(ep, 2)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[2]["content"] == ep.steps[0].action
    with pytest.raises(IndexError):
        g.render_messages(ep, 7)


def test_chat_template_renders_the_same_prompt():
    from jinja2 import Template

    from statescope.models.structured import CHAT_TEMPLATE

    ep = g.generate_episode(5, 5)
    rendered = Template(CHAT_TEMPLATE).render(messages=g.render_messages(ep, 3), add_generation_prompt=True)
    assert rendered == g.render_prompt(ep, 3)


def test_screenshot_specs():
    ep = g.generate_episode(11, 9)
    for step in ep.steps:
        assert 1 <= len(step.screenshots) <= 3
        for shot in step.screenshots:
            assert shot["width"] > 0 and shot["height"] > 0
            for w in shot["widgets"]:
                assert f"id={w['id']} " in step.observation
    assert any(len(s.screenshots) > 1 for s in ep.steps)


def test_parse_and_grade():
    assert g.parse_action('type(id=12, text="kiwi")<|im_end|>') == {"name": "type", "id": 12, "text": "kiwi"}
    assert g.parse_action(" click(id=3) ") == {"name": "click", "id": 3}
    assert g.parse_action("scroll(down)") == {"name": "scroll", "direction": "down"}
    assert g.parse_action("key(esc)") == {"name": "key", "key": "esc"}
    assert g.parse_action("done()") == {"name": "done"}
    for bad in ["!!!!!!", "", "click(id=)", "click(id=3) click(id=4)", 'type(id=1, text="a"b")', "done"]:
        assert not g.is_valid_action(bad), bad
    step = g.generate_episode(0, 4).steps[0]
    assert g.grade(step.action, step) == {"valid": True, "correct": True}
    assert g.grade("done()", step) == {"valid": True, "correct": False}
    assert g.grade("!!!!", step) == {"valid": False, "correct": False}


def test_kept_steps_transcript_is_a_well_formed_shorter_conversation():
    ep = g.generate_episode(9, 8)
    whole = g.transcript_segments(ep)
    short = g.transcript_segments(ep, keep=[0, 3, 7])
    assert sum(a for _, a in short) == 3 and sum(a for _, a in whole) == 8
    answers = [t for t, a in short if a]
    assert answers == [ep.steps[i].action + "<|im_end|>" for i in (0, 3, 7)]
    text = "".join(t for t, _ in short)
    assert text.count("Goal:") == 1 and ep.steps[3].observation in text
    assert ep.steps[1].observation not in text
    for bad in ([], [1, 2], [0, 0], [3, 0], [0, 8]):
        with pytest.raises(ValueError):
            g.transcript_segments(ep, keep=bad)


def test_goal_text_is_written_as_the_answers_write_it():
    """The value is copied verbatim: the goal says text="v", every type action says text="v"."""
    for seed in range(20):
        ep = g.generate_episode(seed, 10)
        value = re.search(r'text="(\w+)"', ep.goal).group(1)
        assert {v for _, v in ep.fields} == {value}
        typed = [s for s in ep.steps if s.kind == "type"]
        assert typed and all(s.action.endswith(f'text="{value}")') for s in typed)
