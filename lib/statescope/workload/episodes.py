"""Multi-step shared-prefix workloads: episodes whose step prompts grow by the previous answer.

What it does (for now): ``shared_prefix_episodes`` makes ``n_episodes`` episodes of ``n_steps``
text steps over one stable system prompt; ``run_episodes`` drives any engine with a
``generate(prompts, max_tokens=...)`` method step by step — a step's prompt is the previous
prompt + the previous answer + a new observation, so every step after the first can hit the
prefix cache. The GUI-agent language, screenshots, geometry controls and trace files extend this
module in the reproduce issue.

What it deliberately does not do: judge outputs (``statescope.verdict.detect``) or store them
(``statescope.records``).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

SYSTEM_PROMPT = ("You operate a desktop through actions. Read each observation, keep the goal in "
                 "mind, answer with exactly one action.\n")


@dataclass
class Episode:
    episode_id: str
    goal: str
    observations: list[str]
    prompts: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)


def shared_prefix_episodes(n_episodes: int = 4, n_steps: int = 3, *, seed: int = 0,
                           system_repeat: int = 6) -> list[Episode]:
    """Deterministic small episodes; ``system_repeat`` lengthens the shared system prompt."""
    rng = random.Random(seed)
    widgets = ["button", "field", "menu", "tab", "checkbox", "link"]
    episodes = []
    for e in range(n_episodes):
        goal = f"open {rng.choice(widgets)} {rng.randint(1, 99)}"
        obs = []
        for s in range(n_steps):
            items = ", ".join(f"{rng.choice(widgets)}#{rng.randint(1, 99)}" for _ in range(4))
            obs.append(f"[step {s}] window {e}.{s}: {items}\n")
        episodes.append(Episode(f"ep{e}", goal, obs))
    return episodes


def step_prompt(episode: Episode, step: int, system_repeat: int = 6) -> str:
    """Prompt for ``step``: system + goal + all previous observations and answers + this one."""
    parts = [SYSTEM_PROMPT * system_repeat, f"goal: {episode.goal}\n"]
    for s in range(step):
        parts += [episode.observations[s], "action: " + episode.answers[s] + "\n"]
    parts += [episode.observations[step], "action: "]
    return "".join(parts)


def run_episodes(engine, episodes: list[Episode], *, max_tokens: int = 16,
                 system_repeat: int = 6, progress=None) -> list[dict]:
    """Advance all episodes in waves (one step each per wave); returns one dict per request.
    ``progress`` (``statescope.progress``) advances by each finished wave."""
    rows = []
    n_steps = max(len(e.observations) for e in episodes)
    for step in range(n_steps):
        live = [e for e in episodes if step < len(e.observations)]
        prompts = [step_prompt(e, step, system_repeat) for e in live]
        for ep, prompt, rec in zip(live, prompts, engine.generate(prompts, max_tokens=max_tokens)):
            ep.prompts.append(prompt)
            ep.answers.append(rec.text)
            row = rec.to_dict()
            row.update(episode=ep.episode_id, step=step)
            rows.append(row)
        if progress is not None:
            progress.advance(len(live))
    return rows


def summarize_requests(rows: list[dict]):
    """One line per request: episode, step, prompt/cached tokens, output."""
    from statescope.tables import RecordsTable

    return RecordsTable("requests", [
        {"episode": r["episode"], "step": r["step"], "prompt_tokens": len(r["prompt_token_ids"]),
         "cached_tokens": r["num_cached_tokens"], "output_tokens": len(r["output_token_ids"]),
         "finish": r["finish_reason"], "text": r["text"][:60]} for r in rows])


# --- GUI-agent traces (statescope.workload.guilang episodes as trace files) -------------------------------

PRESETS = {
    # name: (episodes, steps per episode, max_tokens, pad_lines); requests = episodes * steps
    "smoke": (4, 4, 24, 0),
    "laptop": (16, 6, 24, 0),
    "repro288": (48, 6, 32, 0),       # the reported repro set's shape: 288 requests
    "long": (8, 6, 32, 120),          # longer prompts: crosses more align blocks
}


GEOMETRIES = ("before", "at", "after")
IMAGE_GEOMETRY = "image_across"  # needs --vision: a block boundary inside the step's first image


def parse_seeds(text: str) -> list[int]:
    """``"0:12"`` -> 0..11, ``"0,3,5"`` -> [0, 3, 5], ``"7"`` -> [7] (the ``--seeds`` option)."""
    from statescope.errors import InputError

    try:
        if ":" in text:
            lo, hi = (int(x) for x in text.split(":", 1))
            seeds = list(range(lo, hi))
        else:
            seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        seeds = []
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise InputError(f"--seeds {text!r}: expected A:B (A < B), a comma list of distinct "
                         "non-negative integers, or one integer")
    return seeds


def seeds_trace(name: str, seeds: Sequence[int], *, max_episodes: int | None = None,
                vision: bool = False, geometry: str | None = None) -> list:
    """The ``name`` preset once per seed (its first ``max_episodes`` episodes), episode ids
    prefixed ``s<seed>-`` so that the seed sets of one study never share a request id."""
    import dataclasses

    steps = []
    for seed in seeds:
        trace = preset_trace(name, seed=seed, vision=vision, geometry=geometry)
        keep = list(dict.fromkeys(s.episode for s in trace))[:max_episodes]
        steps += [dataclasses.replace(s, episode=f"s{seed}-{s.episode}") for s in trace
                  if s.episode in keep]
    return steps


def preset_trace(name: str, *, vision: bool = False, seed: int = 0,
                 geometry: str | None = None) -> list:
    """The TraceSteps of a named preset. ``vision`` puts the steps' 1–3 PNG screenshots *before*
    the observation text (as GUI agents send them; the trained models then still read the
    focus line last); ``geometry`` ('before' | 'at' | 'after' | 'mixed') places every prompt end
    relative to the resolved Mamba block size (applied at run time; 'mixed' cycles the three by
    step), 'image_across' (with ``vision``) puts a block boundary inside each step's first image."""
    from statescope.workload import guilang
    from statescope.errors import InputError
    from statescope.workload.screenshots import image_part
    from statescope.workload.trace import TraceStep

    if name not in PRESETS:
        raise InputError(f"workload preset {name!r}: expected one of {sorted(PRESETS)}")
    if geometry not in (None, "mixed", IMAGE_GEOMETRY) + GEOMETRIES:
        raise InputError(f"workload geometry {geometry!r}: expected None, 'mixed', "
                         f"{IMAGE_GEOMETRY!r} (with vision) or one of {GEOMETRIES}")
    if geometry == IMAGE_GEOMETRY and not vision:
        raise InputError(f"workload geometry {IMAGE_GEOMETRY!r}: needs vision=True (--vision): "
                         "the steps carry no image to place")
    n_episodes, n_steps, max_tokens, pad_lines = PRESETS[name]
    steps = []
    for e in range(n_episodes):
        episode = guilang.generate_episode(seed * 100_003 + e, n_steps=n_steps)
        for step, user in zip(episode.steps, guilang.user_turns(episode)):
            if pad_lines and step.index == 0:
                user = "\n".join(f"(log {i}: nothing happened)" for i in range(pad_lines)) + "\n" + user
            content = user if not vision else (
                [image_part(s) for s in step.screenshots] + [{"type": "text", "text": user}])
            geo = None
            if geometry:
                align = GEOMETRIES[step.index % 3] if geometry == "mixed" else geometry
                geo = {"align": align, "offset": 0}
            steps.append(TraceStep(f"ep{e:04d}", step.index, guilang.SYSTEM_PROMPT, content,
                                   max_tokens, expected=step.action, geometry=geo))
    return steps
