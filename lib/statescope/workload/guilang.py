"""A synthetic GUI-agent language small enough for a tiny model to learn, and to be graded on.

What it does: generates deterministic multi-step "fill a form" episodes. The first user turn states
a goal (which fields to fill with which text value, and which button submits); every step shows one
observation (window title + an accessibility-tree-like widget list with ids, labels, values and
coordinates) and has exactly one correct action, a deterministic function of the observation and the
goal:

1. a dialog is open                         -> ``key(esc)``
2. the window says the form was submitted   -> ``done()``
3. a visible textbox is empty               -> ``type(id=<first empty>, text="<the goal's text>")``
   (the first empty textbox is the one rendered ``focused``)
4. the goal's submit button is visible      -> ``click(id=<that button>)``
5. the page continues below the viewport    -> ``scroll(down)``
6. otherwise                                -> ``click(id=<"Next" button>)``

Like an app's keyboard focus, the observation's last line ``focused: <role> "<label>" at(id=N)`` names
the first empty textbox, else the default button (the goal's submit button, or "Next"); a view to
be scrolled has none. So the id to act on is a short-range copy (carried by the GDN recurrent
state across the turn boundary), while the value to type must be recalled from the goal in the
first user turn (long memory). ``render_prompt`` gives the growing shared-prefix prompt (system, goal + first
observation, then action/observation turns), ``render_messages`` the same as OpenAI chat messages.
Each step also carries 1-3 deterministic screenshot specs (size + widgets drawn) for a renderer.
``action_validator_for`` is the one rule for when an arm's answers are graded on action syntax
(only when the control arm speaks the language).

What it deliberately does not do: render images, tokenize, or call a model.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

SYSTEM_PROMPT = ("You are a GUI agent. Each turn shows the screen. Reply with one action: "
                 "click(id=N), type(id=N, text=\"...\"), scroll(down), key(esc) or done().")
APPS = ["Mail", "Shop", "Bank", "Notes", "Travel", "Clinic", "School", "Library"]
FORMS = ["Signup", "Profile", "Order", "Contact", "Booking", "Survey", "Payment", "Account"]
LABELS = ["Name", "City", "Email", "Phone", "Street", "Country", "Code", "Color", "Pet", "Fruit",
          "Title", "Team", "Size", "Day", "Month", "Brand", "Movie", "Song", "Food", "Job",
          "School", "Sport", "Car", "Game"]
VALUES = ["kiwi", "oslo", "lima", "rome", "paris", "tokyo", "delta", "echo", "tango", "alpha",
          "bravo", "lemon", "mango", "peach", "plum", "olive", "amber", "coral", "ivory", "jade",
          "ruby", "pearl", "maple", "cedar", "birch", "river", "stone", "cloud", "storm", "frost",
          "tiger", "panda", "eagle", "otter", "zebra", "koala", "piano", "violin", "drum", "flute"]
# Opt-in sequence values (``value_words``): labels that are one token both after ``="`` and after a
# space, so a value of W words is W tokens (the conv window, kernel 4, then spans 4 words).
SEQ_WORDS = ["Pet", "Car", "Day", "Job", "Song", "Food", "Team", "Game"]
SUBMIT_BUTTONS = ["Save", "Submit", "Send", "Apply", "Confirm"]
OTHER_BUTTONS = ["Cancel", "Reset", "Help", "Back"]
DIALOGS = ["Tip", "Cookies", "Update", "Survey", "News"]
SCREEN_W, SCREEN_H = 1280, 800
ACTION_RE = re.compile(
    r'(?:click\(id=(?P<click>\d+)\)'
    r'|type\(id=(?P<type>\d+), text="(?P<text>[^"\n]*)"\)'
    r'|scroll\((?P<scroll>up|down)\)'
    r'|key\((?P<key>esc|enter|tab)\)'
    r'|(?P<done>done)\(\))')


@dataclass(frozen=True)
class Widget:
    """One widget of a view: ``role`` is textbox/button/text; ``value`` only for textboxes."""
    wid: int
    role: str
    label: str
    x: int
    y: int
    value: str | None = None

    def line(self, focused: bool = False) -> str:
        # The id follows the content it names, so a causal reader knows what the id is for.
        value = f' value="{self.value}"' if self.role == "textbox" else ""
        focus = " focused" if focused else ""
        return f'{self.role} "{self.label}"{value}{focus} id={self.wid} @({self.x},{self.y})'


@dataclass(frozen=True)
class Step:
    """One agent step: what the agent sees, what it must answer, and its screenshot specs."""
    index: int
    observation: str
    action: str
    kind: str  # key / done / type / click_submit / scroll / click_next
    screenshots: tuple[dict, ...]


@dataclass(frozen=True)
class Episode:
    seed: int
    app: str
    form: str
    goal: str
    fields: tuple[tuple[str, str], ...]  # (label, value) in goal order
    submit: str
    steps: tuple[Step, ...] = field(default_factory=tuple)


def _plan(rng: random.Random, n_steps: int) -> tuple[int, list[list[int]]]:
    """Choose (dialog step or -1, pages -> views -> new fields per view) summing to n_steps."""
    budget = n_steps - 2  # final click + done()
    dialog = rng.randrange(n_steps - 1) if budget >= 3 and rng.random() < 0.3 else -1
    if dialog >= 0:
        budget -= 1
    n_pages = min(rng.choice([1, 1, 2, 2, 3]), max(1, budget // 2))
    # every page has >= 1 view; each view ends with a scroll/next except the last view overall
    views = [[1] for _ in range(n_pages)]
    moves = n_pages - 1
    typed = budget - moves
    while typed > 4 and rng.random() < 0.6:  # extra scrolls on long episodes
        views[rng.randrange(n_pages)].append(1)
        moves += 1
        typed -= 1
    if typed < 1:
        raise ValueError(f"n_steps={n_steps}: too few steps for this plan")
    slots = [(p, v) for p in range(n_pages) for v in range(len(views[p]))]
    counts = [1] + [0] * (len(slots) - 1)  # the first view always has a field to type
    for _ in range(typed - 1):
        counts[rng.randrange(len(slots))] += 1
    for (p, v), c in zip(slots, counts):
        views[p][v] = c
    return dialog, views


def generate_episode(seed: int, n_steps: int = 6, max_fields: int = 8, value_words: int = 0,
                     value_alphabet: int = 4, value_runs: int = 0) -> Episode:
    """A deterministic episode with exactly ``n_steps`` steps (3 <= n_steps <= max_fields + 6).

    ``value_words`` > 0 (opt-in, see ``guilang_seq``): the text value is a sequence of
    ``value_words - 2`` .. ``value_words`` words drawn with repeats from the first
    ``value_alphabet`` of ``SEQ_WORDS`` (which are then not used as field labels). 0 (default):
    one word of ``VALUES``, the episode exactly as before. ``value_runs`` > 0: the words come in
    that many runs of one word each (consecutive runs differ), e.g. ``Pet Pet Pet Pet Car Car``."""
    if not 3 <= n_steps <= max_fields + 6:
        raise ValueError(f"n_steps={n_steps}: expected 3..{max_fields + 6}")
    if value_words and not (3 <= value_words and 2 <= value_alphabet <= len(SEQ_WORDS)):
        raise ValueError(f"value_words={value_words}, value_alphabet={value_alphabet}: expected "
                         f">= 3 words of 2..{len(SEQ_WORDS)}")
    rng = random.Random(seed * 1_000_003 + n_steps)
    while True:
        dialog, views = _plan(rng, n_steps)
        if sum(map(sum, views)) <= max_fields:
            break
    n_fields = sum(map(sum, views))
    app, form = rng.choice(APPS), rng.choice(FORMS)
    labels = rng.sample([lab for lab in LABELS if lab not in SEQ_WORDS] if value_words else LABELS,
                        n_fields)
    values = [rng.choice(VALUES) for _ in labels]
    if value_words:
        n_words = rng.randint(value_words - 2, value_words)
        values[0] = " ".join(rng.choice(SEQ_WORDS[:value_alphabet]) for _ in range(n_words)) \
            if not value_runs else _runs(rng, n_words, value_runs, SEQ_WORDS[:value_alphabet])
    # One text value for every field, written in the goal exactly as an answer writes it
    # (text="..."): recalling it is a clean copy from the first user turn, however far back.
    values = [values[0]] * n_fields
    submit = rng.choice(SUBMIT_BUTTONS)
    ids = iter(rng.sample(range(1, 100), 99))
    goal_order = list(range(n_fields))
    rng.shuffle(goal_order)
    fields = tuple((labels[i], values[i]) for i in goal_order)
    goal = (f"Goal: in {app}, fill the {form} form (" + ", ".join(lab for lab, _ in fields)
            + f') with text="{values[0]}", then press {submit}.')
    value_of = dict(zip(labels, values))

    steps: list[Step] = []
    field_iter = iter(labels)
    n_pages = len(views)

    def emit(title: str, widgets: list[Widget], more: bool, action: str, kind: str,
             dialog_widget: Widget | None = None) -> None:
        # like a real app, the first empty textbox has the keyboard focus
        first_empty = next((w.wid for w in widgets if w.role == "textbox" and w.value == ""), None)
        lines = [f"Screen: {title}"] + [w.line(w.wid == first_empty) for w in widgets]
        if more:
            lines.append("(more below)")
        if dialog_widget is not None:
            lines.append(f'dialog "{rng.choice(DIALOGS)}" ' + dialog_widget.line())
        focus = _focus(widgets, submit)
        if focus is not None:  # last line, so the id to act on is the most recent "id=N"
            lines.append(f'focused: {focus.role} "{focus.label}" at(id={focus.wid})')
        shots = _screenshots(len(steps), title, widgets, dialog_widget)
        steps.append(Step(len(steps), "\n".join(lines), action, kind, shots))

    for p, page_views in enumerate(views):
        title = f"{app} - {form} (page {p + 1}/{n_pages})"
        prev_filled: list[Widget] = []
        for v, n_new in enumerate(page_views):
            last_view = v == len(page_views) - 1
            y = 80
            widgets: list[Widget] = []
            for w in prev_filled[-1:]:  # the last filled field stays visible after a scroll
                widgets.append(Widget(w.wid, w.role, w.label, w.x, y, w.value))
                y += 48
            if rng.random() < 0.5:
                widgets.append(Widget(next(ids), "text", rng.choice(["Please fill in", "Required",
                                                                      "Optional", "Details"]),
                                      40, y))
                y += 48
            new = []
            for _ in range(n_new):
                lab = next(field_iter)
                new.append(len(widgets))
                widgets.append(Widget(next(ids), "textbox", lab, 40 + 20 * rng.randrange(4), y, ""))
                y += 48
            if last_view:
                buttons = [next(ids) for _ in range(2)]
                names = ["Back", "Next"] if p < n_pages - 1 else \
                    rng.sample([b for b in SUBMIT_BUTTONS if b != submit], 1) + [submit]
                if p == n_pages - 1:
                    rng.shuffle(names)
                for k, (bid, name) in enumerate(zip(buttons, names)):
                    widgets.append(Widget(bid, "button", name, 200 + 160 * k, y + 20))
            for i in new:  # one step per empty textbox, top to bottom
                w = widgets[i]
                _maybe_dialog(emit, dialog, steps, title, widgets, not last_view, ids)
                emit(title, widgets, not last_view, f'type(id={w.wid}, text="{value_of[w.label]}")',
                     "type")
                widgets[i] = Widget(w.wid, w.role, w.label, w.x, w.y, value_of[w.label])
            _maybe_dialog(emit, dialog, steps, title, widgets, not last_view, ids)
            if not last_view:
                emit(title, widgets, True, "scroll(down)", "scroll")
            else:
                target = submit if p == n_pages - 1 else "Next"
                bid = next(w.wid for w in widgets if w.role == "button" and w.label == target)
                emit(title, widgets, False, f"click(id={bid})",
                     "click_submit" if target == submit else "click_next")
            prev_filled = [w for w in widgets if w.role == "textbox"]
    thanks = [Widget(next(ids), "text", "Thank you", 40, 80)]
    _maybe_dialog(emit, dialog, steps, f"{app} - {form} submitted", thanks, False, ids)
    emit(f"{app} - {form} submitted", thanks, False, "done()", "done")
    assert len(steps) == n_steps, (len(steps), n_steps)
    return Episode(seed, app, form, goal, fields, submit, tuple(steps))


def _runs(rng: random.Random, n_words: int, n_runs: int, words: list[str]) -> str:
    """``n_words`` words in ``n_runs`` runs (each >= 1 word) of one word, consecutive runs differ."""
    cuts = sorted(rng.sample(range(1, n_words), n_runs - 1))
    lengths = [b - a for a, b in zip([0] + cuts, cuts + [n_words])]
    seq, prev = [], None
    for n in lengths:
        prev = rng.choice([w for w in words if w != prev])
        seq += [prev] * n
    return " ".join(seq)


def _focus(widgets: list[Widget], submit: str) -> Widget | None:
    """The widget holding the keyboard focus: the first empty textbox, else the default button
    (the goal's submit button, or "Next"), else none (e.g. a view that must be scrolled)."""
    empty = next((w for w in widgets if w.role == "textbox" and w.value == ""), None)
    if empty is not None:
        return empty
    return next((w for w in widgets if w.role == "button" and w.label in (submit, "Next")), None)


def _maybe_dialog(emit, dialog: int, steps: list, title: str, widgets: list, more: bool,
                  ids) -> None:
    if len(steps) == dialog:
        emit(title, list(widgets), more, "key(esc)", "key",
             dialog_widget=Widget(next(ids), "button", "Close", 600, 360))


def _screenshots(index: int, title: str, widgets: list[Widget],
                 dialog_widget: Widget | None) -> tuple[dict, ...]:
    """1-3 deterministic screenshot specs: full screen, a crop of the form, the dialog if any."""
    def box(w: Widget) -> dict:
        return {"id": w.wid, "role": w.role, "label": w.label, "value": w.value,
                "bbox": [w.x, w.y, w.x + (240 if w.role == "textbox" else 120), w.y + 32]}
    drawn = [box(w) for w in widgets]
    shots = [{"name": f"step{index}_full", "width": SCREEN_W, "height": SCREEN_H,
              "title": title, "widgets": drawn}]
    if index % 2 == 1 and widgets:
        shots.append({"name": f"step{index}_form", "width": 640, "height": 400, "title": title,
                      "widgets": drawn})
    if dialog_widget is not None:
        shots.append({"name": f"step{index}_dialog", "width": 480, "height": 240, "title": "dialog",
                      "widgets": [box(dialog_widget)]})
    return tuple(shots)


def user_turns(episode: Episode) -> list[str]:
    """The user message of each step (the first carries the goal)."""
    return [(episode.goal + "\n" if s.index == 0 else "") + s.observation for s in episode.steps]


def render_messages(episode: Episode, step_index: int) -> list[dict]:
    """OpenAI-format chat messages for step ``step_index`` (previous actions as assistant turns)."""
    if not 0 <= step_index < len(episode.steps):
        raise IndexError(f"step_index={step_index}: episode has {len(episode.steps)} steps")
    users = user_turns(episode)
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}]
    for i in range(step_index + 1):
        msgs.append({"role": "user", "content": users[i]})
        if i < step_index:
            msgs.append({"role": "assistant", "content": episode.steps[i].action})
    return msgs


def _turn(role: str, content: str) -> str:
    # Same text as structured_model.CHAT_TEMPLATE renders.
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def render_prompt(episode: Episode, step_index: int) -> str:
    """The chat-templated prompt text for one step, ending in the assistant generation header."""
    return "".join(_turn(m["role"], m["content"]) for m in render_messages(episode, step_index)) \
        + "<|im_start|>assistant\n"


def transcript_segments(episode: Episode, keep: list[int] | None = None) -> list[tuple[str, bool]]:
    """The whole episode as (text, is_assistant_answer) pieces; their concatenation is the prompt of
    the last step followed by its answer. Answers include the closing ``<|im_end|>``.

    ``keep`` (sorted step indices, must start with 0, which carries the goal) gives a shorter but
    still well-formed conversation of only those steps: every kept answer stays correct, because an
    action depends only on the goal and the current screen."""
    if keep is not None and (not keep or keep[0] != 0 or sorted(set(keep)) != list(keep)
                             or keep[-1] >= len(episode.steps)):
        raise ValueError(f"keep={keep}: expected sorted unique step indices starting at 0")
    segs: list[tuple[str, bool]] = [(_turn("system", SYSTEM_PROMPT), False)]
    for step, user in zip(episode.steps, user_turns(episode)):
        if keep is not None and step.index not in keep:
            continue
        segs.append((_turn("user", user) + "<|im_start|>assistant\n", False))
        segs.append((step.action + "<|im_end|>", True))
        segs.append(("\n", False))
    return segs


def parse_action(text: str) -> dict | None:
    """Parse one action (surrounding whitespace and a trailing <|im_end|> allowed); None if invalid."""
    text = text.strip()
    if text.endswith("<|im_end|>"):
        text = text[: -len("<|im_end|>")].rstrip()
    m = ACTION_RE.fullmatch(text)
    if m is None:
        return None
    if m["click"]:
        return {"name": "click", "id": int(m["click"])}
    if m["type"]:
        return {"name": "type", "id": int(m["type"]), "text": m["text"]}
    if m["scroll"]:
        return {"name": "scroll", "direction": m["scroll"]}
    if m["key"]:
        return {"name": "key", "key": m["key"]}
    return {"name": "done"}


def is_valid_action(text: str) -> bool:
    return parse_action(text) is not None


def grade(action_text: str, step: Step) -> dict:
    """{'valid': bool, 'correct': bool} of an answer against the step's correct action."""
    got = parse_action(action_text)
    return {"valid": got is not None, "correct": got is not None and got == parse_action(step.action)}


ACTION_SYNTAX_MIN_VALID = 0.9


def action_validator_for(control_texts: Iterable[str], min_valid: float = ACTION_SYNTAX_MIN_VALID
                         ) -> Callable[[str], bool] | None:
    """``is_valid_action`` when the control arm speaks the language (at least ``min_valid`` of its
    outputs are valid actions), else None: a model that never learned the language is graded on
    degenerate output alone, or every answer of both arms would count as failed."""
    valid = [is_valid_action(t) for t in control_texts]
    return is_valid_action if valid and sum(valid) / len(valid) >= min_valid else None
